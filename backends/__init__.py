"""Built-in attention backends (one file each); importing this package registers them.

Backends that need triton or flash-attn import them when constructed, never at import time.
"""
from backends import naive  # noqa: F401
