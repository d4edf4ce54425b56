"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import torch

from framework.input_preparer import SamplingMetadata


class Sampler:
    """Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k and
    top-p, and sampled with the Gumbel-max trick (``argmax(p / q)``, ``q ~ Exp(1)``), drawing a
    seeded row's noise from its own generator so its samples do not depend on the batch."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        temperature = meta.temperature
        is_greedy = temperature == 0
        # Shifted by the row maximum first: a tiny temperature (below about 1e-37) would otherwise
        # scale logits to +inf and the softmax to NaN, sampling token 0. The shift changes neither
        # the softmax nor the top-k / top-p sets.
        logits = logits - logits.max(dim=-1, keepdim=True).values
        logits /= torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            noise[row].exponential_(generator=gen)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (``k == 0``: keep all)."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, vocab, k.clamp(max=vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches ``p``
    (``p == 1``: keep all)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A float32 cumulative sum reaches 1 before the tail: without the p < 1 test a row with top-p
    # off (batched with one using it) would lose its least likely tokens.
    drop = (mass_before >= p.unsqueeze(1)) & (p < 1).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
