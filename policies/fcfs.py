"""First come, first served with prefill priority (vLLM v0's default, nano-vllm's scheduler)."""
from __future__ import annotations

from framework.common.config import is_finite_number
from framework.common.request import RequestStatus
from framework.scheduling.output import Step
from framework.scheduling.policy import POLICIES, RECOMPUTE, SchedulerPolicy
from framework.scheduling.scheduler import Scheduler


@POLICIES.register("fcfs")
class FCFSPolicy(SchedulerPolicy):
    """A step either admits waiting prompts (in arrival order, whole, while blocks, sequences and tokens
    allow) or, if none could be admitted, decodes the running requests; a decode short of blocks preempts
    the most recently admitted running request. A request preempted by recompute that outgrew the token
    budget is re-prefilled alone in budget-sized chunks, so it never gets stuck.

    With ``preemption_mode=swap``, as in vLLM v0: no new prompt is admitted while requests are swapped
    out; they come back (oldest first, while blocks allow) in a decode step that preempted nobody, and
    decode in that step.

    ``watermark`` (vLLM v0's block-manager watermark, 0.01 there; default 0: off): a prompt that has not
    run yet is admitted only if the free KV blocks less all its prompt's blocks (cache hits not deducted,
    as in vLLM v0) stay at or above that fraction of the cache, so running requests keep blocks to decode
    into. A prompt that could never be admitted so is finished as ignored, with the reason.
    """

    steady_decode = True  # with nothing waiting, the decode loop below schedules every running request

    def __init__(self, preemption_mode: str = RECOMPUTE, watermark: float = 0.0) -> None:
        super().__init__(preemption_mode)
        if not is_finite_number(watermark) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction of the KV blocks in [0, 1) (vLLM v0: 0.01), "
                             f"got {watermark!r}")
        self.watermark = float(watermark)

    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        # Swapped requests (preemption_mode="swap") come back, at the end, before any admission.
        # A copy: admitting a request removes it from the queue that waiting_order may iterate.
        waiting = [] if scheduler.swapped else list(self.waiting_order(scheduler.waiting))
        alloc = scheduler.allocator
        keep = int(self.watermark * alloc.num_usable_blocks)  # blocks a new prompt leaves free
        for req in waiting:
            if keep and req.first_scheduled_time is None:
                need = alloc.blocks_needed(req.num_tokens)
                if need > alloc.num_usable_blocks - keep:
                    scheduler.ignore(step, req, f"prompt of {req.num_prompt_tokens} tokens needs {need} KV blocks but "
                                                f"policy {self.name!r} admits at most {alloc.num_usable_blocks - keep} "
                                                f"(watermark={self.watermark:g} keeps {keep} of "
                                                f"{alloc.num_usable_blocks} free)")
                    continue
                if alloc.num_free_blocks - need < keep:
                    break
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
