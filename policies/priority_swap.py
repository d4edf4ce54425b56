"""Priority scheduling with swap preemption (vLLM's ``priority`` policy, v0's swap space) over chunked prefill."""
from __future__ import annotations

import heapq
from operator import itemgetter

from framework.common.request import Request, RequestStatus
from framework.scheduling.output import Step
from framework.scheduling.policy import POLICIES, SWAP
from framework.scheduling.scheduler import Scheduler
from policies.chunked import ChunkedPolicy


def priority_key(request: Request) -> tuple[int, float]:
    """``priority`` (lower first), ties by arrival."""
    return request.priority, request.arrival_time


@POLICIES.register("priority_swap")
class PrioritySwapPolicy(ChunkedPolicy):
    """Every request (running, swapped or waiting) is visited once per step in priority order
    and the token budget goes to them in that order, each prefill chunked to what is left.

    - A running request short of blocks preempts the lowest-priority running request not yet
      scheduled in this step (or, if none ranks below it, itself).
    - A swapped request is swapped back in when the blocks for its next tokens are free; it
      never preempts to come back.
    - A waiting request is admitted, preempting lower-priority running requests if that makes
      room (checked before anyone is preempted, so no swap is wasted): room for its whole prompt
      with ``reserve_full_prompt`` (the default, as ``chunked``), else for its first chunk.
    - Once a swapped or waiting request cannot get on the device, or a request was preempted,
      nothing of lower priority is admitted or swapped in behind it in this step (running
      requests keep their turn).

    Victims are swapped out to the CPU swap space, or recomputed when it is full;
    ``preemption_mode="recompute"`` always recomputes. The order is ``rank`` (default: ``priority``,
    then arrival), ties broken by ``arrival_order``: otherwise two requests of equal rank (the ``n``
    samples of one request) would each give way to the other and could take turns preempting themselves.

    Waiting requests stay in ``ChunkedPolicy``'s heap (``waiting_key``: rank, then arrival order) across
    steps, as in vLLM v1's priority queue, so a step visits only the waiting requests it reaches.
    """

    def __init__(self, preemption_mode: str = SWAP, long_prefill_token_threshold: int = 0,
                 reserve_full_prompt: bool = True, long_prefill_cap_when_alone: bool = False) -> None:
        super().__init__(preemption_mode, long_prefill_token_threshold, reserve_full_prompt,
                         long_prefill_cap_when_alone)
        self._keyed = True  # a step visits waiting requests in the heap's order, by _order, always

    def waiting_key(self, request: Request) -> tuple:
        return self._order(request)

    def rank(self, request: Request) -> tuple:
        """Sort key, lowest first: what "priority" means. Override it (e.g. with a deadline) and
        the visiting order, the waiting order and the choice of victims all follow. A waiting
        request's rank is read when it starts waiting (its fields do not change while it waits)."""
        return priority_key(request)

    def _order(self, request: Request) -> tuple:
        """``rank``, then ``arrival_order``: a total order, so that of two requests one always
        wins, and among ties the first received, as in a queue (request ids would put "10"
        before "9")."""
        return self.rank(request), request.arrival_order

    def select_victim(self, candidates: list[Request], requester: Request) -> Request | None:
        lowest = max(candidates, key=self._order, default=None)
        return lowest if lowest is not None and self._order(lowest) > self._order(requester) else None

    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        # Every request in order of _order (running, swapped and waiting ones merged), as sorting
        # them all would give; once nothing more may come on the device (blocked, or ranking
        # below a victim: both hold for every later request too), only running requests act.
        first = itemgetter(0)
        self._check_indexed(scheduler)
        self.start_step(scheduler)
        running = sorted([(self._order(r), r) for r in scheduler.running], key=first)
        swapped = sorted([(self._order(r), r) for r in scheduler.swapped], key=first)
        taken: list[tuple[tuple, int, Request]] = []  # heap entries visited in this step
        try:
            self._visit(scheduler, step, running, swapped, taken)
        finally:  # also after a failure: the requests visited and still waiting stay indexed
            self._requeue(taken)

    def _visit(self, scheduler: Scheduler, step: Step, running: list, swapped: list, taken: list) -> None:
        ri = si = 0
        blocked = False
        while step.token_budget:
            nxt = running[ri] if ri < len(running) else None
            if si < len(swapped) and (nxt is None or swapped[si][0] < nxt[0]):
                nxt = swapped[si]
            entry = self._first_waiting()
            if entry is not None and (nxt is None or entry[0] < nxt[0]):
                taken.append(heapq.heappop(self._heap))
                nxt = entry
            elif nxt is None:
                break
            elif ri < len(running) and nxt is running[ri]:
                ri += 1
            else:
                si += 1
            req = nxt[-1]
            if step.was_preempted(req) or step.is_scheduled(req):
                continue
            if req.status == RequestStatus.RUNNING:
                if not scheduler.schedule_or_preempt(step, req, self.num_new_tokens(req, step.token_budget)):
                    blocked = True
            elif blocked or self._ranks_below_a_victim(step, req):
                blocked = True
            elif req.status == RequestStatus.SWAPPED:
                blocked = not scheduler.swap_in(step, req, self.num_new_tokens(req, step.token_budget))
            else:
                blocked = not self._admit(scheduler, step, req)
            if blocked:
                break
        for _, req in running[ri:]:
            if step.token_budget == 0:
                break
            if req.status == RequestStatus.RUNNING and not step.is_scheduled(req):
                scheduler.schedule_or_preempt(step, req, self.num_new_tokens(req, step.token_budget))

    def _ranks_below_a_victim(self, step: Step, req: Request) -> bool:
        # A request preempted in this step cannot come back before the next one; nothing of lower
        # priority may take its place meanwhile.
        order = self._order(req)
        return any(self._order(v) < order for v in step.out.preempted + step.out.swapped_out)

    def _admit(self, scheduler: Scheduler, step: Step, req: Request) -> bool:
        prefix = scheduler.find_prefix(req)
        n = self.num_new_tokens(req, step.token_budget, prefix.num_tokens)
        if self.prompt_fits(scheduler, req, prefix) and scheduler.schedule_request(step, req, n, prefix):
            return True
        order = self._order(req)
        victims = [r for r in scheduler.preemptable(step) if self._order(r) > order]
        if (scheduler.seats_taken - len(victims) >= scheduler.max_num_seqs
                or not scheduler.allocator.fits_after(req, n, prefix, victims)
                or not self.prompt_fits(scheduler, req, prefix, victims)):
            return False
        # With reserve_full_prompt, victims make room for the whole prompt, not only for its first chunk.
        while not self.prompt_fits(scheduler, req, prefix):
            victim = self.select_victim(scheduler.preemptable(step), req)
            if victim is None:
                return False
            scheduler.preempt(step, victim)
        return scheduler.schedule_or_preempt(step, req, n, prefix)
