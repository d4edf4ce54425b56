"""What the scheduler hands the runner each step (``SchedulerOutput``), and the ``Step`` a policy fills."""
from __future__ import annotations

from dataclasses import dataclass, field

from framework.common.request import Request


@dataclass
class SchedulerOutput:
    """What to run this step. The runner reads only this, never the scheduler's queues.

    ``scheduled`` is the batch order; ``num_scheduled_tokens`` lists the same requests in the same order.
    Rows of ``new_requests`` (first run, forked sequences included) and ``resumed_requests`` (back from
    recompute or swap) are built from scratch; other scheduled requests extend their row with the tokens
    and blocks added since the last step. Rows of ``finished_req_ids`` (finished, aborted, preempted or
    swapped out) are dropped. An output that schedules nothing and moves no block is not run, so it lists
    no rows to drop and no forked sequence (the next one does). The three block lists are applied before
    the forward pass, all reading their sources before any is written (a block freed during the step may
    be reused by another list). No request is swapped both out and in within one step.
    """

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_requests: list[Request] = field(default_factory=list)
    resumed_requests: list[Request] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    ignored: list[Request] = field(default_factory=list)
    #: Scheduled tokens that are a request's one token this step, past its prompt; the rest are prefill
    #: tokens (a one-token prompt or last prompt chunk among them), however the kernels group the rows.
    num_decode_tokens: int = 0
    #: The KV blocks the scheduled tokens fill, from the one holding each request's first new token: sealed
    #: for the prefix cache when scheduled, uncached if the step fails (``Scheduler.step_failed``), even
    #: where their request has let them go since (aborted, preempted, finished while the step ran).
    blocks_to_fill: list[int] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)

    @property
    def runs(self) -> bool:
        """Whether the executor has work: tokens to compute or blocks to move. The engine passes
        only such outputs to the executor."""
        return bool(self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


class Step:
    """The step being built: what is scheduled so far and the token budget left."""

    def __init__(self, token_budget: int, block_size: int) -> None:
        self.token_budget = token_budget
        self.block_size = block_size
        self.out = SchedulerOutput()

    def is_scheduled(self, request: Request) -> bool:
        return request.request_id in self.out.num_scheduled_tokens

    def was_preempted(self, request: Request) -> bool:
        """Taken off the device in this step (by recompute or swap)."""
        return request in self.out.preempted or request in self.out.swapped_out

    def was_swapped_in(self, request: Request) -> bool:
        return request in self.out.swapped_in

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.out.scheduled)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.out.num_scheduled_tokens.values())

    def _add(self, request: Request, num_tokens: int) -> None:
        out, computed = self.out, request.num_computed_tokens
        out.scheduled.append(request)
        out.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        if num_tokens == 1 and computed >= len(request.prompt_token_ids):
            out.num_decode_tokens += 1
        out.blocks_to_fill.extend(request.block_ids[computed // self.block_size:])
