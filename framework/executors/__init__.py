"""Built-in executors (one file each); importing this package registers them."""
from framework.executors import model  # noqa: F401
