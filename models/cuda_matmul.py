"""Decode's skinny matrix products (up to 128 rows) by a split-K Triton kernel, where it beats torch's.

At 32 rows a decode step's products read every weight once and are bound by memory; cuBLAS leaves part of
the bandwidth unused there (docs/performance.md). ``tune`` times torch's product against ``CANDIDATES`` for
each bias-free linear layer's weight shape and each row bucket (16, 32, 64, 128) on the device, in CUDA
graphs, and makes each layer run the fastest: a layer's choice per bucket is None (torch's) or a ``Config``.
A layer fed by SiLU-and-multiply can take that operator's input and apply it as it loads its rows.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

# Names, not the module: an interpreted copy of this one gets them from the interpreted copy of cuda_ops.
from models.cuda_ops import _EXACT, silu_and_mul, silu_mul

logger = logging.getLogger(__name__)

#: The most rows the kernel takes (one tile of rows per program).
MAX_ROWS = 128

# Triton's interpreter (the CPU tests) multiplies bfloat16 as raw integers: there the kernel multiplies in float32.
_INTERPRETED: bool = (bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs")
                      else os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_ps,
                   stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DIRECT: tl.constexpr, SERIAL: tl.constexpr, SWAP: tl.constexpr, GLU: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Program (n tile, split) multiplies x[:, ks] by w[ns, ks].T over its K range; GLU: x is silu(gate) * up
    of the input's halves [M, 2K]. DIRECT (one split) stores it in ``out``; else it stores float32 partials
    ``part[split]``, summed by ``_sum_splits_kernel`` or, SERIAL, by the tile's last program to finish
    (``lock[n_tile]`` counts them, and is left at 0 for the next product). SWAP computes the transposed tile,
    w by x.T, so the weight rows fill the tensor cores' larger dimension."""
    n_tile, split = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M).to(tl.int64)
    rn = (n_tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    # tl.zeros is jitted: see models/cuda_ops.py
    acc = tl.full((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < k_end)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        if GLU:
            x = silu_mul(x, tl.load(x_ptr + rm[:, None] * stride_xm + K + rk[None, :], mask=x_mask, other=0.0))
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < k_end),
                    other=0.0)
        if DOT_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if SWAP:
            acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if SWAP:  # acc[n, m]: stored through transposed offsets
        offs = rm[None, :] * stride_om + rn[:, None]
        mask = (rm[None, :] < M) & (rn[:, None] < N)
    else:
        offs = rm[:, None] * stride_om + rn[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
    if DIRECT:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * stride_ps + offs, acc, mask=mask)
        if SERIAL:
            splits = tl.num_programs(1)
            tl.debug_barrier()  # every thread's partial is stored before the count (acq_rel) says so
            if tl.atomic_add(lock_ptr + n_tile, 1) == splits - 1:
                # Summed in split order from float32 partials: the same bits whichever program is last.
                total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, splits):
                    total += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + n_tile, 0)


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
    swap: bool = False  # w by x.T: the weight tile as the tensor cores' M (64 or more rows)
    serial: bool = True  # splits summed by each tile's last program, not by a second kernel
    num_warps: int = 4
    num_stages: int = 4

    def __str__(self) -> str:
        swap = " swap" if self.swap else ""
        summed = "" if self.serial or self.splits == 1 else " +sum"
        return (f"n{self.block_n} k{self.block_k} split{self.splits}{summed}{swap} w{self.num_warps} "
                f"s{self.num_stages}")


#: What ``tune`` tries: tiles of 32-128 output columns and 128-256 of K, 1-8 K splits; and tiles of 64-128
#: weight rows as the product's first operand (Hopper's warpgroup products take 64 rows or more).
CANDIDATES = ([Config(n, k, s) for n, k, s in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8))]
              + [Config(n, k, s, swap=True) for n, k, s in itertools.product((64, 128), (128, 256), (1, 2, 4, 8))])


def splitk_linear(x: torch.Tensor, w: torch.Tensor, config: Config, glu: bool = False) -> torch.Tensor:
    """``x @ w.T`` (``x`` [M <= 128, K] with contiguous rows, ``w`` [N, K] contiguous) by the split-K kernel;
    ``glu``: ``silu_and_mul(x) @ w.T`` for ``x`` [M, 2K], bit for bit. Serial splits share one counter buffer
    per device: products on one stream at a time."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if x.shape[1] != (2 * k if glu else k):
        raise ValueError(f"x must be [M, {2 * k if glu else k}] for w {tuple(w.shape)}{' with glu' if glu else ''}: "
                         f"got {tuple(x.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    direct = splits == 1
    part = out if direct else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), splits)
    locks = _locks(x.device, grid[0]) if config.serial and not direct else out
    dot_fp32 = _INTERPRETED and x.dtype != torch.float32
    _splitk_kernel[grid](x, w, out, part, locks, m, n, k, k_per_split, x.stride(0), w.stride(0),
                         0 if direct else part.stride(0), n, BLOCK_M=rows_bucket(m),
                         BLOCK_N=config.block_n, BLOCK_K=config.block_k, DIRECT=direct, SERIAL=config.serial,
                         SWAP=config.swap, GLU=glu, DOT_FP32=dot_fp32,
                         PRECISION="ieee" if x.dtype == torch.float32 or dot_fp32 else "tf32",  # fp32 as torch's
                         num_warps=config.num_warps, num_stages=config.num_stages, **_EXACT)
    if not direct and not config.serial:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLITS=splits, BLOCK=block)
    return out


_LOCKS: dict[torch.device, list[torch.Tensor]] = {}


def _locks(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 counter per n tile, at least ``count``, that the kernel leaves zeroed. A larger buffer is
    added beside, never in place of, a smaller one: a captured CUDA graph keeps its address."""
    held = _LOCKS.setdefault(device, [])
    if not held or held[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K counters for {count} tiles were first asked for inside a CUDA graph "
                               "capture: run the product once before capturing")
        held.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return held[-1]


def rows_bucket(m: int) -> int:
    """The kernel's row tile for ``m`` rows: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(m))


def graph_seconds(fn: Callable[[], object], device: torch.device, reps: int = 20, rounds: int = 10) -> float:
    """Seconds per call of ``fn``, run ``reps`` times in one CUDA graph (as in a decode graph: no launch gaps;
    eagerly on a CPU)."""
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


@dataclass
class Choice:
    """The product of one weight shape at one row bucket: torch's time, and the fastest kernel config and its
    time (None when torch's is the fastest). For a layer fed by SiLU-and-multiply where the kernel is the
    fastest: that kernel's time applying the operator to its input, and the operator's own launch's."""

    n: int
    k: int
    bucket: int
    torch_seconds: float
    config: Config | None
    seconds: float
    fused_seconds: float | None = None
    silu_and_mul_seconds: float | None = None

    @property
    def fuses_silu_and_mul(self) -> bool:
        """Whether the kernel applying the operator beats the operator's launch then the kernel."""
        return self.fused_seconds is not None and self.fused_seconds < self.seconds + self.silu_and_mul_seconds

    def __str__(self) -> str:
        which = "torch" if self.config is None else f"triton {self.config}"
        fused = "" if self.fused_seconds is None else (
            f"; SiLU-and-multiply {'in' if self.fuses_silu_and_mul else 'not in'} it ({self.fused_seconds * 1e6:.1f} "
            f"us against {self.silu_and_mul_seconds * 1e6:.1f} us more)")
        return (f"[{self.n} x {self.k}] at <= {self.bucket} rows: {which} ({self.seconds * 1e6:.1f} us; torch "
                f"{self.torch_seconds * 1e6:.1f} us){fused}")


#: ``timer(x, w, config, glu=False)``: seconds per product of ``x`` by ``w.T``, torch's (config None) or the
#: kernel's; ``glu``: of ``silu_and_mul(x)`` (``x`` [M, 2K]), applied by the kernel as it loads ``x`` (config),
#: or the operator's own launch alone (config None).
Timer = Callable[..., float]


def time_product(x: torch.Tensor, w: torch.Tensor, config: Config | None, glu: bool = False) -> float:
    """``Timer`` by ``graph_seconds``."""
    if glu and config is None:
        act = x.new_empty(x.shape[0], x.shape[1] // 2)
        return graph_seconds(lambda: silu_and_mul(x, act), x.device)
    if config is None:
        return graph_seconds(lambda: F.linear(x, w), x.device)
    return graph_seconds(lambda: splitk_linear(x, w, config, glu=glu), x.device)


def tune(model: nn.Module, rows: list[int], candidates: list[Config] = CANDIDATES, timer: Timer = time_product,
         cache: Path | None = None) -> list[Choice]:
    """Time each bias-free ``nn.Linear`` weight shape of ``model`` at each row bucket of ``rows`` (at the bucket's
    largest row count there, up to ``MAX_ROWS``), torch's product against each candidate whose output matches
    it, and make those layers run the fastest at up to 128 rows (``forward``: torch's above, and for other rows).
    A layer with a ``silu_and_mul_forward`` attribute (a model's down projection, fed by that operator) gets one
    that applies the operator to its input in the kernel, where that is timed faster than the operator then
    the kernel.
    ``cache``: a JSON file of earlier choices on this device and software (read, then updated): those are not
    timed again."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and m.bias is None and m.weight.is_contiguous()]
    largest: dict[int, int] = {}
    for r in rows:
        if r <= MAX_ROWS:
            largest[rows_bucket(r)] = max(largest.get(rows_bucket(r), 0), r)
    known = _read_cache(cache)
    before = len(known)
    choices: dict[tuple[int, int, torch.dtype, bool], dict[int, Choice]] = {}
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for layer in layers:
        w = layer.weight.detach()
        fed = hasattr(layer, "silu_and_mul_forward")
        key = (w.shape[0], w.shape[1], w.dtype, fed)
        if key not in choices:
            choices[key] = {}
            for bucket, m in sorted(largest.items()):
                name = _cache_key(w, bucket, candidates) + (" | fed by silu_and_mul" if fed else "")
                if name not in known:
                    known[name] = asdict(fastest(w, m, candidates, timer, gen, fed))
                choices[key][bucket] = _choice(known[name])
        layer.matmul_configs = {bucket: choice.config for bucket, choice in choices[key].items()}
        layer.forward = MethodType(_tuned_forward, layer)
        if fed:
            layer.silu_and_mul_configs = {bucket: choice.config for bucket, choice in choices[key].items()
                                          if choice.fuses_silu_and_mul}
            layer.silu_and_mul_forward = MethodType(_tuned_silu_and_mul_forward, layer)
    if cache is not None and len(known) > before:
        _write_cache(cache, known)
    table = [choice for per_bucket in choices.values() for choice in per_bucket.values()]
    for choice in table:
        logger.info("decode matmul %s", choice)
    return table


#: Environment variable naming the folder of caches kept between runs (default ``~/.cache/servelab``).
CACHE_ENV = "SERVELAB_CACHE_DIR"


def cache_path() -> Path:
    """The file of ``tune``'s choices kept between runs: ``decode_matmul.json`` in ``$SERVELAB_CACHE_DIR`` or
    ``~/.cache/servelab`` (delete it to time again)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "servelab") / "decode_matmul.json"


def _cache_key(w: torch.Tensor, bucket: int, candidates: list[Config]) -> str:
    """What a choice depends on: the device, torch, Triton, the weight's shape and dtype, the rows, the candidates."""
    device = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else w.device.type
    tried = hashlib.sha1(repr(candidates).encode()).hexdigest()[:12]
    return (f"{device} | torch {torch.__version__} | triton {triton.__version__} | {str(w.dtype).removeprefix('torch.')} "
            f"[{w.shape[0]} x {w.shape[1]}] <= {bucket} rows | candidates {tried}")


def _choice(entry: dict) -> Choice:
    config = entry["config"]
    return Choice(**{**entry, "config": None if config is None else Config(**config)})


def _read_cache(path: Path | None) -> dict[str, dict]:
    if path is None or not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())
        for entry in entries.values():
            _choice(entry)  # a malformed entry fails here, not later
        return entries
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        logger.warning("decode matmul cache %s is unreadable (%s): timing again", path, exc)
        return {}


def _write_cache(path: Path, entries: dict[str, dict]) -> None:
    """Written whole to a temporary file, then renamed over ``path``: a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: the choices hold for this run
        logger.warning("decode matmul cache %s cannot be written (%s)", path, exc)


def fastest(w: torch.Tensor, m: int, candidates: list[Config], timer: Timer, gen: torch.Generator,
            fed_by_silu_and_mul: bool = False) -> Choice:
    """The fastest of torch's product and each candidate that matches it, on ``m`` random rows by ``w``; with
    ``fed_by_silu_and_mul`` and a kernel fastest, also that kernel applying the operator, and the operator."""
    x = torch.randn((m, w.shape[1]), generator=gen, device=w.device).to(w.dtype)
    want = F.linear(x, w).float()
    tolerance = 1e-4 if w.dtype == torch.float32 else 2e-2
    scale = want.abs().max().clamp_min(1e-30)
    baseline = timer(x, w, None)
    best: tuple[float, Config | None] = (baseline, None)
    for config in candidates:
        try:
            got = splitk_linear(x, w, config)
        except Exception as exc:  # a config this device cannot run (shared memory): left out
            logger.debug("decode matmul %s cannot run: %s", config, exc)
            continue
        if float((got.float() - want).abs().max() / scale) > tolerance:
            logger.warning("decode matmul %s disagrees with torch's product for [%d x %d]: left out", config,
                           *w.shape)
            continue
        seconds = timer(x, w, config)
        if seconds < best[0]:
            best = (seconds, config)
    choice = Choice(w.shape[0], w.shape[1], rows_bucket(m), baseline, best[1], best[0])
    if fed_by_silu_and_mul and choice.config is not None:
        gate_up = torch.randn((m, 2 * w.shape[1]), generator=gen, device=w.device).to(w.dtype)
        choice.fused_seconds = timer(gate_up, w, choice.config, True)
        choice.silu_and_mul_seconds = timer(gate_up, w, None, True)
    return choice


def _config_for(configs: dict[int, Config | None], x: torch.Tensor) -> Config | None:
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        return None
    return configs.get(rows_bucket(x.shape[0]))


def _tuned_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    config = _config_for(self.matmul_configs, x)
    return F.linear(x, self.weight) if config is None else splitk_linear(x, self.weight, config)


def _tuned_silu_and_mul_forward(self: nn.Linear, gate_up: torch.Tensor) -> torch.Tensor | None:
    """This layer of ``silu_and_mul(gate_up)`` in one launch where that was timed fastest for these rows; None
    elsewhere (the caller runs the operator, then the layer)."""
    config = _config_for(self.silu_and_mul_configs, gate_up)
    return None if config is None else splitk_linear(gate_up, self.weight, config, glu=True)
