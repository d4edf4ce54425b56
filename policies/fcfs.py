"""First come, first served with prefill priority (vLLM v0's default, nano-vllm's scheduler)."""
from __future__ import annotations

from framework.request import RequestStatus
from framework.scheduler import POLICIES, Scheduler, SchedulerPolicy, Step


@POLICIES.register("fcfs")
class FCFSPolicy(SchedulerPolicy):
    """A step either admits waiting prompts (in arrival order, whole, while blocks, sequences
    and tokens allow) or, if none could be admitted, decodes the running requests. When a decode
    finds no free block, the most recently admitted running request is preempted.

    A request preempted by recompute may have grown beyond the token budget; it is then
    re-prefilled in budget-sized chunks on its own, so it can never get stuck.

    With ``preemption_mode=swap``, as in vLLM v0: no new prompt is admitted while requests are
    swapped out; swapped requests come back (oldest first, while blocks allow) in a decode step
    that preempted nobody, and decode in that same step.
    """

    steady_decode = True  # with nothing waiting, the decode loop below schedules every running request

    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        # Swapped requests (preemption_mode="swap") come back, at the end, before any admission.
        # A copy: admitting a request removes it from the queue that waiting_order may iterate.
        waiting = [] if scheduler.swapped else list(self.waiting_order(scheduler.waiting))
        for req in waiting:
            prefix = scheduler.find_prefix(req)
            n = req.num_tokens - req.num_computed_tokens - prefix.num_tokens
            if n > step.token_budget:
                if step.num_scheduled_reqs or not req.num_output_tokens:
                    break
                n = step.token_budget
            if not scheduler.schedule_request(step, req, n, prefix):
                break
        if step.num_scheduled_reqs:
            return
        for req in list(scheduler.running):
            if req.status != RequestStatus.RUNNING or step.is_scheduled(req) or step.token_budget == 0:
                continue
            n = self.num_new_tokens(req, step.token_budget)
            scheduler.schedule_or_preempt(step, req, n)
        if step.out.preempted or step.out.swapped_out:
            return
        self.swap_in_in_order(scheduler, step)
