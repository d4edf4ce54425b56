"""Built-in workloads (one file each); importing this package registers them."""
from framework.harness.workloads import sharegpt, synthetic, trace  # noqa: F401
