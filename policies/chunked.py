"""Chunked prefill under one token budget (vLLM v1's scheduler, Sarathi-Serve's stall-free batches)."""
from __future__ import annotations

from framework.config import is_int
from framework.request import Request, RequestStatus
from framework.scheduler import POLICIES, RECOMPUTE, Scheduler, SchedulerPolicy, Step


@POLICIES.register("chunked")
class ChunkedPolicy(SchedulerPolicy):
    """Each step serves the running requests first, in admission order: a decode takes one token,
    an unfinished prefill (a prompt, or a recompute after preemption) as many as the budget
    leaves. Then waiting requests are admitted in ``waiting_order`` while the budget, the blocks
    and ``max_num_seqs`` allow; the last one admitted may get only a chunk of its prompt, so decodes
    keep flowing while a long prompt is prefilled over several steps.

    ``long_prefill_token_threshold`` (> 0) caps the tokens any one request computes per step, so
    several long prompts share a step instead of one taking the whole budget. When a running
    request finds no free block, ``select_victim`` picks whom to preempt (default: the newest
    running request not yet scheduled in this step, else the request itself). As in vLLM v1, a
    step that preempted admits nobody: the freed blocks go to the requests already running.
    With ``preemption_mode="swap"``, swapped requests return (oldest first) before new admissions.
    """

    chunks_prefills = True
    # With nothing waiting or swapped, the loop over running requests gives each its one token.
    steady_decode = True

    def __init__(self, preemption_mode: str = RECOMPUTE, long_prefill_token_threshold: int = 0) -> None:
        super().__init__(preemption_mode)
        if not is_int(long_prefill_token_threshold) or long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0 = no cap), "
                             f"got {long_prefill_token_threshold!r}")
        self.long_prefill_token_threshold = long_prefill_token_threshold

    def num_new_tokens(self, request: Request, token_budget: int, num_prefix_tokens: int = 0) -> int:
        n = super().num_new_tokens(request, token_budget, num_prefix_tokens)
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        return n

    def schedule(self, scheduler: Scheduler, step: Step) -> None:
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
        for req in list(self.waiting_order(scheduler.waiting)):
            if step.token_budget == 0 or len(scheduler.running) >= scheduler.max_num_seqs:
                break
            prefix = scheduler.find_prefix(req)
            if not scheduler.schedule_request(step, req, self.num_new_tokens(req, step.token_budget, prefix.num_tokens),
                                              prefix):
                break
