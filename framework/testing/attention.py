"""An attention backend checked against a float64 reference: ``check_backend(NAME)`` runs it on random mixed
batches (several head groupings, dtypes and block sizes, strided inputs, a padded block table, an empty step) and
raises AssertionError naming the first case it gets wrong. The batches and the reference are here for tests too.

A batch is a list of ``(num_computed, q_len)`` pairs, one per request: ``(c, 1)`` is a decode
(``c == 0``: an empty-context decode), ``(0, n)`` a full prefill, ``(c, n)`` a chunked prefill or
a prefix-cache hit (``c`` a multiple of the block size). Each request's context K/V are placed
at randomly chosen cache blocks; every other cache slot, the null block included, holds large
random "poison" values that would wreck the result if a backend let them in. The reference
computes attention straight from each request's dense K/V in float64: no cache, no block
table, no SDPA.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from framework.execution.attention import BACKENDS, AttentionBackend, AttentionMetadata

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


#: Largest relative error against the float64 reference a dtype's result may have.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
#: (query heads, K/V heads): 1, 2, 3, 4, 7 and 8 query heads per K/V head.
GQA = ((4, 4), (4, 2), (6, 2), (8, 2), (7, 1), (8, 1))
KINDS = ("mixed", "decode", "prefill")
HEAD_DIM = 32  # every case's head size but those of ``HEAD_DIMS``
HEAD_DIMS = (64, 128)  # a mixed step in each dtype at each of these head sizes too


def seed_of(*params: object) -> int:
    return zlib.crc32(repr(params).encode())


def batch_specs(kind: str, rng: np.random.Generator, block_size: int) -> list[tuple[int, int]]:
    """(num_computed, q_len) per request. "mixed" has every kind in one batch; "decode" includes
    an empty-context decode and lengths that end exactly on a block boundary; "prefill" mixes
    full prefills with a prefix-cache hit and a chunk that crosses a block boundary."""
    if kind == "mixed":
        return mixed_specs(rng, block_size, num_reqs=7, max_len=70)
    if kind == "decode":
        return [(0, 1), (block_size - 1, 1), (block_size, 1)] + [(int(c), 1) for c in rng.integers(1, 90, size=4)]
    return [(0, int(n)) for n in rng.integers(2, 60, size=3)] + [(2 * block_size, 9), (max(1, block_size - 2), 5)]


@dataclass(frozen=True)
class Case:
    """One step a backend must get right: requests ``specs`` ((num_computed, q_len) each; none: an empty step).
    ``layout``: "plain"; "strided" (q, k, v column slices of one fused projection, no ``out`` given, as the model
    passes them); "wide" (the block table padded with null-block columns no request reaches)."""

    kind: str
    specs: tuple[tuple[int, int], ...]
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    block_size: int
    layout: str = "plain"
    head_dim: int = HEAD_DIM

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        layout = "" if self.layout == "plain" else f", {self.layout} layout"
        return (f"{self.kind} step {list(self.specs)} ((computed, new) tokens per request), {self.num_heads} query "
                f"heads over {self.num_kv_heads} K/V heads of size {self.head_dim}, {dtype}, block size "
                f"{self.block_size}{layout}")


def cases(block_size: int = 16, dtypes: tuple[torch.dtype, ...] = tuple(TOLERANCE),
          head_dims: tuple[int, ...] = HEAD_DIMS) -> list[Case]:
    """Every kind of step in every dtype and head grouping; a mixed step in each dtype at each of ``head_dims`` and at
    twice ``block_size``; then the layouts and edge cases in the first dtype."""
    out = []
    for dtype in dtypes:
        for num_heads, num_kv_heads in GQA:
            for kind in KINDS:
                rng = np.random.default_rng(seed_of(kind, num_heads, num_kv_heads, str(dtype), block_size))
                specs = tuple(batch_specs(kind, rng, block_size))
                out.append(Case(kind, specs, num_heads, num_kv_heads, dtype, block_size))
        for head_dim in head_dims:
            specs = tuple(batch_specs("mixed", np.random.default_rng(seed_of(head_dim, str(dtype))), block_size))
            out.append(Case("mixed", specs, 8, 2, dtype, block_size, head_dim=head_dim))
        bigger = 2 * block_size
        specs = tuple(batch_specs("mixed", np.random.default_rng(seed_of(bigger, str(dtype))), bigger))
        out.append(Case("mixed", specs, 8, 2, dtype, bigger))
    first = dtypes[0]
    strided = tuple(mixed_specs(np.random.default_rng(seed_of("strided", block_size)), block_size, 6, 40))
    out.append(Case("mixed", strided, 8, 2, first, block_size, "strided"))
    out.append(Case("mixed", ((5, 1), (0, 12), (20, 3)), 4, 2, first, block_size, "wide"))
    # A one-token prompt as the step's only decode-shaped row, and a prompt as its only prefill: a backend
    # that plans per group of rows must still hide the rest of the request's block.
    for specs in (((0, 1),), ((0, 1), (0, 9)), ((0, 7),)):
        out.append(Case("lone request", specs, 4, 2, first, block_size))
    out.append(Case("empty", (), 4, 2, first, block_size))
    return out


def run_case(name: str, case: Case, device: str | torch.device = "cpu", **options: Any) -> None:
    """Run backend ``name`` (built with ``options``) on ``case``; AssertionError if its output strays from the
    float64 reference past ``TOLERANCE``, leaves an element unwritten, or the step writes a cache slot not in
    ``slot_mapping``."""
    if not case.specs:
        backend = BACKENDS.create(name, num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                                  head_dim=case.head_dim, scale=case.head_dim ** -0.5, block_size=case.block_size,
                                  dtype=case.dtype, device=device, **options)
        _check_empty_step(backend, case, device)
        return
    seed = seed_of(case.kind, case.specs, case.num_heads, case.num_kv_heads, str(case.dtype), case.layout,
                   case.head_dim, case.block_size)
    batch = random_batch(list(case.specs), case.num_heads, case.num_kv_heads, case.head_dim, case.block_size,
                         case.dtype, seed, device=device)
    if case.layout == "strided":
        fused = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
        d = case.head_dim
        q, k, v = fused.split([case.num_heads * d, case.num_kv_heads * d, case.num_kv_heads * d], dim=1)
        batch.q, batch.k, batch.v = (q.view(-1, case.num_heads, d), k.view(-1, case.num_kv_heads, d),
                                     v.view(-1, case.num_kv_heads, d))
    elif case.layout == "wide":
        meta = batch.meta
        meta.block_table_cpu = np.pad(meta.block_table_cpu, ((0, 0), (0, 3)))
        meta.block_table = torch.from_numpy(meta.block_table_cpu).to(device)
    before = batch.kv_cache.clone()
    result = run_named(name, batch, case.num_heads, case.num_kv_heads, case.head_dim, case.block_size, case.dtype,
                       device, use_out=case.layout != "strided", **options)
    check_result(result, batch, before, case.dtype)


def run_named(name: str, batch: Batch, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: str | torch.device, use_out: bool = True, **options: Any) -> torch.Tensor:
    """Backend ``name`` built for these shapes (and ``options``), run on ``batch`` by ``run_backend``."""
    backend = BACKENDS.create(name, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              scale=batch.scale, block_size=block_size, dtype=dtype, device=device, **options)
    return run_backend(backend, batch, use_out)


def run_backend(backend: AttentionBackend, batch: Batch, use_out: bool = True) -> torch.Tensor:
    """``backend``'s output for ``batch`` through ``build_metadata`` and ``forward``, into a NaN-filled ``out`` when
    ``use_out``; AssertionError if it breaks the interface's promises on the result's place, shape or dtype."""
    meta = backend.build_metadata(batch.meta)
    out = torch.full_like(batch.q, float("nan")) if use_out else None
    result = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, out=out)
    if use_out:
        assert result.data_ptr() == out.data_ptr(), "forward(out=...) must write into out and return it"
    assert result.shape == batch.q.shape, f"output shape {tuple(result.shape)}, expected {tuple(batch.q.shape)}"
    assert result.dtype == batch.q.dtype, f"output dtype {result.dtype}, expected {batch.q.dtype}"
    return result


def check_result(result: torch.Tensor, batch: Batch, cache_before: torch.Tensor, dtype: torch.dtype) -> None:
    """AssertionError unless ``result`` is within ``TOLERANCE`` of the reference with every element written, and the
    cache equals ``cache_before`` with exactly the new tokens' K/V stored at their ``slot_mapping`` slots."""
    assert not torch.isnan(result).any(), "an output element was never written (or became NaN)"
    err = relative_error(result, batch.expected)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} vs the float64 reference (at most {TOLERANCE[dtype]:g})"
    expected_cache = cache_before.clone()
    flat = expected_cache.view(2, -1, *expected_cache.shape[-2:])
    slots = batch.meta.slot_mapping
    flat[0, slots] = batch.k
    flat[1, slots] = batch.v
    assert torch.equal(batch.kv_cache, expected_cache), "the K/V store touched slots outside slot_mapping"


def _check_empty_step(backend: AttentionBackend, case: Case, device: str | torch.device) -> None:
    none = np.zeros(0, dtype=np.int64)
    meta = AttentionMetadata.from_host(np.zeros(1, dtype=np.int64), none, np.zeros((0, 1), dtype=np.int64), none,
                                       case.block_size, device)
    d = case.head_dim
    cache = torch.randn(2, 3, case.block_size, case.num_kv_heads, d).to(device=device, dtype=case.dtype)
    before = cache.clone()
    q = torch.zeros(0, case.num_heads, d, dtype=case.dtype, device=device)
    kv = torch.zeros(0, case.num_kv_heads, d, dtype=case.dtype, device=device)
    out = backend.forward(q, kv, kv, cache, backend.build_metadata(meta))
    assert tuple(out.shape) == (0, case.num_heads, d), f"output shape {tuple(out.shape)} for no tokens"
    assert torch.equal(cache, before), "a step of no tokens wrote the cache"


def check_backend(name: str, device: str | torch.device = "cpu", block_size: int | None = None,
                  dtypes: tuple[torch.dtype, ...] | None = None, **options: Any) -> int:
    """Run registered backend ``name`` (built with ``options``) on every ``cases()`` step; AssertionError naming the
    first it gets wrong. Defaults: the smallest block size it allows from 16 up (and twice that), the dtypes and
    ``HEAD_DIMS`` it supports. Returns the number of steps checked."""
    cls = BACKENDS.get(name)
    if block_size is None:
        block_size = int(np.lcm(16, cls.block_size_multiple))
    if dtypes is None:
        dtypes = tuple(d for d in TOLERANCE if not cls.unsupported(HEAD_DIM, block_size, d))
    if not dtypes:
        raise ValueError(f"backend {name!r} supports none of {', '.join(str(d) for d in TOLERANCE)} at head size "
                         f"{HEAD_DIM} and block size {block_size}")
    head_dims = tuple(d for d in HEAD_DIMS if not cls.unsupported(d, block_size, dtypes[0]))
    checked = cases(block_size, dtypes, head_dims)
    for case in checked:
        try:
            run_case(name, case, device, **options)
        except AssertionError as e:
            raise AssertionError(f"backend {name!r} on a {case}: {e}") from None
    return len(checked)
