"""Per-request sampling parameters, named and defaulted as in vLLM's offline API."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1.0 disable those
    filters. ``seed`` makes one request's samples reproducible whatever else is in the batch.
    ``max_tokens`` counts generated tokens; generation also stops at the engine's ``max_model_len``.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    detokenize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
