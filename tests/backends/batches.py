"""Random mixed attention batches and a float64 reference to check every backend against.

A batch is a list of ``(num_computed, q_len)`` pairs, one per request: ``(c, 1)`` is a decode
(``c == 0``: an empty-context decode), ``(0, n)`` a full prefill, ``(c, n)`` a chunked prefill or
a prefix-cache hit (``c`` a multiple of the block size). Each request's context K/V are placed
at randomly chosen cache blocks; every other cache slot, the null block included, holds large
random "poison" values that would wreck the result if a backend let them in. The reference
computes attention straight from each request's dense K/V in float64: no cache, no block
table, no SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from framework.execution.attention import AttentionMetadata

POISON_SCALE = 1000.0


@dataclass
class Batch:
    q: torch.Tensor              # [T, heads, head_dim]
    k: torch.Tensor              # [T, kv_heads, head_dim]: the new tokens' keys
    v: torch.Tensor
    kv_cache: torch.Tensor       # [2, blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata
    expected: torch.Tensor       # [T, heads, head_dim] float64
    scale: float


def random_batch(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int, spare_blocks: int = 3,
                 device: str | torch.device = "cpu") -> Batch:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    seq_lens = np.array([c + n for c, n in specs], dtype=np.int64)
    q_lens = np.array([n for _, n in specs], dtype=np.int64)
    blocks_per_req = -(-seq_lens // block_size)
    num_blocks = 1 + int(blocks_per_req.sum()) + spare_blocks
    ids = rng.permutation(np.arange(1, num_blocks))  # block 0 stays the (poisoned) null block
    width = int(blocks_per_req.max())
    table = np.zeros((len(specs), width), dtype=np.int64)
    used = 0
    for i, nb in enumerate(blocks_per_req):
        table[i, :nb] = ids[used:used + nb]
        used += nb

    cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
             * POISON_SCALE).to(dtype)
    flat_cache = cache.view(2, -1, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    group = num_heads // num_kv_heads
    qs, ks, vs, outs, slots = [], [], [], [], []
    for i, (ctx, n) in enumerate(specs):
        seq = ctx + n
        keys, values = randn(seq, num_kv_heads, head_dim), randn(seq, num_kv_heads, head_dim)
        pos = np.arange(seq)
        req_slots = table[i, pos // block_size] * block_size + pos % block_size
        flat_cache[0, req_slots[:ctx]] = keys[:ctx]
        flat_cache[1, req_slots[:ctx]] = values[:ctx]
        queries = randn(n, num_heads, head_dim)
        qs.append(queries)
        ks.append(keys[ctx:])
        vs.append(values[ctx:])
        slots.append(req_slots[ctx:])
        outs.append(reference_attention(queries, keys, values, scale, group))

    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    slot_mapping = np.concatenate(slots).astype(np.int64)
    dev = torch.device(device)
    meta = AttentionMetadata.from_host(qsl, seq_lens, table, slot_mapping, block_size, dev)
    return Batch(q=torch.cat(qs).to(dev), k=torch.cat(ks).to(dev), v=torch.cat(vs).to(dev), kv_cache=cache.to(dev),
                 meta=meta, expected=torch.cat(outs), scale=scale)


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        group: int) -> torch.Tensor:
    """One request in float64: ``q`` ``[n, heads, d]`` are the last ``n`` of ``len(keys)``
    positions; query ``j`` sees keys ``0 .. len(keys) - n + j``; query head ``h`` reads K/V head
    ``h // group``."""
    n, seq = q.shape[0], keys.shape[0]
    q, keys, values = q.double(), keys.double(), values.double()
    kv_head = torch.arange(q.shape[1]) // group
    k_h, v_h = keys[:, kv_head], values[:, kv_head]            # [seq, heads, d]
    scores = torch.einsum("qhd,khd->hqk", q, k_h) * scale
    visible = torch.arange(seq)[None, :] <= (seq - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v_h)


def mixed_specs(rng: np.random.Generator, block_size: int, num_reqs: int, max_len: int) -> list[tuple[int, int]]:
    """A shuffled batch with at least one of each kind: empty-context decode, decode, full
    prefill, chunked prefill crossing a block boundary, prefix-cache hit."""
    bs = block_size
    specs = [(0, 1), (int(rng.integers(1, max_len)), 1), (0, int(rng.integers(2, max_len))),
             (max(1, bs - 3), 7), (bs * int(rng.integers(1, max(2, max_len // bs))), int(rng.integers(2, bs + 3)))]
    while len(specs) < num_reqs:
        kind = rng.integers(3)
        if kind == 0:
            specs.append((int(rng.integers(0, max_len)), 1))
        elif kind == 1:
            specs.append((0, int(rng.integers(2, max_len))))
        else:
            ctx = int(rng.integers(1, max_len))
            specs.append((ctx, int(rng.integers(2, max(3, max_len - ctx)))))
    order = rng.permutation(len(specs))
    return [specs[i] for i in order]


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """max |out - expected| / max |expected| (NaN if ``out`` has any NaN)."""
    diff = (out.double().cpu() - expected).abs().max()
    return float(diff / expected.abs().max())
