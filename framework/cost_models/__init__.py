"""Built-in cost models (one file each); importing this package registers them."""
from framework.cost_models import replay, roofline  # noqa: F401
