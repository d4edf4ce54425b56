"""Shortest prompt first: the ``chunked`` policy with its waiting queue reordered (one hook)."""
from __future__ import annotations

from framework.common.request import Request
from framework.scheduling.policy import POLICIES
from policies.chunked import ChunkedPolicy


@POLICIES.register("sjf")
class ShortestPromptFirstPolicy(ChunkedPolicy):
    """Admits the waiting request with the fewest prompt tokens first (ties by arrival), which
    cuts mean time to first token when prompt lengths vary. Long prompts can wait for as long as
    shorter ones keep arriving; everything else is ``chunked``."""

    def waiting_key(self, request: Request) -> tuple[int, float]:
        return request.num_prompt_tokens, request.arrival_time
