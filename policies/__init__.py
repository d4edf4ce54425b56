"""Built-in scheduling policies (one file each); importing this package registers them."""
from policies import fcfs  # noqa: F401
