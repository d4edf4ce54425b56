"""Shortest prompt first: the ``chunked`` policy with its waiting queue reordered (one hook)."""
from __future__ import annotations

from collections.abc import Sequence

from framework.request import Request
from framework.scheduler import POLICIES
from policies.chunked import ChunkedPolicy


@POLICIES.register("sjf")
class ShortestPromptFirstPolicy(ChunkedPolicy):
    """Admits the waiting request with the fewest prompt tokens first (ties by arrival), which
    cuts mean time to first token when prompt lengths vary. Long prompts can wait for as long as
    shorter ones keep arriving; everything else is ``chunked``."""

    def waiting_order(self, waiting: Sequence[Request]) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_time))
