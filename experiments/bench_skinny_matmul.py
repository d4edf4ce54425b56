"""Decode's matrix products at 32-128 rows: torch's (cuBLAS on a GPU) against a split-K Triton kernel.

In a batch-32 decode step of a 1.1B Llama on an H200 the matrix products take 0.84 of the graph replay's
1.29 ms, at about 2.5 TB/s (docs/performance.md): this measures whether a kernel of our own, split along K
so that enough programs stream the weights, moves them closer to the copy bandwidth. Each candidate runs
20 times back to back inside a CUDA graph (as in the decode graph: no launch gaps), its output checked
against a float64 product first. Prints one MATMUL line per shape and M, then the projected decode step.

    python experiments/bench_skinny_matmul.py                      # on a GPU (experiments/gpu_check.sh)
    TRITON_INTERPRET=1 python experiments/bench_skinny_matmul.py --device cpu --tiny   # a dry run
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import copy_bandwidth  # noqa: E402  (experiments/ is on sys.path)


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_os, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DIRECT: tl.constexpr):
    """Program (n tile, split) multiplies x[:, ks] by w[ns, ks].T over its K range; DIRECT (one split)
    stores the result in x's dtype, else float32 partials ``out[split]`` for ``_sum_splits_kernel``."""
    n_tile, split = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M).to(tl.int64)
    rn = (n_tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros is jitted: see models/cuda_ops.py
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < k_end),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < k_end),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if DIRECT:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Element block ``program_id``: the sum of the SPLITS float32 partials, in the output's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4

    def __str__(self) -> str:
        return f"n{self.block_n} k{self.block_k} split{self.splits} w{self.num_warps} s{self.num_stages}"


def splitk_linear(x: torch.Tensor, w: torch.Tensor, config: Config, out: torch.Tensor | None = None,
                  part: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` (``x`` [M, K], ``w`` [N, K], both contiguous) by the split-K kernel; ``out`` and ``part``
    (the float32 partials, [splits, M, N]) may be given to keep allocation out of a captured graph."""
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    k_per_split = triton.cdiv(triton.cdiv(k, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    direct = splits == 1
    if not direct and part is None:
        part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    target = out if direct else part
    grid = (triton.cdiv(n, config.block_n), splits)
    _splitk_kernel[grid](x, w, target, m, n, k, k_per_split, x.stride(0), w.stride(0),
                         0 if direct else part.stride(0), n, BLOCK_M=max(16, triton.next_power_of_2(m)),
                         BLOCK_N=config.block_n, BLOCK_K=config.block_k, DIRECT=direct,
                         num_warps=config.num_warps, num_stages=config.num_stages)
    if not direct:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLITS=splits, BLOCK=block)
    return out


def shapes(tiny: bool) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of the model gpu_e2e.py times (TinyLlama's 1.1B shape), or a tiny one."""
    if tiny:
        return {"qkv": (96, 64), "down": (64, 160)}
    hidden, inter, kv = 2048, 5632, 2 * 4 * 64
    return {"qkv": (hidden + kv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (32000, hidden)}


def configs(tiny: bool) -> list[Config]:
    if tiny:
        return [Config(32, 32, 1), Config(32, 32, 3), Config(64, 64, 2)]
    return [Config(n, k, s) for n, k, s in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8))]


def graph_seconds(fn, device: torch.device, reps: int = 20, rounds: int = 10) -> float:
    """Seconds per call of ``fn``, run ``reps`` times in one CUDA graph (eagerly on a CPU)."""
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        return (time.perf_counter() - start) / rounds
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (rounds * reps)


def max_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest error against the float64 product, in units of the largest output."""
    want = x.double() @ w.double().T
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and three configs (a dry run)")
    parser.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[32, 128],
                        help="the products' row counts (decode batch sizes), comma-separated")
    parser.add_argument("--layers", type=int, default=22, help="decoder layers, for the projected decode step")
    args = parser.parse_args(argv)
    if any(r < 1 for r in args.rows):
        parser.error(f"--rows must be positive, got {','.join(map(str, args.rows))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu --tiny")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on a CPU the kernels run under Triton's interpreter: set TRITON_INTERPRET=1")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 16)
    print(f"MATMUL {dtype}; copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    bad = 0
    for m in args.rows:
        totals = {"torch": 0.0, "triton": 0.0}
        for name, (n, k) in shapes(args.tiny).items():
            x = torch.randn((m, k), generator=gen, device=device).to(dtype)
            w = (torch.randn((n, k), generator=gen, device=device) / k ** 0.5).to(dtype)
            out = torch.empty((m, n), dtype=dtype, device=device)
            baseline = graph_seconds(lambda: torch.matmul(x, w.T, out=out), device)
            best: tuple[float, Config | None] = (float("inf"), None)
            skipped = 0
            for config in configs(args.tiny):
                part = torch.empty((config.splits, m, n), dtype=torch.float32, device=device)
                try:
                    err = max_error(splitk_linear(x, w, config, out, part), x, w)
                    if err > (2e-2 if dtype != torch.float32 else 1e-5):
                        bad += 1
                        print(f"MATMUL M={m} {name} {config}: WRONG, error {err:.2e}", flush=True)
                        continue
                    seconds = graph_seconds(lambda: splitk_linear(x, w, config, out, part), device)
                except Exception:  # a config the card cannot run (too much shared memory) is left out
                    skipped += 1
                    continue
                best = min(best, (seconds, config), key=lambda b: b[0])
            weight_bytes = n * k * dtype.itemsize
            times = {"torch": baseline, "triton": best[0]}
            count = 1 if name == "lm_head" else args.layers
            for key in totals:
                totals[key] += count * times[key]
            print(f"MATMUL M={m:<4d} {name:8s} N={n:<6d} K={k:<5d} torch {baseline * 1e6:8.2f} us "
                  f"({weight_bytes / baseline / bandwidth:4.0%} of copy bandwidth); triton {best[0] * 1e6:8.2f} us "
                  f"({weight_bytes / best[0] / bandwidth:4.0%}) with {best[1]}; triton/torch "
                  f"{best[0] / baseline:.2f}{f'; {skipped} configs could not run' if skipped else ''}", flush=True)
        print(f"MATMUL M={m}: a decode step's products ({args.layers} layers and the LM head) torch "
              f"{totals['torch'] * 1e3:.3f} ms, best triton per shape {totals['triton'] * 1e3:.3f} ms", flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
