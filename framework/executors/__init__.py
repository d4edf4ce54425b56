"""Built-in executors (one file each); importing this package registers them.

``model`` needs torch, so it is imported when first asked for: a simulated run never loads torch.
"""
from framework.executor import EXECUTORS
from framework.executors import sim  # noqa: F401

EXECUTORS.register_lazy("model", "framework.executors.model")
