"""The ``Executor`` interface: runs what the scheduler decided.

Everything above it (policy, scheduler mechanism, block allocator, scheduler outputs) is the
same code whether the step runs a real forward pass (``model``) or is only timed (a simulator),
so a policy is tested once and studied at any scale.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from framework.registry import Registry

if TYPE_CHECKING:
    from framework.clock import Clock
    from framework.config import EngineConfig
    from framework.scheduler import SchedulerOutput
    from models.loader import ModelSource


@dataclass
class ExecutorOutput:
    """Sampled token per request that reached its last known token this step."""

    sampled: dict[str, int] = field(default_factory=dict)


class Executor(ABC):
    """Contract: ``kv_block_counts`` says how many device blocks (the null block included) and
    CPU swap blocks fit; ``initialize`` is called once with the counts the engine settled on;
    ``execute`` applies the step's swap-out, swap-in and copy lists, then runs the scheduled
    tokens and returns the sampled ones. It may advance the clock (a simulator does); it may not
    touch the scheduler's queues or the allocator."""

    name: ClassVar[str] = ""

    def __init__(self, config: EngineConfig, source: ModelSource, clock: Clock) -> None:
        self.config = config
        self.source = source
        self.clock = clock

    @property
    def tokenizer(self) -> Any | None:
        return None

    @property
    def device(self) -> str:
        return "cpu"

    @abstractmethod
    def kv_block_counts(self) -> tuple[int, int]: ...

    @abstractmethod
    def initialize(self, num_blocks: int, num_cpu_blocks: int) -> None: ...

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ExecutorOutput: ...


EXECUTORS: Registry[Executor] = Registry(
    "executor", Executor, entry_point_group="framework.executors", builtin="framework.executors")
