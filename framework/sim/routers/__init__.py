"""Built-in routers (one file each); importing this package registers them."""
from framework.sim.routers import least_outstanding, prefix_aware, round_robin  # noqa: F401
