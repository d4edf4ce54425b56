"""Batched sampling on the device (penalties, temperature, min-p, top-k, top-p, seeds) and logprobs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from framework.execution.input_preparer import Penalties, PromptLogprobsMetadata, SamplingMetadata
from framework.common.outputs import Logprob


@dataclass
class LogprobsTensors:
    """Logprobs of some sampled rows: ``token_ids[i]`` and ``logprobs[i]`` hold row ``i``'s
    sampled token, then its ``k`` most likely tokens in decreasing order (``k`` the largest any
    of the rows asked for); ``ranks[i]`` is the sampled token's 1-based rank."""

    token_ids: torch.Tensor  # [rows, k + 1] int64
    logprobs: torch.Tensor  # [rows, k + 1] float32
    ranks: torch.Tensor  # [rows] int64

    def to_dicts(self, num_logprobs: list[int]) -> list[dict[int, Logprob]]:
        """Row ``i`` as vLLM's ``{token_id: Logprob}`` (no decoded text): the sampled token, then its own
        ``num_logprobs[i]`` top tokens; a sampled token among them takes its top-k rank, so a row has
        ``k`` or ``k + 1`` entries."""
        ids, logprobs, ranks = self.token_ids, self.logprobs, self.ranks
        if ids.device.type != "cpu":
            # One transfer: float64 holds the ids, ranks and float32 logprobs exactly.
            packed = torch.cat([ids.double(), logprobs.double(), ranks.double().unsqueeze(1)], dim=1).cpu()
            width = ids.shape[1]
            ids, logprobs, ranks = packed[:, :width].long(), packed[:, width:2 * width], packed[:, -1].long()
        dicts = []
        for row_ids, row_logprobs, rank, k in zip(ids.tolist(), logprobs.tolist(), ranks.tolist(), num_logprobs):
            entry = {row_ids[0]: Logprob(row_logprobs[0], rank)}
            for j in range(1, k + 1):
                entry[row_ids[j]] = Logprob(row_logprobs[j], j)
            dicts.append(entry)
        return dicts


@dataclass
class SamplerOutput:
    """The sampled token of every row, and the logprobs of the rows that asked (None if none did)."""

    sampled: torch.Tensor
    logprobs: LogprobsTensors | None = None


class Sampler:
    """Applies penalties (to greedy rows too, as vLLM), then greedy rows take the argmax; the others are
    scaled by temperature, filtered by min-p, top-k and top-p, and sampled by Gumbel-max (``argmax(p / q)``,
    ``q ~ Exp(1)``), a seeded row's noise from its own generator so it does not depend on the batch.
    ``fused_ops`` (``models.cpu_ops.fused_ops()``): CPU rows' argmax through its ``argmax_rows``."""

    def __init__(self, generator: torch.Generator | None = None, fused_ops: ModuleType | None = None) -> None:
        self.generator = generator
        self.fused_ops = fused_ops

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first largest value's index (float32 ``[rows, n]``); a NaN is not picked by the fused
        operator (torch's would), which makes no difference to what NaN logits mean."""
        if self.fused_ops is None or x.device.type != "cpu" or x.stride(-1) != 1:
            return x.argmax(dim=-1)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.fused_ops.argmax_rows(x, out)
        return out

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The sampled tokens (``self(logits, meta)``) and the logprobs of ``meta.logprob_rows``: float32
        ``log_softmax`` of the logits as they come, before penalties, temperature and filters (vLLM v1's
        default, ``logprobs_mode="raw_logprobs"``)."""
        if meta.logprob_rows is None:
            return SamplerOutput(self(logits, meta))
        raw = logits[meta.logprob_rows].float().log_softmax(dim=-1)
        sampled = self(logits, meta)
        assert meta.num_logprobs is not None
        return SamplerOutput(sampled, gather_logprobs(raw, sampled[meta.logprob_rows], max(meta.num_logprobs)))

    def prompt_logprobs(self, logits_of: Callable[[slice], torch.Tensor], meta: PromptLogprobsMetadata,
                        max_rows: int | None = None) -> list[list[dict[int, Logprob]]]:
        """Each of ``meta.req_ids``' prompt logprobs: the predicted prompt token's logprob and rank, then the
        request's ``num_logprobs`` most likely tokens, of the raw float32 ``log_softmax`` as ``sample``'s.
        ``logits_of(rows)``: the logits of positions ``meta.indices[rows]``, asked for ``max_rows`` at a time."""
        num, k = len(meta.token_ids), max(meta.num_logprobs)
        step = num if max_rows is None else max_rows
        parts = [gather_logprobs(logits_of(slice(i, i + step)).float().log_softmax(dim=-1),
                                 meta.token_ids[i:i + step], k) for i in range(0, num, step)]
        tensors = parts[0] if len(parts) == 1 else LogprobsTensors(
            *(torch.cat(column) for column in zip(*((t.token_ids, t.logprobs, t.ranks) for t in parts))))
        dicts = tensors.to_dicts([k for k, count in zip(meta.num_logprobs, meta.counts) for _ in range(count)])
        out, start = [], 0
        for count in meta.counts:
            out.append(dicts[start:start + count])
            start += count
        return out

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits.float()
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        greedy = self.argmax(logits)
        if meta.all_greedy:
            return greedy
        temperature = meta.temperature
        assert temperature is not None, "a row samples at a temperature above 0"
        is_greedy = temperature == 0
        # Shifted by the row maximum so a tiny temperature (below about 1e-37) cannot scale logits to
        # +inf (a NaN softmax samples token 0); the shift changes neither the softmax nor the filters.
        logits = logits - logits.max(dim=-1, keepdim=True).values
        logits /= torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
        if meta.min_p is not None:
            # Before top-k / top-p, as vLLM v1; the order does not matter, since min-p compares each
            # token with the most likely one (which the other filters keep) by a ratio.
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            noise[row].exponential_(generator=gen)
        sampled = self.argmax(probs.div_(noise))
        return torch.where(is_greedy, greedy, sampled)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """A new ``logits`` with rows ``p.rows`` penalised: the repetition penalty divides positive and multiplies
    negative logits of tokens in the prompt or output (as transformers and vLLM), then ``frequency * count +
    presence * (count > 0)`` is subtracted, counting output tokens only."""
    sub = logits.index_select(0, p.rows)
    rows, vocab = sub.shape
    ids = p.token_ids
    # Padding (-1) and ids outside the vocabulary go to an extra column, dropped after counting.
    valid = (ids >= 0) & (ids < vocab)
    ids = torch.where(valid, ids, vocab)
    is_output = valid & (torch.arange(ids.shape[1], device=ids.device) >= p.num_prompt_tokens.unsqueeze(1))
    counts = torch.zeros(rows, vocab + 1, dtype=sub.dtype, device=sub.device)
    counts.scatter_add_(1, ids, is_output.to(sub.dtype))
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=sub.device).scatter_(1, ids, True)
    counts, seen = counts[:, :vocab], seen[:, :vocab]
    repetition = p.repetition_penalties.unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    # A penalty far from 1 (SamplingParams takes down to about 1e-45) overflows to inf, which the sampler's
    # shift by the row maximum would turn into NaN: the most favoured token is then the largest finite logit.
    fmax = torch.finfo(sub.dtype).max
    sub.clamp_(-fmax, fmax)
    sub -= p.frequency_penalties.unsqueeze(1) * counts
    sub -= p.presence_penalties.unsqueeze(1) * (counts > 0)
    return logits.index_copy(0, p.rows, sub)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop each row's tokens less likely than ``min_p`` times its most likely token (``min_p ==
    0``: keep all; the most likely token always stays)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Each row's logprob and rank of ``token_ids`` and its ``k`` largest logprobs. The rank is
    how many tokens have a logprob at least the token's (1 for the most likely), as vLLM counts."""
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    token_ids = token_ids.unsqueeze(1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(torch.cat([token_ids, top_ids], dim=1), torch.cat([token_logprobs, top_logprobs], dim=1),
                           ranks)


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
