"""Built-in executors (one file each); importing this package registers them.

``model`` needs torch, so it is imported when first asked for: a simulated run never loads torch.
"""
from framework.execution.executor import EXECUTORS
EXECUTORS.register_lazy("model", "framework.execution.executors.model")
EXECUTORS.register_lazy("sim", "framework.sim.executor")
