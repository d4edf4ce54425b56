"""Advance a simulated engine by a run of pure-decode steps at once, as stepping them one by one would.

A run qualifies when nothing waits or is swapped, the free blocks cover the blocks its steps start, and the
policy, allocator and executor declare ``DecodeRunPolicy``, ``DecodeRunAllocator`` and ``DecodeRunExecutor``.
The allocator then sees the same ``allocate_slots(request, 1)`` calls in the same order (less those that change
nothing) and the executor times the same shapes, so block ids, prefix-cache contents and token times are
identical. Anything else is left to ``LLMEngine.step``; the sim executor's ``fast_forward=False`` turns it off.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from framework.common.request import Request, RequestStatus
from framework.scheduling.output import SchedulerOutput
from framework.scheduling.policy import SchedulerPolicy

if TYPE_CHECKING:
    from framework.common.outputs import RequestOutput
    from framework.kv.block_allocator import BlockAllocator
    from framework.engine.llm_engine import LLMEngine


@dataclass
class DecodeRun:
    """Steps ``first_step .. first_step + len(end_times) - 1``, each one token for each of the ``batch_sizes[k]``
    requests running at its start (``start_time``, then the previous end time); ``kv_blocks_used[k]`` is
    the device blocks in use after step ``k`` (both lists empty unless a step callback asked)."""

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


class DecodeRunPolicy(Protocol):
    """A policy takes part by setting ``steady_decode = True`` on the class defining ``schedule`` (or a
    subclass), a promise: while nothing waits or is swapped and every running request has one token to
    compute, ``schedule`` gives each one token, in ``running`` order, preempting only when blocks run out."""

    steady_decode: ClassVar[bool]


class DecodeRunAllocator(Protocol):
    """An allocator takes part by defining both methods on the class that defines its
    ``allocate_slots`` (or a subclass), so that a subclass changing allocation alone drops out."""

    def decode_run_blocks(self, requests: Sequence[Request], num_steps: int) -> int | None:
        """At least as many free blocks as ``allocate_decode_run(requests, num_steps)`` would take, or
        None (no decode run) when skipping the ``allocate_slots(request, 1)`` calls that neither start
        nor fill a block could change anything (a shared block still written into)."""

    def allocate_decode_run(self, requests: Sequence[Request], num_steps: int, track: bool = False,
                            active: Sequence[int] | None = None,
                            pauses: Mapping[int, Callable[[], None]] | None = None) -> list[int]:
        """The effect of ``allocate_slots(request, 1)`` for step ``j = 1..num_steps`` and each
        request in order, as ``replay_decode_run`` gives it; returns the blocks in use after
        each step when ``track``, else []."""


class DecodeRunExecutor(Protocol):
    """An executor takes part by ``fast_forward`` (true) and the methods below, defined on the
    class that defines its ``execute`` and ``token_for`` (or a subclass)."""

    fast_forward: bool
    #: The token every request samples unless ``token_for`` says otherwise.
    sampled_token: int

    def token_for(self, request: Request) -> int:
        """The token ``request`` samples."""

    def plan_decode_run(self, segments: list[tuple[int, int, int]], until: float = math.inf) -> list[float]:
        """The end times of the decode steps ``segments`` describe, stopping before a step that
        would start at or after ``until``; changes nothing."""

    def commit_decode_run(self, times: list[float]) -> None:
        """Take the planned steps ending at ``times`` (the clock moves to the last)."""


def replay_decode_run(allocator: BlockAllocator, requests: Sequence[Request], num_steps: int, track: bool = False,
                      active: Sequence[int] | None = None,
                      pauses: Mapping[int, Callable[[], None]] | None = None) -> list[int]:
    """The effect of ``allocate_slots(request, 1)`` for steps ``j = 1..num_steps`` and each request in order,
    replaying only the calls that can change anything (the reference ``allocate_decode_run``): request ``i``
    takes the first ``active[i]`` steps (default: all), ``pauses[j]()`` runs after step ``j``'s allocations.
    Needs the new tokens in ``token_ids`` and the pool checked; returns as ``allocate_decode_run``."""
    bs = allocator.block_size
    pauses = pauses or {}
    events: dict[int, list[tuple[Request, int]]] = {j: [] for j in pauses}
    for k, req in enumerate(requests):
        computed = req.num_computed_tokens
        last = num_steps if active is None else active[k]
        # Step j writes position computed + j - 1: it fills a block when computed + j is a
        # multiple of bs, and starts one on the step after.
        fill = (-computed) % bs or bs
        begin = fill % bs + 1
        for j in set(range(fill, last + 1, bs)) | set(range(begin, last + 1, bs)):
            events.setdefault(j, []).append((req, computed))
    used: list[int] = []
    done = 0
    for j in sorted(events):
        if track:
            used.extend([allocator.num_used_blocks] * (j - 1 - done))
        for req, computed in events[j]:
            # A request's count changes only at its own pause, after its last allocation.
            req.num_computed_tokens = computed + j - 1
            ok = allocator.allocate_slots(req, 1)
            req.num_computed_tokens = computed
            if not ok:
                raise RuntimeError(f"decode run: {req.request_id} found no free block although the pool was checked")
        if j in pauses:
            pauses[j]()
        if track:
            used.append(allocator.num_used_blocks)
        done = j
    if track:
        used.extend([allocator.num_used_blocks] * (num_steps - done))
    return used


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
    """Whether ``part``'s decode-run planning (methods ``plans``) is defined by the class that defines
    how it runs steps (methods ``runs``) or a subclass of it; if not, its base would plan the decode runs
    of a subclass overriding only ``execute`` or ``allocate_slots``, and the fast path would diverge."""
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
    """The pure-decode steps that provably come next, valid until the engine changes: step ``k`` ends at
    ``end_times[k]``; request ``i`` of ``running`` samples ``tokens[i]`` and finishes on its ``lefts[i]``-th step;
    ``segments`` are the runs between finishes, ``(steps, batch size, keys attended on the first)``."""

    start_time: float
    end_times: list[float]
    running: list[Request]
    tokens: list[int]
    lefts: list[int]
    segments: list[tuple[int, int, int]]


def plan_decode_run(engine: LLMEngine, until: float = math.inf, through_finishes: bool = True) -> DecodePlan | None:
    """Plan, changing nothing, the pure-decode steps that provably come next, up to the last finish
    (``through_finishes``) or the first, none starting at or after ``until`` (the next arrival) or
    needing a block the pool lacks. None when no step qualifies: take an ordinary ``engine.step()``."""
    executor = engine.executor
    # Under async scheduling a step is in flight, its tokens placeholders the plan does not follow.
    if not getattr(executor, "fast_forward", False) or engine.async_scheduling:
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


def _apply(engine: LLMEngine, plan: DecodePlan, num: int) -> DecodeRun:
    """Apply the first ``num`` steps of ``plan`` (made from the engine's current state). The
    caller makes the outputs of ``run.finished`` and ``run.finished_outside`` and hands the run
    to step callbacks (``commit_decode_run`` does both)."""
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
    engine.count_steps(num)
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


def advance(engine: LLMEngine, until: float = math.inf) -> list[RequestOutput]:
    """``engine.step(final_only=True)``, or, when a decode run qualifies, its steps at once,
    none starting at or after ``until`` (the next arrival). Returns the outputs of the requests
    that finished."""
    plan = plan_decode_run(engine, until)
    if plan is None:
        return engine.step(final_only=True)
    return commit_decode_run(engine, plan, len(plan.end_times))


def commit_decode_run(engine: LLMEngine, plan: DecodePlan, num_steps: int) -> list[RequestOutput]:
    """Take the first ``num_steps`` steps of ``plan`` (made since the engine last changed);
    returns the outputs of the requests that finished, each in the step it finished on."""
    run = _apply(engine, plan, num_steps)
    engine.forks.settle(run.finished_outside)  # a v0 leader aborted since the last step, as in step()
    # A request of several sequences (n > 1) finishes with its last one: its output belongs
    # to that step, not to the step of a sibling that finished earlier in the run (the run is
    # applied whole, so every sibling already shows as finished here).
    last: dict[str, int] = {}
    for step, group in run.finished:  # in step order: the last step wins
        for req in group:
            last[req.parent_id or req.request_id] = step
    outside = [r for r in run.finished_outside if (r.parent_id or r.request_id) not in last]
    outputs = engine.output_processor.final_outputs(outside) if outside else []
    if outputs:
        run.outputs_finished[1] = len(outputs)
    for step, group in run.finished:
        done = engine.output_processor.final_outputs(r for r in group if last[r.parent_id or r.request_id] == step)
        if done:
            run.outputs_finished[step] = run.outputs_finished.get(step, 0) + len(done)
            outputs += done
    for callback in engine.step_callbacks:
        callback.on_decode_run(run)  # type: ignore[attr-defined]
    return outputs
