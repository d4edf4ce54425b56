"""Prefix-cache-aware routing: send a request where most of its prompt is already cached.

Each replica's allocator says how many leading blocks of the prompt its prefix cache holds
(``find_prefix``); the request goes to the replica holding the most, ties to the least loaded.
Pure cache affinity piles a popular prefix onto one replica, so when that replica has more than
``max_imbalance`` outstanding requests above the least loaded one, load wins (SGLang's
cache-aware router balances the same way).
"""
from __future__ import annotations

from collections.abc import Sequence

from framework.common.config import is_int
from framework.common.request import Request
from framework.sim.router import ROUTERS, Replica, Router, least_loaded


@ROUTERS.register("prefix_aware")
class PrefixAwareRouter(Router):
    def __init__(self, max_imbalance: int | None = 16) -> None:
        # An integer: outstanding requests are counted. A NaN would compare false and silently
        # mean no balancing, a bool would mean 0 or 1, and a string would fail with a TypeError.
        if max_imbalance is not None and not (is_int(max_imbalance) and max_imbalance >= 0):
            raise ValueError(f"max_imbalance must be an integer >= 0 or None (no balancing), got {max_imbalance!r}")
        self.max_imbalance = max_imbalance

    def route(self, request: Request, replicas: Sequence[Replica]) -> int:
        hits = [r.prefix_tokens(request) for r in replicas]
        best_hit = max(hits)
        lightest = least_loaded(replicas)
        if best_hit == 0:
            return lightest.index
        best = least_loaded([r for r, h in zip(replicas, hits) if h == best_hit])
        if self.max_imbalance is not None and best.num_outstanding - lightest.num_outstanding > self.max_imbalance:
            return lightest.index
        return best.index
