"""Built-in workloads (one file each); importing this package registers them."""
from framework.workloads import sharegpt, synthetic, trace  # noqa: F401
