"""A research framework for LLM serving.

Four pluggable parts, each an abstract class with a registry: ``SchedulerPolicy`` (POLICIES),
``BlockAllocator`` (ALLOCATORS), ``AttentionBackend`` (BACKENDS) and ``InputPreparer``
(PREPARERS); plus ``Executor`` (EXECUTORS) for real or simulated execution.
"""
import os as _os
import sys as _sys
import warnings as _warnings

# Spinning OpenMP workers make small-thread-count torch runs many times slower on shared CPUs.
# libgomp reads this when torch loads, so it only helps if set before torch is imported.
if "OMP_WAIT_POLICY" not in _os.environ:
    if "torch" in _sys.modules:
        _warnings.warn("torch was imported before framework: set OMP_WAIT_POLICY=PASSIVE yourself "
                       "for fast CPU runs", stacklevel=2)
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from framework.attention import BACKENDS, AttentionBackend, AttentionMetadata  # noqa: E402
from framework.block_allocator import ALLOCATORS, BlockAllocator  # noqa: E402
from framework.config import EngineConfig  # noqa: E402
from framework.engine import LLMEngine, StepStats  # noqa: E402
from framework.executor import EXECUTORS, Executor  # noqa: E402
from framework.input_preparer import PREPARERS, InputPreparer, ModelInput  # noqa: E402
from framework.llm import LLM  # noqa: E402
from framework.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from framework.registry import Registry, UnknownNameError  # noqa: E402
from framework.request import Request, RequestStatus  # noqa: E402
from framework.sampling_params import SamplingParams  # noqa: E402
from framework.scheduler import POLICIES, Scheduler, SchedulerOutput, SchedulerPolicy  # noqa: E402

__all__ = [
    "ALLOCATORS", "BACKENDS", "EXECUTORS", "LLM", "POLICIES", "PREPARERS", "AttentionBackend",
    "AttentionMetadata", "BlockAllocator", "CompletionOutput", "EngineConfig", "Executor", "InputPreparer",
    "LLMEngine", "ModelInput", "Registry", "Request", "RequestMetrics", "RequestOutput", "RequestStatus",
    "SamplingParams", "Scheduler", "SchedulerOutput", "SchedulerPolicy", "StepStats", "UnknownNameError",
]
