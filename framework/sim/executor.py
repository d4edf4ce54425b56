"""The simulated executor: no weights, no KV tensors; a cost model says how far each step moves the clock."""
from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

from framework.common.clock import Clock, VirtualClock
from framework.common.config import DTYPE_BYTES, EngineConfig, check_bool, is_int, resolve_dtype_name
from framework.sim.cost_model import COST_MODELS, BatchShape, CostModel
from framework.execution.executor import EXECUTORS, GiB, Executor, ExecutorOutput, activation_peak_bytes, size_kv_cache
from framework.sim.fast_forward import plans_as_it_runs
from framework.sim.hardware import Hardware, load_hardware
from framework.common.registry import split_spec
from framework.common.request import Request
from framework.scheduling.output import SchedulerOutput
from models.loader import ModelSource

logger = logging.getLogger(__name__)


@EXECUTORS.register("sim")
class SimExecutor(Executor):
    """Options (``executor_options``):

    - ``hardware``: a ``conf/hardware`` preset name, a YAML path or a dict (default ``a100-80gb``);
    - ``tensor_parallel_size``: devices per replica (weights, heads and KV cache are split);
    - ``cost_model``: ``{"name": ..., **options}`` (default ``{"name": "roofline"}``);
    - ``fast_forward``: let the run driver advance pure-decode runs in one go
      (``framework/sim/fast_forward.py``: same results, fewer Python steps); off for step-by-step
      (and for a subclass overriding ``execute`` or ``token_for`` but not ``plan_decode_run``);
    - ``sampled_token``: the token every request samples (default: the highest id that is not an
      EOS id). Requests never stop on it: output lengths are the requests' ``max_tokens``.

    Its tokens have no text: a request with stop strings (``SamplingParams.stop``) is refused. With async
    scheduling (``async_scheduling=true``; ``auto`` leaves it off) a step lasts the longer of its host time and
    the step before's device time, once the pipeline is full.
    """

    samples_forks = True  # an n > 1 request under preparer v0 prefills once and forks, as for real
    produces_text = False  # its tokens are synthetic: a stop string could never match, so it is refused
    supports_async = True  # async scheduling overlaps each step's host time with the step before's device time

    def __init__(self, config: EngineConfig, source: ModelSource, clock: Clock,
                 hardware: str | dict[str, Any] | Hardware = "a100-80gb", tensor_parallel_size: int = 1,
                 cost_model: dict[str, Any] | str | None = None, fast_forward: bool = True,
                 sampled_token: int | None = None) -> None:
        super().__init__(config, source, clock)
        if not isinstance(clock, VirtualClock):
            raise ValueError("executor=sim advances simulated time: give the engine a VirtualClock (or no clock)")
        self.hardware = load_hardware(hardware)
        self.tp = tensor_parallel_size
        self.dtype = resolve_dtype_name(config.dtype, source.config.torch_dtype, self.hardware.device_type,
                                        self.hardware.dtype)
        self.dtype_bytes = DTYPE_BYTES[self.dtype]
        model = source.config
        name, _ = split_spec(cost_model, "roofline", COST_MODELS.kind)
        # A plugin cost model taking no ``dtype`` keyword still loads: it gets the dtype as an
        # attribute, which is all the base class keeps of it.
        takes_dtype = name is None or "dtype" in inspect.signature(COST_MODELS.get(name)).parameters
        self.cost_model: CostModel = COST_MODELS.create_from(cost_model, model, self.hardware, self.dtype_bytes,
                                                             tensor_parallel_size, config.block_size, default="roofline",
                                                             **({"dtype": self.dtype} if takes_dtype else {}))
        self.cost_model.dtype = self.dtype
        check_bool("executor.fast_forward", fast_forward)
        self.fast_forward = fast_forward
        eos = set(model.eos_token_ids)
        if sampled_token is None:
            sampled_token = next(t for t in range(model.vocab_size - 1, -1, -1) if t not in eos)
        if not (is_int(sampled_token) and 0 <= sampled_token < model.vocab_size) or sampled_token in eos:
            raise ValueError(f"sampled_token must be a non-EOS id in [0, {model.vocab_size}), got {sampled_token!r}")
        self.sampled_token = sampled_token
        self._eos = eos
        #: One KV block on one device: what the budget is divided into.
        self.bytes_per_block = config.block_size * model.kv_bytes_per_token(self.dtype_bytes, self.tp)
        self.num_steps = 0
        self._device_free = 0.0  # when the device finishes the last launched step (async scheduling)

    @classmethod
    def make_clock(cls) -> Clock:
        return VirtualClock()

    # -- memory ----------------------------------------------------------------------------------
    def kv_block_counts(self) -> tuple[int, int]:
        return size_kv_cache(self.config, self.bytes_per_block, self._device_budget)

    def weight_bytes(self) -> float:
        """One device's share of the weights (KV projections replicated where there are fewer KV
        heads than devices)."""
        return self.source.config.num_params_per_device(self.tp) * self.dtype_bytes

    def _device_budget(self) -> float:
        """vLLM's sizing: ``gpu_memory_utilization`` of the device, less the runtime's own memory,
        the weights and the activation peak of the largest step."""
        hw, config = self.hardware, self.config
        if hw.device_type == "cpu":
            return config.cpu_kv_cache_gb * GiB
        weights = self.weight_bytes()
        activations = activation_peak_bytes(self.source.config, config, self.dtype_bytes, self.tp)
        usable = hw.memory_bytes * config.gpu_memory_utilization - hw.runtime_reserved_gib * GiB
        budget = usable - weights - activations
        if budget <= 0:
            # The usable figure excludes the runtime's reserve: it is what weights and activations must fit in.
            raise ValueError(
                f"model {config.model!r} does not fit on {hw.name!r} with tensor_parallel_size={self.tp}: "
                f"{weights / GiB:.2f} GiB of weights and {activations / GiB:.2f} GiB of activations per device, "
                f"{usable / GiB:.2f} GiB usable (gpu_memory_utilization={config.gpu_memory_utilization} of "
                f"{hw.memory_gib} GiB, less {hw.runtime_reserved_gib} GiB the runtime reserves); raise "
                f"tensor_parallel_size or gpu_memory_utilization, or pick larger hardware")
        return budget

    def initialize(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        logger.info("KV cache (simulated, %s, per device): %d blocks x %d tokens (%.1f MiB), swap space %d blocks",
                    self.hardware.name, num_blocks, self.config.block_size, num_blocks * self.bytes_per_block / 2**20,
                    num_cpu_blocks)

    # -- steps -----------------------------------------------------------------------------------
    def token_for(self, request: Request) -> int:
        """The token ``request`` samples: the sampled token, unless it is one of its stop tokens."""
        stops = request.sampling_params.stop_token_ids
        if not stops or self.sampled_token not in stops:
            return self.sampled_token
        return next(t for t in range(self.source.config.vocab_size) if t not in stops and t not in self._eos)

    def execute(self, out: SchedulerOutput) -> ExecutorOutput:
        sampling: list[Request] = []
        shape = BatchShape.from_scheduler_output(out, sampling)
        self.clock.advance(self.cost_model.step_time(shape))  # type: ignore[attr-defined]
        self.num_steps += 1
        return ExecutorOutput(self._sampled(sampling))

    def launch(self, out: SchedulerOutput) -> SimStep:
        """Async scheduling: the step's host time (``CostModel.host_time``) passes on the clock, then its
        device time runs on the device once the step before's is done, while the engine goes on."""
        sampling: list[Request] = []
        shape = BatchShape.from_scheduler_output(out, sampling)
        total = self.cost_model.step_time(shape)
        host = min(self.cost_model.host_time(shape), total)
        self.clock.advance(host)  # type: ignore[attr-defined]
        self._device_free = max(self.clock.now(), self._device_free) + (total - host)
        self.num_steps += 1
        return SimStep(self._device_free, self._sampled(sampling))

    def collect(self, handle: SimStep) -> ExecutorOutput:
        self.clock.wait_until(handle.done)
        return ExecutorOutput(handle.sampled)

    def _sampled(self, sampling: list[Request]) -> dict[str, int]:
        sampled = {req.request_id: self.token_for(req) for req in sampling}
        for req in sampling:  # a v0 leader completing its prompt samples for its forks too
            for child in req.forks:
                sampled[child.request_id] = self.token_for(child)
        return sampled

    def plan_decode_run(self, segments: list[tuple[int, int, int]], until: float = math.inf) -> list[float]:
        """End times of consecutive pure-decode steps, bit for bit those stepping gives: segment ``(steps,
        num_seqs, context)`` is ``steps`` steps of ``num_seqs`` rows attending to ``context`` keys on its first
        (``num_seqs`` more each step); stops before a step that would start at or after ``until``."""
        t = self.clock.now()
        times: list[float] = []
        cost = self.cost_model.decode_step_time
        if not plans_as_it_runs(self.cost_model, ("step_time",), ("decode_step_time",)):
            # A subclass overriding step_time alone (a roofline made slower, say) would otherwise
            # be timed here by its base's decode_step_time: the generic one asks its step_time.
            cost = functools.partial(CostModel.decode_step_time, self.cost_model)
        for steps, num_seqs, context in segments:
            for _ in range(steps):
                if t >= until:
                    return times
                t = t + cost(num_seqs, context)
                times.append(t)
                context += num_seqs
        return times

    def commit_decode_run(self, times: list[float]) -> None:
        self.clock.wait_until(times[-1])
        self.num_steps += len(times)


@dataclass
class SimStep:
    """A launched simulated step: when the device finishes it, and the tokens it samples."""

    done: float
    sampled: dict[str, int]
