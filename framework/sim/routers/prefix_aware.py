"""Prefix-cache-aware routing: send a request where most of its prompt is already cached.

The request goes to the replica whose prefix cache holds most of its prompt's leading blocks, ties to
the least loaded; when that replica has more than ``max_imbalance`` outstanding requests above the least
loaded one, load wins, so a popular prefix is not piled onto one replica (as SGLang's cache-aware router).
"""
from __future__ import annotations

from collections.abc import Sequence

from framework.common.config import is_int
from framework.common.request import Request
from framework.sim.router import ROUTERS, Replica, Router, least_loaded


@ROUTERS.register("prefix_aware")
class PrefixAwareRouter(Router):
    def __init__(self, max_imbalance: int | None = 16) -> None:
        # An integer, as outstanding requests are counted: a NaN would silently mean no balancing.
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
