"""Built-in attention backends (one file each); importing this package registers them.

Backends that need triton or flash-attn import them when constructed, never at import time.
"""
from backends import naive  # noqa: F401
from backends import torch_paged  # noqa: F401
from backends import triton_paged  # noqa: F401
from backends import flash_attn  # noqa: F401
