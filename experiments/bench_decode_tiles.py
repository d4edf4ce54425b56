"""The triton backend's decode launch over its shapes: one layer's attention of a decode-only batch (with key
splits, their combine too) for key-tile sizes x split counts x warps, against the plan a CUDA graph of the engine
captures for that batch (``decode_plan`` at the smallest of ``decode_bounds`` that holds the context).

Prints a ``TILES`` line per context and variant: the median time (on a GPU of a CUDA graph's replay, by CUDA events:
a launch from Python takes longer than the kernel; ``perf_counter`` on a CPU; the caches flushed before each call,
the variants taking turns), the share of the copy bandwidth that reading the
batch's K and V once would take, the ratio to the engine's plan, and the largest difference from its output.

    python experiments/bench_decode_tiles.py     # GPU defaults: TinyLlama's heads (32/4 of 64), batch 32

On a CPU the kernel runs through Triton's interpreter: for correctness (every variant's output), not speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from experiments.bench_attention import Case, check_minimums, copy_bandwidth, make_inputs, timer  # noqa: E402
from framework.common.config import DTYPE_ALIASES  # noqa: E402
from framework.execution.executors.model import resolve_device, resolve_dtype  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=sorted({"auto", *DTYPE_ALIASES}),
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--contexts", type=ints, default=[384, 1023, 2000], help="cached tokens per request")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048, help="the engine's, which sets its graphs' bounds")
    p.add_argument("--block-ns", type=ints, default=[64, 128, 256], help="key-tile sizes (powers of two, >= 16)")
    p.add_argument("--splits", type=ints, default=[1, 2, 4], help="key ranges per request (1-16)")
    p.add_argument("--warps", type=ints, default=[4, 8], help="warps per program (powers of two)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per variant (default 50 CUDA, 3 CPU)")
    p.add_argument("--flush-mb", type=int, default=None, help="default 256 on CUDA, 0 on CPU")
    args = p.parse_args(argv)
    check_minimums(p, args, {**dict.fromkeys(("batch", "heads", "kv_heads", "head_dim", "block_size", "max_model_len",
                                              "iters"), 1), "flush_mb": 0})
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    for name, values, ok, valid in (
            ("block-size", [args.block_size], pow2, "a power of two"),
            ("contexts", args.contexts, lambda n: 0 <= n < args.max_model_len, f"in [0, --max-model-len)"),
            ("block-ns", args.block_ns, lambda n: pow2(n) and n >= 16, "powers of two, at least 16"),
            ("splits", args.splits, lambda n: 1 <= n <= 16, "in 1-16"),
            ("warps", args.warps, lambda n: pow2(n) and n <= 32, "powers of two up to 32")):
        bad = [n for n in values if not ok(n)]
        if bad:
            p.error(f"--{name} must be {valid}, got {','.join(map(str, bad))}")

    from backends.triton_paged import load_kernels

    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    dtype = resolve_dtype(args.dtype, None, device)
    kernels = load_kernels(device)
    iters = args.iters if args.iters is not None else (50 if gpu else 3)
    time_all = timer(device, args.flush_mb if args.flush_mb is not None else (256 if gpu else 0))
    bandwidth = copy_bandwidth(device, 1024 if gpu else 64)
    heads, kv_heads, head_dim, n = args.heads, args.kv_heads, args.head_dim, args.batch
    print(f"TILES device {torch.cuda.get_device_name(device) if gpu else 'CPU'}; {dtype}; batch {n}, heads "
          f"{heads}/{kv_heads} of {head_dim}, block_size {args.block_size}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    for context in args.contexts:
        seq = context + 1
        q, _, _, views = make_inputs(Case("decode", n, context, 1), heads, kv_heads, head_dim, args.block_size, dtype,
                                     device, [args.block_size])
        cache, meta = views[args.block_size]
        bounds = kernels.decode_bounds(n, heads, kv_heads, head_dim, args.max_model_len, device)
        bound = min(b for b in bounds if b >= seq)
        engine = kernels.decode_plan(meta.seq_lens[:n], heads, kv_heads, head_dim, bound)
        plans = [engine] + [_variant(engine, block_n, splits, warps, q)
                            for block_n in args.block_ns for splits in args.splits for warps in args.warps
                            if (block_n, splits, warps) != (engine.block_n, engine.num_splits, engine.num_warps)]
        outs = [torch.empty_like(q) for _ in plans]
        calls = [functools.partial(kernels.paged_attention, out, q, cache[0], cache[1], meta.block_table,
                                   head_dim ** -0.5, plan) for out, plan in zip(outs, plans)]
        with torch.inference_mode():
            for call in calls:
                call()  # compiles each variant
            if gpu:
                calls = [_graphed(call) for call in calls]
            times = time_all(calls, iters)
        kv_bytes = 2 * n * seq * kv_heads * head_dim * dtype.itemsize
        for i, (plan, seconds, out) in enumerate(zip(plans, times, outs)):
            label = "engine's plan" if i == 0 else "variant"
            diff = (out.float() - outs[0].float()).abs().max().item()
            print(f"TILES B={n} ctx={context} (bound {bound}) {label:13s} block_n={plan.block_n:<4d} "
                  f"splits={plan.num_splits:<2d} warps={plan.num_warps}: {seconds * 1e6:9.1f} us "
                  f"({100 * kv_bytes / seconds / bandwidth:5.1f}% of copy) {seconds / times[0]:5.2f}x the plan's; "
                  f"max |diff| {diff:.2e}", flush=True)
        best = min(range(len(plans)), key=times.__getitem__)
        print(f"TILES B={n} ctx={context}: fastest block_n={plans[best].block_n} splits={plans[best].num_splits} "
              f"warps={plans[best].num_warps}, {times[0] / times[best]:.2f}x the engine's plan", flush=True)
        del q, cache, meta, views, outs, calls  # before the next context's cache is made


def _variant(plan, block_n: int, splits: int, warps: int, q: torch.Tensor):
    """``plan`` with other tiles, splits (and their float32 workspaces) and warps."""
    part = lse = None
    if splits > 1:
        part = torch.empty((splits, *q.shape), dtype=torch.float32, device=q.device)
        lse = torch.empty((splits, *q.shape[:2]), dtype=torch.float32, device=q.device)
    return dataclasses.replace(plan, block_n=block_n, num_splits=splits, num_warps=warps, part=part, lse=lse)


def _graphed(call):
    """``call`` captured once in a CUDA graph: its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


if __name__ == "__main__":
    main()
