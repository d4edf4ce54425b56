"""Advance a simulated engine by a run of pure-decode steps at once, with the same result as
stepping them one by one.

Between two events (an arrival, a request finishing, a preemption, a swap) a serving engine
mostly repeats one step: every running request computes one token. When the policy promises
that (``SchedulerPolicy.steady_decode``), nothing waits or is swapped, and the free blocks cover
every block the steps will start, the scheduler's decisions for the next ``J`` steps are known
without asking it, up to and including the first step on which a request finishes.
``plan_decode_run`` works out those steps and their times without changing anything, and
``commit_decode_run`` applies the first ``k`` of them:

- the allocator sees exactly the ``allocate_slots(request, 1)`` calls of the step-by-step run,
  in the same (step, running-order) order, less the calls that change nothing
  (``BlockAllocator.allocate_decode_run``), so block ids, prefix-cache contents and evictions
  come out identical;
- the step times are the executor's, computed step by step from the same batch shapes
  (``SimExecutor.plan_decode_run``), so every token time is bit-for-bit the same;
- each request gets its tokens, token times and computed-token count in bulk; a request
  finishing on the last step gets that step's token through ``Scheduler.update_from_output``,
  which finishes it as an ordinary step would; steps are counted, and step callbacks that can
  take a whole run (``on_decode_run``) get one.

Everything else (the first step after an arrival, a step that needs a block the pool lacks, a
preemption) is left to ``LLMEngine.step``. Turn it off with the sim executor's
``fast_forward=False`` to step one by one.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from framework.request import Request, RequestStatus
from framework.scheduler import SchedulerOutput, SchedulerPolicy

if TYPE_CHECKING:
    from framework.engine import LLMEngine


@dataclass
class DecodeRun:
    """Steps ``first_step .. first_step + len(end_times) - 1``, each one token for each of the
    ``num_seqs`` requests running at its start. Step ``k`` of the run starts at ``start_time``
    (k = 0) or at the previous end time; ``kv_blocks_used[k]`` is the device blocks in use after
    it (empty when no step callback asked)."""

    first_step: int
    start_time: float
    end_times: list[float]
    num_seqs: int
    kv_blocks_used: list[int]
    num_usable_blocks: int
    #: Requests that finished on the run's last step (their outputs are still to be made).
    finished: list[Request]
    #: Requests finished outside a step (ignored on arrival) that the run's first step delivers.
    finished_outside: list[Request]
    #: Outputs completed by the run's first and last steps (set by the engine before callbacks).
    num_finished_first: int = 0
    num_finished_last: int = 0


def declares_steady_decode(policy: SchedulerPolicy) -> bool:
    """Whether the class that defines ``policy.schedule`` (or a subclass of it) makes the promise."""
    return _declares(type(policy))


@functools.lru_cache(maxsize=None)
def _declares(policy_cls: type) -> bool:
    for cls in policy_cls.__mro__:
        attrs = vars(cls)
        if "steady_decode" in attrs:
            return bool(attrs["steady_decode"])
        if "schedule" in attrs:
            return False
    return False


@dataclass
class DecodePlan:
    """The pure-decode steps that provably come next from the engine's current state: step ``k``
    ends at ``end_times[k]``; request ``i`` of ``running`` samples ``tokens[i]`` and finishes on
    its ``lefts[i]``-th step. Planning changes nothing; a plan is valid until the engine changes."""

    start_time: float
    end_times: list[float]
    running: list[Request]
    tokens: list[int]
    lefts: list[int]


def plan_decode_run(engine: LLMEngine, until: float = math.inf) -> DecodePlan | None:
    """Plan the pure-decode steps that provably come next, ending with the first step on which a
    request finishes, before a step that would start at or after ``until`` (the next arrival) or
    need a block the pool lacks. None when not even one step qualifies (the caller then takes an
    ordinary ``engine.step()``)."""
    executor = engine.executor
    if not getattr(executor, "fast_forward", False):
        return None
    scheduler = engine.scheduler
    running = scheduler.running
    if (scheduler.waiting or scheduler.swapped or not running or engine.config.check_invariants
            or len(running) > scheduler.max_num_batched_tokens):
        return None
    if any(not hasattr(cb, "on_decode_run") for cb in engine.step_callbacks) or not declares_steady_decode(engine.policy):
        return None

    # Steps until the first request finishes (its last step ends the run) ...
    max_steps = math.inf
    context = 0
    tokens = []
    lefts = []
    sampled_token = executor.sampled_token
    for req in running:
        num_tokens = len(req.token_ids)
        if req.status is not RequestStatus.RUNNING or num_tokens - req.num_computed_tokens != 1:
            return None
        params = req.sampling_params
        token = sampled_token
        if params.stop_token_ids and token in params.stop_token_ids:
            token = executor.token_for(req)
            if token in params.stop_token_ids:
                return None
        if not params.ignore_eos and token in req.eos_token_ids:
            return None
        left = params.max_tokens - (num_tokens - len(req.prompt_token_ids))
        if req.max_model_len is not None and req.max_model_len - num_tokens < left:
            left = req.max_model_len - num_tokens
        if left < max_steps:
            max_steps = left
        context += num_tokens
        tokens.append(token)
        lefts.append(left)
    # ... and before one would need a block the pool does not have.
    max_steps = _block_limit(engine.allocator, running, int(max_steps))
    if max_steps < 1:
        return None
    start = engine.clock.now()
    times = executor.plan_decode_run(len(running), context, max_steps, until)
    if not times:
        return None
    return DecodePlan(start, times, list(running), tokens, lefts)


def commit_decode_run(engine: LLMEngine, plan: DecodePlan, num: int) -> DecodeRun:
    """Apply the first ``num`` steps of ``plan`` (made from the engine's current state). The
    caller makes the outputs of ``run.finished`` and ``run.finished_outside`` and hands the run
    to step callbacks (``LLMEngine.commit_decode_run`` does both)."""
    if not 0 < num <= len(plan.end_times):
        raise ValueError(f"a plan of {len(plan.end_times)} steps cannot commit {num}")
    scheduler, allocator, executor = engine.scheduler, engine.allocator, engine.executor
    running, tokens, lefts = plan.running, plan.tokens, plan.lefts
    times = plan.end_times[:num]
    finished_outside = scheduler.take_finished_outside_step()
    first_step = engine.num_steps + 1  # StepStats counts steps from 1
    for req, token in zip(running, tokens):
        req.token_ids.extend([token] * num)
    used = allocator.allocate_decode_run(running, num, bool(engine.step_callbacks))
    # Every request gets its tokens in bulk, but one finishing on the last step gets that step's
    # token from the scheduler's own update, which also finishes it and frees its blocks.
    finishing = [req for req, left in zip(running, lefts) if left == num]
    bulk_times = times[:-1] if finishing else times
    for req, left in zip(running, lefts):
        if left == num:
            req.num_computed_tokens += num - 1
            req.token_times.extend(bulk_times)
            del req.token_ids[-1]
        else:
            req.num_computed_tokens += num
            req.token_times.extend(times)
        if req.first_token_time is None and req.token_times:
            req.first_token_time = req.token_times[0]
    executor.commit_decode_run(plan.start_time, times)
    finished: list[Request] = []
    if finishing:
        out = SchedulerOutput(scheduled=finishing, num_scheduled_tokens={r.request_id: 1 for r in finishing})
        sampled = {r.request_id: t for r, t, left in zip(running, tokens, lefts) if left == num}
        scheduler.update_from_output(out, sampled)
        finished = [r for r in finishing if r.is_finished]
        if used:
            used[-1] = allocator.num_used_blocks
    scheduler.num_steps += num
    engine.num_steps += num
    return DecodeRun(first_step, plan.start_time, times, len(running), used, allocator.num_usable_blocks,
                     finished, finished_outside)


def _block_limit(allocator, running, max_steps: int) -> int:
    """The most steps (up to ``max_steps``) whose new blocks the free pool covers; 0 if the
    allocator cannot promise what a decode run needs."""
    free = allocator.num_free_blocks
    needed = allocator.decode_run_blocks(running, max_steps)
    if needed is None:
        return 0
    if needed <= free:
        return max_steps
    lo, hi = 0, max_steps  # needed(lo) fits, needed(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if allocator.decode_run_blocks(running, mid) <= free:
            lo = mid
        else:
            hi = mid
    return lo
