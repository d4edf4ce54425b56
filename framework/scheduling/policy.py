"""The ``SchedulerPolicy`` interface: the decisions of a step, made through the ``Scheduler``'s operations."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

from framework.common.registry import Registry
from framework.common.request import Request

if TYPE_CHECKING:
    from framework.scheduling.output import Step
    from framework.scheduling.scheduler import Scheduler

RECOMPUTE = "recompute"
SWAP = "swap"


class SchedulerPolicy(ABC):
    """Decides which requests run each step and how many tokens each computes.

    A policy never edits queues or blocks itself: it calls the scheduler's operations
    (``schedule_request``, ``schedule_or_preempt``, ``preempt``, ``swap_in``, ``ignore``), which
    keep the invariants. Override the narrow hooks to change one decision, or ``schedule`` to
    form batches differently:

    - ``waiting_order``: the order waiting requests are considered in;
    - ``select_victim`` / ``preemption_mode_for``: whom to preempt when blocks run out, and how;
    - ``num_new_tokens``: how many tokens a request gets this step (chunking);
    - ``on_waiting``: told when a request enters the waiting queue (for a policy's own index).

    Options come from ``policy_options`` (Hydra: the ``policy`` group's keys) as keyword
    arguments; unknown options are rejected.
    """

    name: ClassVar[str] = ""
    #: Whether a prompt may be split across steps; if not, longer prompts than the step budget
    #: are finished IGNORED on arrival.
    chunks_prefills: ClassVar[bool] = False

    def __init__(self, preemption_mode: str = RECOMPUTE) -> None:
        if preemption_mode not in (RECOMPUTE, SWAP):
            raise ValueError(f"preemption_mode must be {RECOMPUTE!r} or {SWAP!r}, got {preemption_mode!r}")
        self.preemption_mode = preemption_mode

    # -- narrow hooks ----------------------------------------------------------------------------
    def waiting_order(self, waiting: Sequence[Request]) -> Iterable[Request]:
        """Waiting requests in the order to admit them (default: queue order; preempted first)."""
        return list(waiting)

    def select_victim(self, candidates: list[Request], requester: Request) -> Request | None:
        """Whom to preempt so ``requester`` can run; ``candidates`` are ``Scheduler.preemptable``: running requests
        not scheduled this step (with async scheduling, those whose last token is in flight too), oldest admission
        first. None: preempt nobody (the requester waits)."""
        return candidates[-1] if candidates else None

    def preemption_mode_for(self, victim: Request) -> str:
        return self.preemption_mode

    def on_waiting(self, request: Request) -> None:
        """Called each time ``request`` enters the waiting queue (arrival, recompute preemption, a forked
        sample waiting for a seat: told after the step's forks, last first), for a policy that indexes
        its waiting requests (``chunked``'s heap). Default: nothing."""

    def num_new_tokens(self, request: Request, token_budget: int, num_prefix_tokens: int = 0) -> int:
        """Tokens to compute for ``request`` now, given what is left of the step's budget."""
        return min(request.num_tokens - request.num_computed_tokens - num_prefix_tokens, token_budget)

    def swap_in_in_order(self, scheduler: Scheduler, step: Step) -> bool:
        """Bring swapped requests back oldest first (by arrival, as vLLM v0 sorts its swapped
        queue), each with its next tokens scheduled, while the budget, the blocks and
        ``max_num_seqs`` allow. False when one had to stay out (those after it stay out too)."""
        # Not the order they left: victims leave newest first, so that order would bring a newer
        # request back ahead of an older one, the opposite of first come, first served.
        for req in sorted(scheduler.swapped, key=lambda r: (r.arrival_time, r.arrival_order)):
            if step.token_budget == 0 or not scheduler.swap_in(step, req, self.num_new_tokens(req, step.token_budget)):
                return False
        return True

    # -- the whole step --------------------------------------------------------------------------
    @abstractmethod
    def schedule(self, scheduler: Scheduler, step: Step) -> None:
        """Fill ``step`` using the scheduler's operations."""


POLICIES: Registry[SchedulerPolicy] = Registry(
    "policy", SchedulerPolicy, entry_point_group="framework.policies", builtin="policies", plural="policies")
