"""Built-in block allocators (one file each); importing this package registers them."""
from framework.kv.allocators import paged  # noqa: F401
