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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from framework.request import Request, RequestStatus
from framework.scheduler import SchedulerOutput, SchedulerPolicy

if TYPE_CHECKING:
    from framework.engine import LLMEngine


@dataclass
class DecodeRun:
    """Steps ``first_step .. first_step + len(end_times) - 1``, each one token for each request
    running at its start (``batch_sizes[k]`` of them on step ``k``). Step ``k`` of the run starts
    at ``start_time`` (k = 0) or at the previous end time; ``kv_blocks_used[k]`` is the device
    blocks in use after it (both lists empty when no step callback asked)."""

    first_step: int
    start_time: float
    end_times: list[float]
    batch_sizes: list[int]
    kv_blocks_used: list[int]
    num_usable_blocks: int
    #: (step k, requests that finished on it), in step order; their outputs are still to be made.
    finished: list[tuple[int, list[Request]]]
    #: Requests finished outside a step (ignored on arrival) that the run's first step delivers.
    finished_outside: list[Request]
    #: Outputs completed on each step (set by the engine before callbacks).
    outputs_finished: dict[int, int] = field(default_factory=dict)


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


def plans_as_it_runs(part: object, runs: tuple[str, ...], plans: tuple[str, ...]) -> bool:
    """Whether ``part``'s decode-run planning (its methods ``plans``) is defined by the class
    that defines how it runs steps (its methods ``runs``), or by a subclass of it: a subclass
    overriding ``execute`` or ``allocate_slots`` alone would have its decode runs planned by
    its base, as if unchanged, and the fast path would no longer be what stepping gives."""
    return _plans_as_it_runs(type(part), runs, plans)


@functools.lru_cache(maxsize=None)
def _plans_as_it_runs(part_cls: type, runs: tuple[str, ...], plans: tuple[str, ...]) -> bool:
    for cls in part_cls.__mro__:
        attrs = vars(cls)
        if any(name in attrs for name in plans):
            return True
        if any(name in attrs for name in runs):
            return False
    return False


#: What runs a step (first) and what plans decode runs (second), for the executor and the allocator.
EXECUTOR_METHODS = ("execute", "token_for"), ("plan_decode_run", "commit_decode_run")
ALLOCATOR_METHODS = ("allocate_slots",), ("decode_run_blocks", "allocate_decode_run")


@dataclass
class DecodePlan:
    """The pure-decode steps that provably come next from the engine's current state: step ``k``
    ends at ``end_times[k]``; request ``i`` of ``running`` samples ``tokens[i]`` and finishes on
    its ``lefts[i]``-th step; ``segments`` are the runs of steps between finishes, ``(steps, batch
    size, keys attended on the first)``. Planning changes nothing; a plan is valid until the
    engine changes."""

    start_time: float
    end_times: list[float]
    running: list[Request]
    tokens: list[int]
    lefts: list[int]
    segments: list[tuple[int, int, int]]


def plan_decode_run(engine: LLMEngine, until: float = math.inf, through_finishes: bool = True) -> DecodePlan | None:
    """Plan the pure-decode steps that provably come next: every running request computes one
    token per step until it finishes (``through_finishes``; else the run ends with the first
    step on which one does), stopping before a step that would start at or after ``until`` (the
    next arrival) or need a block the pool lacks. None when not even one step qualifies (the
    caller then takes an ordinary ``engine.step()``)."""
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
    if not (plans_as_it_runs(executor, *EXECUTOR_METHODS) and plans_as_it_runs(engine.allocator, *ALLOCATOR_METHODS)):
        return None

    sampled_token = executor.sampled_token
    tokens = [sampled_token] * len(running)
    lefts = []
    contexts = []
    running_status = RequestStatus.RUNNING
    for k, req in enumerate(running):
        num_tokens = len(req.token_ids)
        # A v0 leader still to fork its samples (``Request.forks``) forks them on its first
        # token, which only an ordinary step does.
        if num_tokens - req.num_computed_tokens != 1 or req.status is not running_status or req.forks:
            return None
        params = req.sampling_params
        if params.stop_token_ids and sampled_token in params.stop_token_ids:
            tokens[k] = executor.token_for(req)
            if tokens[k] in params.stop_token_ids:
                return None
        if not params.ignore_eos and tokens[k] in req.eos_token_ids:
            return None
        left = req.max_tokens - num_tokens + len(req.prompt_token_ids)
        if req.max_model_len is not None and req.max_model_len - num_tokens < left:
            left = req.max_model_len - num_tokens
        lefts.append(left)
        contexts.append(num_tokens)
    # Up to the last finish (or the first), and before a step would need a block the pool lacks
    # (counting every request's blocks to the end: frees on the way are ignored, conservatively).
    max_steps = _block_limit(engine.allocator, running, max(lefts) if through_finishes else min(lefts))
    if max_steps < 1:
        return None
    # Segments between finishes: (steps, batch size, keys attended on the segment's first step).
    # One pass over the requests in finishing order, with the batch's size and context kept as
    # running totals (a plan is made about once per arrival, over every running request).
    segments = []
    order = sorted(zip(lefts, contexts))
    alive, keys, i, done = len(order), sum(contexts), 0, 0
    while i < len(order) and done < max_steps:
        finish = order[i][0]
        segments.append((min(finish, max_steps) - done, alive, keys + alive * done))
        while i < len(order) and order[i][0] == finish:
            alive -= 1
            keys -= order[i][1]
            i += 1
        done = finish
    start = engine.clock.now()
    times = executor.plan_decode_run(segments, until)
    if not times:
        return None
    return DecodePlan(start, times, list(running), tokens, lefts, segments)


def commit_decode_run(engine: LLMEngine, plan: DecodePlan, num: int) -> DecodeRun:
    """Apply the first ``num`` steps of ``plan`` (made from the engine's current state). The
    caller makes the outputs of ``run.finished`` and ``run.finished_outside`` and hands the run
    to step callbacks (``LLMEngine.commit_decode_run`` does both)."""
    if not 0 < num <= len(plan.end_times):
        raise ValueError(f"a plan of {len(plan.end_times)} steps cannot commit {num}")
    scheduler, allocator, executor, clock = engine.scheduler, engine.allocator, engine.executor, engine.clock
    running, tokens, lefts = plan.running, plan.tokens, plan.lefts
    times = plan.end_times[:num]
    finished_outside = scheduler.take_finished_outside_step()
    first_step = engine.num_steps + 1  # StepStats counts steps from 1
    # Each request gets its tokens, times and computed tokens in bulk, except that one finishing
    # on step F (<= num) gets its F-th from the scheduler's own update, which finishes it and
    # frees its blocks: that runs between step F's allocations and step F + 1's.
    active = [left if left < num else num for left in lefts]
    groups: dict[int, list[tuple[Request, int]]] = {}  # finishing step -> (request, its last token)
    for req, token, steps, left in zip(running, tokens, active, lefts):
        bulk = steps - 1 if left <= num else steps
        if bulk:
            req.token_ids.extend([token] * bulk)
            req.token_times.extend(times[:bulk])
            if req.first_token_time is None:
                req.first_token_time = times[0]
        if left <= num:
            groups.setdefault(left, []).append((req, token))
    finished: list[tuple[int, list[Request]]] = []

    def finisher(step: int, group: list[tuple[Request, int]]):
        def finish() -> None:
            clock.wait_until(times[step - 1])
            reqs = [req for req, _ in group]
            for req in reqs:
                req.num_computed_tokens += step - 1
            out = SchedulerOutput(scheduled=reqs, num_scheduled_tokens={r.request_id: 1 for r in reqs})
            scheduler.update_from_output(out, {r.request_id: t for r, t in group})
            finished.append((step, [r for r in reqs if r.is_finished]))
        return finish

    pauses = {step: finisher(step, group) for step, group in groups.items()}
    track = bool(engine.step_callbacks)  # only step callbacks read the per-step sizes and blocks
    used = allocator.allocate_decode_run(running, num, track, active, pauses)
    for req, left in zip(running, lefts):
        if left > num:
            req.num_computed_tokens += num
    executor.commit_decode_run(times)
    scheduler.num_steps += num
    engine.num_steps += num
    sizes: list[int] = []
    if track:
        for steps, alive, _ in plan.segments:
            sizes += [alive] * steps
            if len(sizes) >= num:
                break
        del sizes[num:]
    return DecodeRun(first_step, plan.start_time, times, sizes, used, allocator.num_usable_blocks,
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
