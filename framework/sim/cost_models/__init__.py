"""Built-in cost models (one file each); importing this package registers them."""
from framework.sim.cost_models import replay, roofline  # noqa: F401
