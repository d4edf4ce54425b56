"""servelab's public API: the engine, its config and outputs, and each pluggable interface with its registry.

Registries: POLICIES (``SchedulerPolicy``), ALLOCATORS (``BlockAllocator``), BACKENDS (``AttentionBackend``),
PREPARERS (``InputPreparer``), EXECUTORS (``Executor``), COST_MODELS (``CostModel``), ROUTERS (``Router``),
WORKLOADS (``Workload``), LOGGERS (``RunLogger``).
"""
import os as _os
import sys as _sys
import warnings as _warnings

# Spinning OpenMP workers make small-thread-count torch runs many times slower on shared CPUs;
# libgomp reads this when torch loads, so it must be set before torch is imported.
if "OMP_WAIT_POLICY" not in _os.environ:
    if "torch" in _sys.modules:
        _warnings.warn("torch was imported before framework: set OMP_WAIT_POLICY=PASSIVE yourself "
                       "for fast CPU runs", stacklevel=2)
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from framework.kv.block_allocator import ALLOCATORS, BlockAllocator  # noqa: E402
from framework.common.config import EngineConfig  # noqa: E402
from framework.engine.llm_engine import LLMEngine, StepStats  # noqa: E402
from framework.execution.executor import EXECUTORS, Executor  # noqa: E402
from framework.engine.llm import LLM  # noqa: E402
from framework.common.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from framework.common.registry import Registry, UnavailableError, UnknownNameError  # noqa: E402
from framework.common.request import Request, RequestStatus  # noqa: E402
from framework.common.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from framework.scheduling.output import SchedulerOutput  # noqa: E402
from framework.scheduling.policy import POLICIES, SchedulerPolicy  # noqa: E402
from framework.scheduling.scheduler import Scheduler  # noqa: E402
from framework.sim.cost_model import COST_MODELS, BatchShape, CostModel  # noqa: E402
from framework.sim.router import ROUTERS, Router  # noqa: E402
from framework.harness.cluster import Cluster  # noqa: E402
from framework.harness.workload import WORKLOADS, Workload  # noqa: E402
from framework.harness.run_logger import LOGGERS, RunLogger  # noqa: E402

# The attention and input-preparation interfaces load torch (about 2 s and 250 MB): imported on
# first use, so that simulated runs, which never touch a tensor, never pay for it.
_TORCH_EXPORTS = {
    "BACKENDS": "framework.execution.attention", "AttentionBackend": "framework.execution.attention",
    "AttentionMetadata": "framework.execution.attention", "PREPARERS": "framework.execution.input_preparer",
    "InputPreparer": "framework.execution.input_preparer", "ModelInput": "framework.execution.input_preparer",
}


def __getattr__(name: str):
    module = _TORCH_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'framework' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "ALLOCATORS", "BACKENDS", "COST_MODELS", "EXECUTORS", "LLM", "LOGGERS", "POLICIES",
    "PREPARERS", "ROUTERS", "WORKLOADS", "AttentionBackend", "AttentionMetadata", "BatchShape",
    "BlockAllocator", "Cluster", "CompletionOutput", "CostModel", "EngineConfig", "Executor",
    "InputPreparer", "LLMEngine", "ModelInput", "Registry", "Request", "RequestMetrics",
    "RequestOutput", "RequestOutputKind", "RequestStatus", "Router", "RunLogger", "SamplingParams", "Scheduler",
    "SchedulerOutput", "SchedulerPolicy", "StepStats", "UnavailableError", "UnknownNameError",
    "Workload",
]
