"""``python -m framework.profile``: measure the real executor, fit the cost model, write a YAML.

Runs the ``model`` executor on the device at hand through a grid of cells (``m`` requests of ``L``-token
prompts, prefilled, then decoded a few steps), times every whole engine step with its ``BatchShape``, keeps
each distinct shape's median over ``--repeats`` (``--statistic min``: its fastest), fits the cost model's
parameters to them and writes the YAML that ``cost_model.calibration=FILE`` loads::

    python -m framework.profile --model tiny-llama --hardware cpu --out calibration/cpu-tiny-llama.yaml
    python -m framework.profile --hardware h100-sxm --model /path/to/checkpoint --grid large
"""
from __future__ import annotations

import argparse
import datetime
import logging
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from framework.common.config import EngineConfig, check_writable_file
from framework.common.registry import UnavailableError
from framework.sim.cost_model import COST_MODELS, BatchShape, CostModel, model_shape
from framework.sim.hardware import load_hardware

logger = logging.getLogger(__name__)

#: (prompt lengths, request counts, decode steps, most prompt tokens per cell). A dozen decode steps per
#: cell, as the first after a prefill runs slower (cold caches). Counts are dense at small batches, the knots
#: of the roofline's small-GEMM curve, where step time is not monotone (on a CPU, 3 requests can be slower
#: than 4); the extra counts take 50% longer to profile and cut the error on held-out steps by about a third.
GRIDS: dict[str, tuple[list[int], list[int], int, int]] = {
    "quick": ([16, 96], [1, 4], 2, 512),
    "default": ([16, 64, 128, 256, 512], [1, 2, 3, 4, 6, 8, 12, 16, 32], 12, 4096),
    "large": ([16, 64, 256, 1024, 4096], [1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256], 12, 65536),
}


def grid_cells(name: str, lengths: list[int] | None = None, counts: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(requests, prompt length, decode steps) of every cell of grid ``name``, its prompt
    lengths and request counts optionally replaced (calibrate over the regime to simulate)."""
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r}; grids: {', '.join(GRIDS)}")
    grid_lengths, grid_counts, decode, budget = GRIDS[name]
    lengths, counts = lengths or grid_lengths, counts or grid_counts
    if min(lengths) < 1 or min(counts) < 1:
        raise ValueError("prompt lengths and request counts must be >= 1")
    cells = [(m, length, decode) for length in lengths for m in counts if m * length <= max(budget, length)]
    if not cells:  # else the engine's sizing would fail on "max() arg is an empty sequence"
        raise ValueError(f"no cell of grid {name!r} fits its budget of {budget} prompt tokens (requests x prompt "
                         f"length, or one prompt): lower --counts (now {counts})")
    return cells


#: How a shape's repeats become one sample: ``median`` is robust to a disturbed repeat; ``min`` keeps the
#: least disturbed one, for grids disturbed more than the steps they predict (sim_fidelity interleaves
#: the cells with a real run, whose engine leaves the caches full).
STATISTICS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


def _statistic(name: str) -> Callable[[list[float]], float]:
    if name not in STATISTICS:
        raise ValueError(f"unknown statistic {name!r}; statistics: {', '.join(STATISTICS)}")
    return STATISTICS[name]


def record_shapes(engine: Any) -> list[BatchShape]:
    """A list that gets the ``BatchShape`` of every step ``engine``'s executor runs, read as the
    step starts (``del engine.executor.execute`` stops it)."""
    shapes: list[BatchShape] = []
    execute = engine.executor.execute

    def recording_execute(out):
        shapes.append(BatchShape.from_scheduler_output(out))
        return execute(out)

    engine.executor.execute = recording_execute
    return shapes


class Profiler:
    """Times engine steps of chosen compositions on a model-executor ``LLMEngine`` (prefix cache
    off, so every prompt computes), keeping every duration per distinct ``BatchShape``."""

    def __init__(self, engine: Any, seed: int = 0, timer: Callable[[], float] = time.perf_counter) -> None:
        if getattr(engine, "async_scheduling", False):
            # Its steps run through launch and collect, overlapping the next step's host side: no step's own time.
            raise ValueError("profile an engine with async_scheduling=false (profile_engine_config's): a cost model "
                             "times each step's host side and forward pass one after the other")
        self.engine = engine
        self.timer = timer
        self.rng = random.Random(seed)
        self.seconds: dict[tuple, list[float]] = defaultdict(list)
        self._shapes = record_shapes(engine)
        self._cells = 0

    def close(self) -> None:
        del self.engine.executor.execute

    def run_cell(self, m: int, length: int, decode: int, record: bool = True) -> None:
        """``m`` requests of ``length``-token prompts, prefilled then decoded ``decode`` steps."""
        from framework.common.sampling_params import SamplingParams

        engine, vocab = self.engine, self.engine.model_config.vocab_size
        params = SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)
        self._cells += 1
        for i in range(m):
            engine.add_request(f"profile-{self._cells}-{i}", [self.rng.randrange(3, vocab) for _ in range(length)], params)
        while engine.has_unfinished_requests():
            before = len(self._shapes)
            t0 = self.timer()
            # final_only, as an experiment's runs step: a step then pays for no output of the
            # requests still running, and a calibration should not fit costs the runs never pay.
            engine.step(final_only=True)
            dt = self.timer() - t0
            if record and len(self._shapes) > before:
                self.seconds[tuple(self._shapes[-1].to_list())].append(dt)

    def samples(self, statistic: str = "median") -> list[tuple[BatchShape, float]]:
        """Seconds of every distinct shape measured: the ``statistic`` (one of ``STATISTICS``)
        of its repeats."""
        reduce = _statistic(statistic)
        return [(BatchShape.from_list(list(key)), reduce(v)) for key, v in self.seconds.items()]


def measure(engine: Any, cells: list[tuple[int, int, int]], repeats: int, seed: int = 0,
            timer: Callable[[], float] = time.perf_counter, statistic: str = "median") -> list[tuple[BatchShape, float]]:
    """Seconds per distinct step shape (the ``statistic`` of its repeats) over ``repeats`` passes of ``cells``,
    after an unrecorded warm-up pass, on ``engine`` (a model-executor ``LLMEngine``, prefix cache off), timed
    by ``timer`` (``time.process_time`` ignores other processes on a shared machine if torch runs one thread)."""
    _statistic(statistic)  # before the grid runs
    profiler = Profiler(engine, seed, timer)
    try:
        for rep in range(repeats + 1):
            for cell in cells:
                profiler.run_cell(*cell, record=rep > 0)
    finally:
        profiler.close()
    return profiler.samples(statistic)


def profile_engine_config(cells: list[tuple[int, int, int]], model: str = "tiny-llama", **kw: Any) -> EngineConfig:
    """The ``EngineConfig`` of a profiling engine big enough for ``cells`` (no prefix caching, synchronous steps:
    a cost model times a step's host side and forward pass one after the other, as ``record_shapes`` sees them)."""
    max_len = max(length for _, length, _ in cells) + max(d for _, _, d in cells) + 2
    return EngineConfig(model=model, executor="model", max_num_seqs=max(m for m, _, _ in cells),
                        max_num_batched_tokens=max(2048, max_len), max_model_len=max_len,
                        enable_prefix_caching=False, async_scheduling=False, **kw)


def calibration_record(cost_model: str, model: str, hardware: Any, dtype_bytes: int, block_size: int,
                       params: dict[str, Any], fit: dict[str, float], samples: list[tuple[BatchShape, float]],
                       measured: dict[str, Any] | None = None, model_config: Any = None,
                       dtype: str | None = None) -> dict[str, Any]:
    """What a calibration YAML holds (``cost_model.calibration`` loads its ``params``). With
    ``model_config``, the measured model's shape too (``model_shape``: a simulation of another
    model is warned that the fit may not carry over); with ``dtype``, the dtype measured (a
    simulation in another one, even of the same width, is warned about)."""
    measured_model = {"model_shape": model_shape(model_config)} if model_config is not None else {}
    measured_dtype = {"dtype": dtype} if dtype is not None else {}
    return {"cost_model": cost_model, "model": model, **measured_model, "hardware": hardware.to_dict(),
            **measured_dtype, "dtype_bytes": dtype_bytes,
            "tensor_parallel_size": 1, "block_size": block_size, "params": params, "fit": fit,
            "measured": measured or {}, "samples": {"fields": BatchShape.field_names() + ["seconds"],
                        "rows": [shape.to_list() + [t] for shape, t in samples]}}


def calibratable(cls: type[CostModel]) -> bool:
    """Whether cost model ``cls`` has parameters to fit: it overrides ``CostModel.calibrate``."""
    return getattr(cls.calibrate, "__func__", None) is not CostModel.calibrate.__func__


def calibratable_cost_models() -> list[str]:
    """The registered cost models that ``calibratable`` (a plugin that fails to load is left out:
    one that cannot be imported, names no cost model class or declares a taken name)."""
    names = []
    for name in COST_MODELS.list():
        try:
            if calibratable(COST_MODELS.get(name)):
                names.append(name)
        except (ImportError, ValueError, UnavailableError):  # the registry's refusals; the name was not asked for
            pass
    return names


def _ints(text: str) -> list[int]:
    """A comma-separated list of integers (argparse type): an empty one is an error, where it
    would silently mean the grid's defaults."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,2,4; got {text!r}")
    return values


def relative_errors(model: Any, samples: list[tuple[BatchShape, float]]) -> list[float]:
    return [abs(model.step_time(shape) - t) / t for shape, t in samples]


def calibrate(samples: list[tuple[BatchShape, float]], model_config: Any, hardware: Any, dtype_bytes: int,
              cost_model: str = "roofline", block_size: int = 16,
              dtype: str | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Fitted parameters (numbers, and the roofline's ``extra_weight_passes`` curve, a dict) and
    the fit's relative errors on ``samples``. ``dtype`` (default: the one ``dtype_bytes`` means)
    picks the peak FLOP/s the efficiencies are fractions of."""
    cls = COST_MODELS.get(cost_model)
    params = cls.calibrate(samples, model_config, hardware, dtype_bytes, 1, block_size, dtype=dtype)
    fitted = cls(model_config, hardware, dtype_bytes, 1, block_size, dtype=dtype, **params)
    errors = sorted(relative_errors(fitted, samples))
    return params, {"samples": len(samples), "median_abs_rel_error": statistics.median(errors),
                    "p90_abs_rel_error": errors[int(0.9 * (len(errors) - 1))], "max_abs_rel_error": errors[-1]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m framework.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="preset or Hugging Face checkpoint directory")
    ap.add_argument("--hardware", default=None,
                    help="conf/hardware preset or YAML the fit is relative to (default: cpu when running on a CPU)")
    ap.add_argument("--cost-model", default="roofline")
    ap.add_argument("--out", default="calibration.yaml")
    ap.add_argument("--grid", default="default", choices=sorted(GRIDS))
    ap.add_argument("--lengths", type=_ints, default=None, help="prompt lengths, e.g. 16,64,256 (default: the grid's)")
    ap.add_argument("--counts", type=_ints, default=None, help="requests per cell, e.g. 1,2,4,8 (default: the grid's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    # The engine's own defaults: a calibration describes the configuration it will simulate.
    ap.add_argument("--backend", default=EngineConfig.backend, help="attention backend (default: %(default)s)")
    ap.add_argument("--preparer", default=EngineConfig.preparer, help="input preparer (default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time steps by the wall clock, or by process CPU time (a machine shared with other "
                         "work; use with --threads 1)")
    ap.add_argument("--statistic", choices=sorted(STATISTICS), default="median",
                    help="what a shape's repeats reduce to: their median, or the fastest (least disturbed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    from framework.engine.llm_engine import LLMEngine

    # Everything a bad argument can break is built before the measurement starts, and reported as
    # a usage error (status 2), not a traceback.
    try:
        if not calibratable(COST_MODELS.get(args.cost_model)):  # else it would fail after the whole grid
            raise ValueError(f"cost model {args.cost_model!r} has no parameters to calibrate; calibratable: "
                             f"{', '.join(calibratable_cost_models())}")
        check_writable_file("--out", args.out)
        hardware = load_hardware(args.hardware) if args.hardware is not None else None
        cells = grid_cells(args.grid, args.lengths, args.counts)
        engine = LLMEngine(profile_engine_config(cells, args.model, backend=args.backend, preparer=args.preparer,
                                                 device=args.device, dtype=args.dtype, block_size=args.block_size,
                                                 num_threads=args.threads, seed=args.seed))
    except (ValueError, UnavailableError) as exc:
        ap.error(str(exc))
    if hardware is None:
        if engine.executor.device != "cpu":
            ap.error(f"measuring on {engine.executor.device}: name its hardware description with --hardware "
                     f"(presets: a100-80gb, h100-sxm, h200, l40s, or a YAML path)")
        hardware = load_hardware("cpu")
    # The fit is relative to the named device's figures and labelled with its name: a CPU's steps
    # fitted against an H100's peaks would load without a word into an H100 simulation.
    measured_on = engine.executor.device.split(":")[0]
    if measured_on in ("cpu", "cuda") and hardware.device_type != measured_on:
        ap.error(f"measuring on {engine.executor.device}, but hardware {hardware.name!r} describes a "
                 f"{hardware.device_type} device: name the device measured (presets: "
                 f"{'cpu' if measured_on == 'cpu' else 'a100-80gb, h100-sxm, h200, l40s'}, or a YAML with "
                 f"device_type: {measured_on})")
    dtype_bytes = engine.executor.dtype.itemsize
    dtype = str(engine.executor.dtype).removeprefix("torch.")
    try:  # the device must list a peak for the dtype measured, else the fit would fail after the grid
        hardware.peak_flops(dtype)
    except ValueError as exc:
        ap.error(str(exc))
    started = time.perf_counter()
    samples = measure(engine, cells, args.repeats, args.seed,
                      time.process_time if args.clock == "cpu" else time.perf_counter, args.statistic)
    measured_s = time.perf_counter() - started
    started = time.perf_counter()
    try:
        params, fit = calibrate(samples, engine.model_config, hardware, dtype_bytes, args.cost_model, args.block_size,
                                dtype)
    except ValueError as exc:  # a grid too small to fit (too few distinct step shapes): not a traceback
        ap.error(f"{exc} (the grid measured {len(samples)} distinct step shapes; add --lengths or --counts)")
    fit["fit_seconds"] = time.perf_counter() - started
    import torch

    measured = {"device": engine.executor.device, "backend": args.backend, "preparer": args.preparer,
                "torch": str(torch.__version__), "threads": torch.get_num_threads(), "grid": args.grid,
                "repeats": args.repeats, "statistic": args.statistic, "clock": args.clock, "cells": [list(c) for c in cells],
                "seconds": round(measured_s, 1), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    result = calibration_record(args.cost_model, args.model, hardware, dtype_bytes, args.block_size, params, fit,
                                samples, measured, engine.model_config, dtype)
    import yaml

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        yaml.safe_dump(result, f, sort_keys=False, default_flow_style=None, width=120)
    print(f"measured {len(samples)} step shapes in {measured_s:.1f}s; fitted {args.cost_model} in "
          f"{fit['fit_seconds'] * 1000:.0f} ms: median |error| {fit['median_abs_rel_error']:.1%}, "
          f"p90 {fit['p90_abs_rel_error']:.1%}")
    for name, value in params.items():
        shown = "  ".join(f"{k}: {v:.3g}" for k, v in value.items()) if isinstance(value, dict) else f"{value:.4g}"
        print(f"  {name:24s} {shown}")
    print(f"wrote {out}")
    return result

