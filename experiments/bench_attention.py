"""Attention backends head to head: decode-heavy and prefill-heavy batches at several batch sizes
and context lengths.

Each case times one layer's ``forward`` (K/V store + attention, after ``build_metadata``; CUDA
events on a GPU, ``perf_counter`` on a CPU; median of ``--iters`` after a warm-up, the backends
taking turns) and prints:
- ``ms``: the median time, and ``x naive``: the speed-up over ``naive`` on the same case;
- ``KV GB/s``: bytes of K and V the attention has to read (each request's whole context, once)
  over the time, and ``% copy``: that against the device's copy bandwidth measured here
  (``dst.copy_(src)`` of a large buffer, read + write bytes over time);
- ``TFLOP/s`` for prefill-heavy cases: 4 * head_dim * heads * (query, key) pairs that the causal
  mask keeps, over the time.

    python experiments/bench_attention.py                       # CPU: naive vs torch_paged
    python experiments/bench_attention.py --backends naive,torch_paged,triton,flash_attn   # GPU

On a CPU ``triton`` runs through Triton's interpreter, which is for correctness, not speed: it
is left out unless named. ``flash_attn`` runs with 256-token blocks (its paged-KV requirement);
the others with ``--block-size``.

Memory: a case's inputs are made on the device in the run's dtype, and one cache serves every backend
(``flash_attn`` views it in 256-token blocks), freed before the next case. The largest default GPU
case (decode, 256 requests x 16,384 tokens, bfloat16, 8 K/V heads of 128) peaks at about 35 GB: the
17.4 GB cache and torch_paged's 17.2 GB gather buffer.
"""
from __future__ import annotations

import argparse
import re
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from backends.flash_attn import missing_requirements  # noqa: E402
from framework.execution.attention import BACKENDS, AttentionMetadata  # noqa: E402
from framework.common.config import DTYPE_ALIASES  # noqa: E402
from framework.execution.executors.model import resolve_device, resolve_dtype  # noqa: E402
from framework.common.registry import UnavailableError, UnknownNameError  # noqa: E402


@dataclass
class Case:
    kind: str            # "decode" or "prefill"
    batch: int
    context: int         # tokens already cached per request
    q_len: int           # new tokens per request

    @property
    def label(self) -> str:
        return f"{self.kind:7s} B={self.batch:<4d} ctx={self.context:<5d} q={self.q_len}"


def make_inputs(case: Case, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                device: torch.device, block_sizes: list[int], seed: int = 0):
    """Random q/k/v and one cache, made on ``device`` in ``dtype``; per size in ``block_sizes`` (multiples
    of ``block_size`` dividing the largest) a view of the cache and the step's metadata, each request's
    blocks scattered at random in runs of the largest size, so every view holds the same K/V."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    n, seq = case.batch, case.context + case.q_len
    largest = max(block_sizes)
    runs_per_req = -(-seq // largest)
    runs = rng.permutation(np.arange(1, 1 + n * runs_per_req)).reshape(n, runs_per_req)  # run 0: the null block
    cache = torch.randn(2, (1 + n * runs_per_req) * largest // block_size, block_size, kv_heads, head_dim,
                        generator=gen, device=device, dtype=dtype)
    tokens = n * case.q_len
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen, device=device, dtype=dtype)
               for h in (heads, kv_heads, kv_heads))
    pos = case.context + np.arange(case.q_len)
    qsl = np.arange(n + 1, dtype=np.int64) * case.q_len
    seq_lens = np.full(n, seq, dtype=np.int64)
    views = {}
    for size in block_sizes:
        per_run = largest // size
        table = (runs[:, :, None] * per_run + np.arange(per_run)).reshape(n, -1)[:, : -(-seq // size)]
        slots = (table[:, pos // size] * size + pos % size).ravel()
        meta = AttentionMetadata.from_host(qsl, seq_lens, table.astype(np.int64), slots.astype(np.int64), size,
                                           device)
        views[size] = (cache.view(2, -1, size, kv_heads, head_dim), meta)
    return q, k, v, views


def timer(device: torch.device, flush_mb: int = 0):
    """Returns ``time_all(fns, iters) -> [median seconds per fn]``. The functions take turns
    within each iteration, so a burst of load from other processes hits them alike and the
    ratios stay fair. With ``flush_mb``, a buffer that size is rewritten (untimed) before every
    call, so the K/V come from memory as in a real step, where the other layers' K/V have
    passed through the caches in between."""
    flush = torch.empty(flush_mb * 2**20 // 4, device=device) if flush_mb else None

    def time_one(fn) -> float:
        if flush is not None:
            flush.fill_(1.0)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def time_all(fns, iters):
        times = [[] for _ in fns]
        for _ in range(iters):
            for fn, acc in zip(fns, times):
                acc.append(time_one(fn))
        return [statistics.median(t) for t in times]

    return time_all


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` (a read and a write per byte copied)."""
    n = megabytes * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    (seconds,) = timer(device)([lambda: dst.copy_(src)], 10)
    return 2 * n * 4 / seconds


def cases(args) -> list[Case]:
    out = [Case("decode", b, c, 1) for b in args.decode_batches for c in args.decode_contexts]
    out += [Case("prefill", b, 0, p) for b in args.prefill_batches for p in args.prefill_lens]
    return out


def check_minimums(p: argparse.ArgumentParser, args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """A usage error (``p.error``) for the first of these arguments given below its minimum."""
    for name, least in minimums.items():
        value = getattr(args, name)
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=None, help="comma-separated (default: naive,torch_paged on CPU; "
                   "naive,torch_paged,triton and flash_attn if installed on CUDA)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=sorted({"auto", *DTYPE_ALIASES}),
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 8 on CPU, 32 on CUDA)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default 4 on CPU, 8 on CUDA)")
    p.add_argument("--head-dim", type=int, default=None, help="default 32 on CPU (the tiny presets), 128 on CUDA")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-batches", type=ints, default=None)
    p.add_argument("--decode-contexts", type=ints, default=None)
    p.add_argument("--prefill-batches", type=ints, default=None)
    p.add_argument("--prefill-lens", type=ints, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed calls per case and backend (default 30 CPU, 50 CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--flush-mb", type=int, default=None,
                   help="buffer rewritten before each timed call to evict the caches (default 64 CPU, 256 CUDA)")
    args = p.parse_args(argv)
    # Checked before any timing: 0 used to be taken as "the default" for --iters, --heads,
    # --kv-heads and --head-dim (their `or` defaults), and to crash in the cases otherwise.
    check_minimums(p, args, {**dict.fromkeys(("heads", "kv_heads", "head_dim", "iters", "threads", "block_size"), 1),
                             "flush_mb": 0})
    for name in ("decode_batches", "decode_contexts", "prefill_batches", "prefill_lens"):
        values = getattr(args, name)
        if values is not None and min(values) < (0 if name == "decode_contexts" else 1):
            p.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'decode_contexts' else 'positive'}, "
                    f"got {','.join(map(str, values))}")

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        p.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    try:
        device = resolve_device(args.device)
    except ValueError as exc:  # its message names the engine option; here it is --device
        p.error(f"--device {args.device}: {str(exc).split(': ', 1)[-1].replace('device=', '--device ')}")
    gpu = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, None, device)
    heads = args.heads or (32 if gpu else 8)
    kv_heads = args.kv_heads or (8 if gpu else 4)
    head_dim = args.head_dim or (128 if gpu else 32)
    if heads % kv_heads:
        p.error(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if args.block_size & (args.block_size - 1) or args.block_size > 256:
        p.error(f"--block-size must be a power of two up to 256 (flash_attn's 256-token blocks view the same "
                f"cache), got {args.block_size}")
    args.decode_batches = args.decode_batches or ([1, 16, 64, 256] if gpu else [8, 64])
    args.decode_contexts = args.decode_contexts or ([1024, 4096, 16384] if gpu else [128, 512, 2048])
    args.prefill_batches = args.prefill_batches or ([1, 8] if gpu else [1, 8])
    args.prefill_lens = args.prefill_lens or ([1024, 4096] if gpu else [128, 512])
    iters = args.iters or (50 if gpu else 30)
    # Asked-for names are checked before any case runs: an unknown or unrunnable one is an error.
    # By default flash_attn is tried on CUDA and left out, with the reason, where it cannot run.
    names = args.backends.split(",") if args.backends else ["naive", "torch_paged"] + (
        ["triton", "flash_attn"] if gpu else [])
    for backend_name in names:
        try:
            BACKENDS.get(backend_name)
        except UnknownNameError as exc:
            sys.exit(f"error: {exc}")
    problems = missing_requirements(256, dtype, device, head_dim) if "flash_attn" in names else []
    if problems and args.backends:
        sys.exit("error: flash_attn cannot run here: " + "; ".join(problems).replace("set engine.dtype=", "use --dtype "))
    if problems:
        print(f"(flash_attn left out: {'; '.join(problems)})")
        names.remove("flash_attn")

    esize = dtype.itemsize
    bandwidth = copy_bandwidth(device, 1024 if gpu else 256)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; dtype {dtype}; heads {heads}/{kv_heads} (q/kv), head_dim {head_dim}, "
          f"block_size {args.block_size} (flash_attn: 256); copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'case':32s} {'backend':12s} {'ms':>9s} {'x naive':>8s} {'KV GB/s':>8s} {'% copy':>7s} {'TFLOP/s':>8s}")
    time_all = timer(device, args.flush_mb if args.flush_mb is not None else (256 if gpu else 64))
    for case in cases(args):
        seq = case.context + case.q_len
        kv_bytes = 2 * case.batch * seq * kv_heads * head_dim * esize
        pairs = case.batch * (case.q_len * case.context + case.q_len * (case.q_len + 1) // 2)
        flops = 4 * heads * head_dim * pairs
        # One cache per case, shared by the backends (flash_attn reads it in 256-token blocks).
        q, k, v, views = make_inputs(case, heads, kv_heads, head_dim, args.block_size, dtype, device,
                                     sorted({block_size_of(name, args.block_size) for name in names}))
        try:
            calls = [make_call(name, q, k, v, *views[block_size_of(name, args.block_size)], heads, kv_heads,
                               head_dim, dtype, device) for name in names]
        except UnavailableError as exc:  # triton without its package; flash_attn was checked above
            sys.exit(f"error: {exc}")
        with torch.inference_mode():
            for call in calls:
                call()  # warm-up (and, for triton, compilation)
            times = time_all(calls, iters)
        base = times[names.index("naive")] if "naive" in names else None
        for backend_name, seconds in zip(names, times):
            speedup = f"{base / seconds:8.2f}" if base else f"{'':8s}"
            tflops = f"{flops / seconds / 1e12:8.3f}" if case.kind == "prefill" else f"{'':8s}"
            print(f"{case.label:32s} {backend_name:12s} {seconds * 1e3:9.3f} {speedup} "
                  f"{kv_bytes / seconds / 1e9:8.2f} {100 * kv_bytes / seconds / bandwidth:6.1f}% {tflops}", flush=True)
        del calls, call, q, k, v, views  # before the next case's cache is made


def block_size_of(name: str, block_size: int) -> int:
    return 256 if name == "flash_attn" else block_size  # flash-attn 2's paged KV cache needs 256


def make_call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
              meta: AttentionMetadata, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device):
    """One layer's forward of backend ``name`` on the case's inputs (each call writes the same K/V to
    the same slots, so the backends can share them)."""
    backend = BACKENDS.create(name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                              scale=head_dim ** -0.5, block_size=meta.block_size, dtype=dtype, device=device)
    with torch.inference_mode():
        step_meta = backend.build_metadata(meta)

    def call():  # as the model calls it: each backend allocates its output (flash-attn cannot write into one)
        backend.forward(q, k, v, cache, step_meta)

    return call


if __name__ == "__main__":
    main()
