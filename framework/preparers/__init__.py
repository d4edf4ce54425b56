"""Built-in input preparers (one file each); importing this package registers them."""
from framework.preparers import v1  # noqa: F401
