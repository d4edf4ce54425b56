"""Decode's matrix products at 32-128 rows: torch's (cuBLAS on a GPU, and cuBLASLt) against a split-K Triton kernel.

In a batch-32 decode step of a 1.1B Llama on an H200 the matrix products take 0.84 of the graph replay's
1.29 ms, at about 2.5 TB/s (docs/performance.md): this measures whether a kernel of our own, split along K
so that enough programs stream the weights (``models/cuda_matmul.py``, which ``executor.decode_matmul=tuned``
picks per shape at start-up), moves them closer to the copy bandwidth. Each candidate runs
20 times back to back inside a CUDA graph (as in the decode graph: no launch gaps), after its output is checked
against torch's (``models.cuda_matmul.fastest``, what ``decode_matmul=tuned`` runs); the fastest is checked against
a float64 product too, and, where it splits K, timed with its splits summed by a second kernel rather than by
each tile's last program; the down projection's also applying SiLU-and-multiply to its input, as
``decode_matmul=tuned`` times it. Prints one MATMUL line per shape and M, then the projected decode step.

    python experiments/bench_skinny_matmul.py                      # on a GPU (experiments/gpu_check.sh)
    TRITON_INTERPRET=1 python experiments/bench_skinny_matmul.py --device cpu --tiny   # a dry run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.bench_attention import copy_bandwidth  # noqa: E402
from models.cuda_matmul import CANDIDATES, Config, fastest, graph_seconds, splitk_linear, time_product  # noqa: E402


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
    return CANDIDATES


def cublaslt_seconds(fn, device: torch.device) -> float | None:
    """``graph_seconds`` with cuBLASLt as torch's BLAS library (None on a CPU or where it cannot run)."""
    if device.type != "cuda":
        return None
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        return graph_seconds(fn, device)
    except Exception:  # a build without it: the figure is left out
        return None
    finally:
        torch.backends.cuda.preferred_blas_library(before)


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
        totals = {"torch": 0.0, "triton": 0.0, "cublaslt": 0.0}
        for name, (n, k) in shapes(args.tiny).items():
            w = (torch.randn((n, k), generator=gen, device=device) / k ** 0.5).to(dtype)
            # Every candidate checked against torch's product, then timed, as decode_matmul=tuned does.
            timed: dict[Config | None, float] = {}

            def timer(x: torch.Tensor, w: torch.Tensor, config: Config | None) -> float:
                timed[config] = time_product(x, w, config)
                return timed[config]

            fastest(w, m, configs(args.tiny), timer, gen)
            baseline = timed.pop(None)
            best = min(((t, c) for c, t in timed.items()), key=lambda b: b[0], default=(float("inf"), None))
            x = torch.randn((m, k), generator=gen, device=device).to(dtype)
            lt = cublaslt_seconds(lambda: torch.matmul(x, w.T), device)
            summed = ""
            if best[1] is not None and name == "down":  # as tune times a layer fed by SiLU-and-multiply
                gate_up = torch.randn((m, 2 * k), generator=gen, device=device).to(dtype)
                fused, alone = time_product(gate_up, w, best[1], True), time_product(gate_up, w, None, True)
                summed = (f", {fused * 1e6:.2f} us applying SiLU-and-multiply to its input (that operator's own "
                          f"launch: {alone * 1e6:.2f} us)")
            if best[1] is not None and best[1].splits > 1:  # the same tiles, the splits summed by a second kernel
                two = time_product(x, w, dataclasses.replace(best[1], serial=False))
                summed += f", {two * 1e6:.2f} us with a second kernel summing the splits"
            if best[1] is not None:
                err = max_error(splitk_linear(x, w, best[1]), x, w)
                if err > (2e-2 if dtype != torch.float32 else 1e-5):
                    bad += 1
                    print(f"MATMUL M={m} {name} {best[1]}: WRONG, error {err:.2e}", flush=True)
            weight_bytes = n * k * dtype.itemsize
            times = {"torch": baseline, "triton": best[0], "cublaslt": baseline if lt is None else lt}
            count = 1 if name == "lm_head" else args.layers
            for key in totals:
                totals[key] += count * times[key]
            lt_text = "n/a" if lt is None else f"{lt * 1e6:.2f} us ({weight_bytes / lt / bandwidth:.0%})"
            print(f"MATMUL M={m:<4d} {name:8s} N={n:<6d} K={k:<5d} torch {baseline * 1e6:8.2f} us "
                  f"({weight_bytes / baseline / bandwidth:4.0%} of copy bandwidth); cuBLASLt {lt_text}; "
                  f"triton {best[0] * 1e6:8.2f} us "
                  f"({weight_bytes / best[0] / bandwidth:4.0%}) with {best[1]}{summed}; triton/torch "
                  f"{best[0] / baseline:.2f}", flush=True)
        lt_total = "n/a" if lt is None else f"{totals['cublaslt'] * 1e3:.3f} ms"
        print(f"MATMUL M={m}: a decode step's products ({args.layers} layers and the LM head) torch "
              f"{totals['torch'] * 1e3:.3f} ms, cuBLASLt {lt_total}, best triton per shape "
              f"{totals['triton'] * 1e3:.3f} ms", flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
