"""Built-in scheduling policies (one file each); importing this package registers them."""
from policies import chunked, fcfs, least_computed, priority_swap, sjf  # noqa: F401
