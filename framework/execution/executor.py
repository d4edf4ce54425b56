"""The ``Executor`` interface (runs, or simulates, the step the scheduler decided) and KV-cache sizing."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from framework.common.clock import Clock, VirtualClock, WallClock
from framework.common.registry import Registry

if TYPE_CHECKING:
    from framework.common.config import EngineConfig
    from framework.common.outputs import Logprob
    from framework.common.sampling_params import SamplingParams
    from framework.scheduling.output import SchedulerOutput
    from models.config import ModelConfig
    from models.loader import ModelSource

GiB = 1 << 30


@dataclass
class ExecutorOutput:
    """Sampled token per request that reached its last known token this step; for those asking,
    the ``{token_id: Logprob}`` of that position (no decoded text: the engine adds it).
    ``prompt_logprobs`` continues each asking request's ``prompt_logprobs`` list, in order."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


class Executor(ABC):
    """``kv_block_counts``: the device blocks (null block included) and CPU swap blocks that fit; ``initialize``:
    called once with the chosen counts; ``execute``: applies the step's swap and copy lists, runs its tokens and
    returns the sampled ones. It may advance the clock, never touch the scheduler's queues or allocator."""

    name: ClassVar[str] = ""
    #: Whether ``execute`` gives each of ``Request.forks`` a first token when their leader completes
    #: its prompt (vLLM v0's parallel sampling, with a preparer that ``forks_parallel_samples``);
    #: otherwise the engine runs a request's ``n`` samples as ``n`` independent requests.
    samples_forks: ClassVar[bool] = False
    #: Whether the sampled tokens are a model's, with text to decode: a simulator's synthetic
    #: tokens have none, and the engine refuses what would read it (``SamplingParams.stop``).
    produces_text: ClassVar[bool] = True
    #: Whether ``execute`` returns ``ExecutorOutput.logprobs`` and ``prompt_logprobs`` for requests
    #: that ask for them; without it the engine refuses such requests.
    returns_logprobs: ClassVar[bool] = False
    #: Whether ``launch`` and ``collect`` run a step without waiting for it, as async scheduling needs: the
    #: engine schedules the next step while one runs, its requests' sampled tokens still placeholders.
    supports_async: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, source: ModelSource, clock: Clock) -> None:
        self.config = config
        self.source = source
        self.clock = clock

    @classmethod
    def make_clock(cls) -> Clock:
        """The clock an engine runs on when it is given none: wall time, for real execution."""
        return WallClock()

    @classmethod
    def load_tokenizer(cls, source: ModelSource) -> Any | None:
        """The tokenizer an executor of this class gives its engine for ``source``: None (prompts are token ids)
        unless it decodes text. A class method, so that a run can tokenize its workload before building one."""
        return None

    @property
    def tokenizer(self) -> Any | None:
        return None

    @property
    def device(self) -> str:
        return "cpu"

    def check_request(self, params: SamplingParams) -> None:
        """ValueError, one line naming the option, for sampling parameters this executor cannot
        honour (checked before the request is queued)."""
        name = self.name or type(self).__name__
        if params.stop and not self.produces_text:
            raise ValueError(f"executor={name} samples synthetic tokens with no text: it cannot simulate "
                             f"SamplingParams.stop (stop strings); use stop_token_ids or max_tokens")
        for option in ("logprobs", "prompt_logprobs") if not self.returns_logprobs else ():
            value = getattr(params, option)
            if value is not None:
                raise ValueError(f"executor={name} cannot return {option.replace('_', ' ')} (SamplingParams.{option}="
                                 f"{value}): leave {option} None, or run executor=model")

    @abstractmethod
    def kv_block_counts(self) -> tuple[int, int]: ...

    @abstractmethod
    def initialize(self, num_blocks: int, num_cpu_blocks: int) -> None: ...

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ExecutorOutput: ...

    def launch(self, out: SchedulerOutput) -> Any:
        """Start ``out`` (committed: its tokens sampled by the step before are placeholders, which the
        executor takes from that step) and return a handle for ``collect``, without waiting for it."""
        raise NotImplementedError(f"executor {self.name!r} cannot run steps asynchronously")

    def collect(self, handle: Any) -> ExecutorOutput:
        """Wait for a launched step and return what ``execute`` would have."""
        raise NotImplementedError(f"executor {self.name!r} cannot run steps asynchronously")


EXECUTORS: Registry[Executor] = Registry(
    "executor", Executor, entry_point_group="framework.executors", builtin="framework.execution.executors")


def simulates_time(executor: str) -> bool:
    """Whether the executor registered as ``executor`` runs on simulated time: its own clock
    (``Executor.make_clock``) is a ``VirtualClock``, which it advances itself. Asked of the class,
    not its name, so a registered subclass runs as its base does."""
    return isinstance(EXECUTORS.get(executor).make_clock(), VirtualClock)


def size_kv_cache(config: EngineConfig, bytes_per_block: int, device_budget: Callable[[], float]) -> tuple[int, int]:
    """(device blocks, null block included; CPU swap blocks) of ``bytes_per_block`` each. Device blocks:
    ``num_gpu_blocks_override`` as given, else ``kv_cache_memory_gb`` or ``device_budget()`` bytes, all of it
    (as vLLM: what running requests leave keeps cached prefixes); swap: ``swap_space`` GiB, capped at what
    ``max_num_seqs`` requests of ``max_model_len`` tokens use, the most it ever holds."""
    assert config.max_model_len is not None
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    else:
        budget = config.kv_cache_memory_gb * GiB if config.kv_cache_memory_gb is not None else device_budget()
        num_blocks = int(budget // bytes_per_block)
    useful = config.max_num_seqs * -(-config.max_model_len // config.block_size)
    num_cpu_blocks = min(int(config.swap_space * GiB // bytes_per_block), useful)
    return num_blocks, num_cpu_blocks


def activation_peak_bytes(model: ModelConfig, config: EngineConfig, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Activation bytes of the largest step on one device: the widest per-token tensors (fused gate/up,
    qkv, residual) for every batched token, twice, plus float32 logits of the whole vocabulary for every
    sequence (vLLM gathers the tensor-parallel shares onto the device that samples)."""
    tp = tensor_parallel_size
    kv = model.kv_size_per_device(tp)
    per_token = (2 * model.intermediate_size // tp + model.q_size // tp + 2 * kv + 4 * model.hidden_size) * dtype_bytes
    return config.max_num_batched_tokens * per_token * 2 + config.max_num_seqs * model.vocab_size * 4


def check_kv_capacity(config: EngineConfig, num_blocks: int) -> None:
    """ValueError, naming the setting to change, when ``num_blocks`` device blocks (null block included) hold less
    than one request of ``max_model_len``."""
    assert config.max_model_len is not None
    usable = max(num_blocks - 1, 0)  # a budget below one block sizes no block, not the null block
    capacity = usable * config.block_size
    if capacity < config.max_model_len:
        raise ValueError(f"the KV cache holds {usable} blocks x {config.block_size} tokens = {capacity} tokens, less "
                         f"than one request of max_model_len={config.max_model_len}; raise {kv_cache_setting(config)} "
                         f"or lower max_model_len")


def kv_cache_setting(config: EngineConfig) -> str:
    """The setting that sized the KV cache, in ``EngineConfig``'s order of precedence: what to
    raise when it is too small."""
    if config.num_gpu_blocks_override is not None:
        return f"num_gpu_blocks_override (now {config.num_gpu_blocks_override})"
    if config.kv_cache_memory_gb is not None:
        return f"kv_cache_memory_gb (now {config.kv_cache_memory_gb})"
    return (f"cpu_kv_cache_gb (now {config.cpu_kv_cache_gb}) on a CPU or gpu_memory_utilization "
            f"(now {config.gpu_memory_utilization}) on a GPU, set kv_cache_memory_gb or num_gpu_blocks_override,")
