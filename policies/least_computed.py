"""Least-computed-first preemption: the ``chunked`` policy with another victim choice (one hook)."""
from __future__ import annotations

from framework.common.request import Request
from framework.scheduling.policy import POLICIES
from policies.chunked import ChunkedPolicy


@POLICIES.register("least_computed")
class LeastComputedFirstPolicy(ChunkedPolicy):
    """When blocks run out, preempts the running request with the fewest computed tokens (the
    requester itself included), so recompute throws away the least work. Ties go to the newest."""

    def select_victim(self, candidates: list[Request], requester: Request) -> Request | None:
        victim = min(reversed(candidates), key=lambda r: r.num_computed_tokens, default=None)
        if victim is None or requester.num_computed_tokens < victim.num_computed_tokens:
            return None  # the requester is cheapest to recompute: it preempts itself
        return victim
