"""Chunked prefill under one token budget (vLLM v1's scheduler, Sarathi-Serve's stall-free batches)."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from framework.common.config import is_int
from framework.common.request import Request, RequestStatus
from framework.kv.block_allocator import PrefixHit
from framework.scheduling.output import Step
from framework.scheduling.policy import POLICIES, RECOMPUTE, SchedulerPolicy
from framework.scheduling.scheduler import Scheduler


@POLICIES.register("chunked")
class ChunkedPolicy(SchedulerPolicy):
    """Each step serves the running requests first, in admission order: a decode takes one token, an
    unfinished prefill (a prompt, or a recompute after preemption) as many as the budget leaves. Then
    waiting requests are admitted in ``waiting_order`` while the budget, the blocks and ``max_num_seqs``
    allow; the last one admitted may get only a chunk of its prompt, so decodes keep flowing while a long
    prompt is prefilled over several steps.

    ``long_prefill_token_threshold`` (> 0) caps the tokens any one request computes per step, so several
    long prompts share a step; as in vLLM 0.32 (PR #57951) not in a step that starts with one request or
    none running, waiting or swapped (nobody to starve), unless ``long_prefill_cap_when_alone``. A running
    request short of blocks preempts the victim ``select_victim`` picks (default: the newest running request
    not yet scheduled this step, else itself). As in vLLM v1, a step that preempted admits nobody: the freed
    blocks go to the running requests. With ``preemption_mode="swap"``, swapped requests return (oldest
    first) before new admissions.

    ``reserve_full_prompt`` (vLLM 0.32's ``scheduler_reserve_full_isl``, PR #37307): a waiting request is
    admitted only if the free blocks hold all its tokens (its prefix-cache hit reused, a free cached block of
    that hit counted as taken), not just its first chunk, so a chunked prompt is not admitted only to be
    preempted halfway; off, its first chunk is enough (vLLM before 0.32).

    ``waiting_key`` (one hook, as in ``sjf``) orders the waiting queue by a key read once, when a request
    starts waiting; equal keys keep the queue's order (preempted ones first). The queue is then a heap kept
    across steps, so a step reads only the waiting requests it reaches, however many wait. A subclass's own
    ``waiting_order`` is called every step instead.
    """

    chunks_prefills = True
    # framework.sim.fast_forward.DecodeRunPolicy: with nothing waiting or swapped, the loop over running
    # requests gives each its one token.
    steady_decode = True

    def __init__(self, preemption_mode: str = RECOMPUTE, long_prefill_token_threshold: int = 0,
                 reserve_full_prompt: bool = True, long_prefill_cap_when_alone: bool = False) -> None:
        super().__init__(preemption_mode)
        if not is_int(long_prefill_token_threshold) or long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0 = no cap), "
                             f"got {long_prefill_token_threshold!r}")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.reserve_full_prompt = check_flag("reserve_full_prompt", reserve_full_prompt)
        self.long_prefill_cap_when_alone = check_flag("long_prefill_cap_when_alone", long_prefill_cap_when_alone)
        self._prefill_cap = long_prefill_token_threshold  # this step's cap: see start_step
        # With a waiting_key: heap entries (key, tie, request) and each request's live entry; a request that
        # leaves or re-enters the queue leaves a stale entry, dropped when it comes up. Ties keep the queue's
        # order: one entering at the front sorts before every earlier entry, one entering at the back after.
        self._keyed = (type(self).waiting_key is not ChunkedPolicy.waiting_key
                       and type(self).waiting_order is ChunkedPolicy.waiting_order)
        self._heap: list[tuple[Any, int, Request]] = []
        self._entries: dict[Request, tuple[Any, int, Request]] = {}
        self._front, self._back = itertools.count(-1, -1), itertools.count(1)
        self._given: list[tuple[Any, int, Request]] = []  # entries taken off the heap by the last admission loop

    def waiting_key(self, request: Request) -> Any:
        """Sort key of the waiting queue, lowest first, read when ``request`` starts waiting (so
        built from what is fixed by then: its prompt, its sampling parameters, its arrival).
        Not overridden: the queue's own order."""
        raise NotImplementedError

    def waiting_order(self, waiting: Sequence[Request]) -> list[Request]:
        if type(self).waiting_key is ChunkedPolicy.waiting_key:
            return list(waiting)
        return sorted(waiting, key=self.waiting_key)  # stable: equal keys keep the queue's order

    def on_waiting(self, request: Request) -> None:
        """Indexes ``request`` by ``waiting_key``; a subclass overriding it calls it too."""
        if not self._keyed:
            return
        # The scheduler puts a request that ran before (preempted, or a sample forked from a
        # running parent) at the front of its queue, and a new arrival at the back.
        tie = next(self._front) if request.first_scheduled_time is not None else next(self._back)
        entry = (self.waiting_key(request), tie, request)
        self._entries[request] = entry
        heapq.heappush(self._heap, entry)

    def admission_order(self, scheduler: Scheduler) -> Iterable[Request]:
        """The waiting requests ``schedule`` tries to admit, in order: it admits each one it is
        given in turn and stops at the first that cannot be admitted. ``waiting_order`` (a copy:
        admitting a request removes it from the queue), or with a ``waiting_key`` the heap's."""
        if not self._keyed:
            return list(self.waiting_order(scheduler.waiting))
        self._check_indexed(scheduler)
        return self._in_key_order()

    def _check_indexed(self, scheduler: Scheduler) -> None:
        if len(self._entries) < len(scheduler.waiting):  # every waiting request has a live entry
            raise RuntimeError(f"policy {self.name!r}: {len(scheduler.waiting)} requests wait but "
                               f"{len(self._entries)} were indexed; an on_waiting override must call "
                               f"super().on_waiting(request)")

    def _in_key_order(self) -> Iterator[Request]:
        """The waiting requests in heap order, each taken off the heap as it is given; those still
        waiting go back on it at the next call (the admission loop stopped at them)."""
        self._requeue(self._given)
        self._given = []
        while (entry := self._first_waiting()) is not None:
            heapq.heappop(self._heap)
            self._given.append(entry)
            yield entry[2]

    def _first_waiting(self) -> tuple[Any, int, Request] | None:
        """The heap's first live entry of a waiting request, left on the heap (stale entries, and
        those of requests aborted while waiting, are dropped)."""
        heap, entries = self._heap, self._entries
        while heap:
            entry = heap[0]
            req = entry[2]
            if entries.get(req) is entry:
                if req.status == RequestStatus.WAITING:
                    return entry
                del entries[req]
            heapq.heappop(heap)
        return None

    def _requeue(self, taken: Iterable[tuple[Any, int, Request]]) -> None:
        """Puts entries taken off the heap back, those of requests still waiting; forgets the rest."""
        for entry in taken:
            req = entry[2]
            if self._entries.get(req) is entry:
                if req.status == RequestStatus.WAITING:
                    heapq.heappush(self._heap, entry)
                else:
                    del self._entries[req]

    def num_new_tokens(self, request: Request, token_budget: int, num_prefix_tokens: int = 0) -> int:
        n = super().num_new_tokens(request, token_budget, num_prefix_tokens)
        if self._prefill_cap:
            n = min(n, self._prefill_cap)
        return n

    def start_step(self, scheduler: Scheduler) -> None:
        """Fixes this step's long-prefill cap from the requests there are as it starts (vLLM 0.32 counts
        them once, before scheduling). ``schedule`` calls it first; so does an override of ``schedule``."""
        # A request whose last token is in flight (async scheduling) is still in vLLM's running queue.
        alone = scheduler.seats_taken + len(scheduler.waiting) + len(scheduler.swapped) <= 1
        self._prefill_cap = 0 if alone and not self.long_prefill_cap_when_alone else self.long_prefill_token_threshold

    def prompt_fits(self, scheduler: Scheduler, request: Request, prefix: PrefixHit,
                    released: Sequence[Request] = ()) -> bool:
        """Whether waiting ``request`` may be admitted as far as its blocks go, once ``released`` gave theirs
        back: with ``reserve_full_prompt``, all its tokens must fit (as vLLM 0.32 counts: its prompt, and the
        outputs of a preempted one); without, always (the first chunk's blocks are checked on scheduling)."""
        if not self.reserve_full_prompt:
            return True
        left = request.num_tokens - request.num_computed_tokens - prefix.num_tokens
        return scheduler.allocator.fits_after(request, left, prefix, released)

    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        self.start_step(scheduler)
        for req in list(scheduler.running):
            if step.token_budget == 0:
                break
            if req.status == RequestStatus.RUNNING and not step.is_scheduled(req):
                scheduler.schedule_or_preempt(step, req, self.num_new_tokens(req, step.token_budget))
        if step.out.preempted or step.out.swapped_out:
            return
        # Swapped requests (preemption_mode="swap") come back, oldest first, before anything new
        # is admitted (as in vLLM v0).
        if not self.swap_in_in_order(scheduler, step):
            return
        for req in self.admission_order(scheduler):
            if step.token_budget == 0 or scheduler.seats_taken >= scheduler.max_num_seqs:
                break
            prefix = scheduler.find_prefix(req)
            if not self.prompt_fits(scheduler, req, prefix) or not scheduler.schedule_request(
                    step, req, self.num_new_tokens(req, step.token_budget, prefix.num_tokens), prefix):
                break


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool; else a ValueError naming option ``name`` and its valid values."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value
