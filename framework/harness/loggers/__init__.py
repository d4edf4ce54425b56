"""Built-in run loggers (one file each); importing this package registers them."""
from framework.harness.loggers import none, wandb  # noqa: F401
