"""The shadow engine: drive the real engine, scheduler and paged allocator with a fake model whose "KV cache" stores
token ids, so every step can check that each request reads exactly its own tokens back.

``ShadowExecutor`` (registered as executor ``shadow``) applies the step's swap and copy lists
with the real ``ModelRunner.apply_block_ops`` to a cache of shape ``[2, 1, blocks, block_size,
1, 1]``: slot ``(0, ...)`` holds the token id written there, slot ``(1, ...)`` its position. It
then writes the scheduled tokens into their slots, reads back every token the request attends
to, and asserts they are the request's tokens in order. The next token is a function of what was
read back (the last few tokens and the length), so a wrong cache also shows as a wrong output;
``reference_output`` computes the same function without an engine. With async scheduling it runs each
step as it is launched, taking a token the scheduler still holds as a placeholder from the step before's
samples, as the model runner takes it from the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from framework.common.clock import VirtualClock
from framework.common.config import EngineConfig
from framework.common.request import PLACEHOLDER
from framework.common.sampling_params import SamplingParams
from framework.engine.llm_engine import LLMEngine
from framework.execution.executor import EXECUTORS, Executor, ExecutorOutput
from framework.execution.model_runner import ModelRunner
from framework.scheduling.output import SchedulerOutput

#: Fake vocabulary: ids 2 (the tiny presets' EOS) .. 2 + VOCAB - 1.
VOCAB = 38
EOS = 2


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the last tokens and the context length."""
    return EOS + (31 * sum(context[-6:]) + 7 * len(context)) % VOCAB


def reference_output(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """What a correct engine must generate with the fake model (stops as ``Request.check_stop``)."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if (not params.ignore_eos and t == EOS) or t in params.stop_token_ids:
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


@EXECUTORS.register("shadow")
class ShadowExecutor(Executor):
    """Options: ``num_blocks`` (device, the null block included) and ``num_cpu_blocks``."""

    supports_async = True

    def __init__(self, config, source, clock, num_blocks: int = 64, num_cpu_blocks: int = 0) -> None:
        super().__init__(config, source, clock)
        self.counts = (num_blocks, num_cpu_blocks)
        self.runner: ModelRunner | None = None
        self.num_checked_tokens = 0
        self._last_sampled: dict[str, int] = {}  # the last launched step's tokens, for placeholders

    def kv_block_counts(self) -> tuple[int, int]:
        return self.counts

    def initialize(self, num_blocks: int, num_cpu_blocks: int) -> None:
        cache = torch.full((2, 1, num_blocks, self.config.block_size, 1, 1), -1.0, dtype=torch.float64)
        # Only the runner's block-op code is used; the model, backend, preparer and sampler are not.
        self.runner = ModelRunner(None, None, None, None, cache, num_cpu_blocks)  # type: ignore[arg-type]

    def launch(self, out: SchedulerOutput) -> ExecutorOutput:
        output = self.execute(out)
        self._last_sampled = output.sampled
        return output

    def collect(self, handle: ExecutorOutput) -> ExecutorOutput:
        return handle

    def execute(self, out: SchedulerOutput) -> ExecutorOutput:
        assert self.runner is not None
        self.runner.apply_block_ops(out)
        cache = self.runner.kv_cache.view(2, -1)
        bs = self.config.block_size
        sampled = {}
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            positions = torch.arange(end)
            slots = torch.tensor(req.block_ids, dtype=torch.long)[positions // bs] * bs + positions % bs
            new = slots[start:]
            tokens = req.token_ids[:end]
            if tokens and tokens[-1] == PLACEHOLDER:  # sampled by the step in flight
                tokens = tokens[:-1] + [self._last_sampled[req.request_id]]
            assert PLACEHOLDER not in tokens, f"{req.request_id} computes a placeholder not sampled by the step before"
            cache[0, new] = torch.tensor(tokens[start:], dtype=torch.float64)
            cache[1, new] = positions[start:].double()
            seen = cache[0, slots].long().tolist()
            assert seen == tokens, f"{req.request_id} reads a wrong KV cache: {seen} != {tokens}"
            assert cache[1, slots].long().tolist() == positions.tolist(), f"{req.request_id} reads wrong positions"
            self.num_checked_tokens += end
            if end == req.num_tokens:
                sampled[req.request_id] = next_token(seen)
        return ExecutorOutput(sampled)


@dataclass
class Arrival:
    """One request of a workload: when it arrives (engine step), what it asks, and when (if ever)
    the client aborts it (steps after arrival)."""

    request_id: str
    step: int
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    abort_after: int | None = None


@dataclass
class Run:
    outputs: dict = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    engine: LLMEngine | None = None
    aborted: set = field(default_factory=set)


def shadow_engine(policy: str, num_blocks: int, num_cpu_blocks: int = 0, policy_options: dict | None = None,
                  max_prompt_len: int | None = None, **kwargs) -> LLMEngine:
    """``max_prompt_len``: as ``LLMEngine``'s, what a prefill-first policy's token budget must hold."""
    args = dict(model="tiny-llama", executor="shadow", policy=policy, policy_options=policy_options or {},
                executor_options={"num_blocks": num_blocks, "num_cpu_blocks": num_cpu_blocks},
                block_size=4, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8, check_invariants=True)
    args.update(kwargs)
    return LLMEngine(EngineConfig(**args), clock=VirtualClock(), max_prompt_len=max_prompt_len)


def drive(engine: LLMEngine, arrivals: list[Arrival], max_steps: int, on_step=None) -> Run:
    """Add each request at its step (arrival time = its step, plus a tie-breaker), abort the ones
    that ask for it, and step until everything finished. Fails if that takes over ``max_steps``."""
    run = Run(engine=engine)
    engine.step_callbacks.append(lambda stats, out: run.steps.append(out))
    if on_step is not None:
        engine.step_callbacks.append(on_step)
    clock = engine.clock
    pending = sorted(arrivals, key=lambda a: a.step)
    aborts: dict[int, list[str]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        assert step < max_steps, (f"not done after {max_steps} steps: {len(engine.scheduler.waiting)} waiting, "
                                  f"{len(engine.scheduler.running)} running, {len(engine.scheduler.swapped)} swapped")
        clock.wait_until(float(step))
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt, a.params, arrival_time=step + 1e-6 * len(run.outputs),
                               priority=a.priority)
            run.outputs[a.request_id] = None
            if a.abort_after is not None:
                aborts.setdefault(step + a.abort_after, []).append(a.request_id)
        for rid in aborts.pop(step, []):
            if rid in engine.scheduler.requests:  # not finished (nor ignored on arrival) yet
                run.aborted.add(rid)
            engine.abort_request(rid)
        for o in engine.step():
            if o.finished:
                run.outputs[o.request_id] = o
        step += 1
    return run
