"""Built-in input preparers (one file each; ``sequence.py`` is the ``v0`` preparer's data model);
importing this package registers them."""
from framework.execution.preparers import v0, v1  # noqa: F401
