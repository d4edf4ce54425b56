"""Fidelity of the simulator on this CPU: calibrate on a tiny model (``--model``, default
``tiny-llama``), then serve a held-out workload for real and in simulation and compare.

    python experiments/sim_fidelity.py --repeats 3                  # calibration interleaved with the real run
    python experiments/sim_fidelity.py --repeats 3 --model small-llama   # twice the width: steadier step times
    python experiments/sim_fidelity.py --calibration cal.yaml       # a calibration from python -m framework.profile

Per repeat: one real run (the ``model`` executor, one torch thread) and one simulated run (the
``sim`` executor on the ``cpu`` hardware with the calibration) of the same Poisson chat workload,
which differs from the profile grid (random lengths, arrivals, prefix hits, queueing). Reported:

- step times: the calibrated cost model's prediction for every real step's exact batch shape
  against the step's measured duration (median and p90 of |pred/measured - 1|);
- TTFT and TPOT p50 (and p90) of the simulated run against the real one;
- the machine's noise floor for the first figure: real steps grouped by shape (decode rows,
  prefill rows, and tokens and context in 16-token bins, groups of 5 or more), the median of
  |measured/group median - 1|. No cost model of the batch shape can predict steps more closely
  than their own group's median does.

Real runs are timed by process CPU time (``framework.common.clock.CPUClock``), which leaves out the time
other processes hold the cores on a shared machine; ``--clock wall`` uses the wall clock. On a
shared machine the speed also drifts by tens of percent over minutes, so by default the profile
grid's cells run *between* the real run's steps (its clock paused meanwhile): calibration and
measurement then see the same machine. ``--calibration FILE`` uses a finished calibration instead.
``--statistic min`` fits the grid shapes' fastest repeats instead of their medians: a cell always
starts right after real steps of another engine (the real step right after a cell runs ~20% slower
than its neighbours, and so do the cell's first steps), so the fastest repeat is the one closest
to the steady steps the workload is mostly made of.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from framework.common.clock import CPUClock, WallClock
from framework.harness.cluster import Cluster
from framework.common.config import EngineConfig, check_writable_file
from framework.sim.cost_model import BatchShape
from framework.engine.llm_engine import LLMEngine
from framework.sim.hardware import load_hardware
from framework.sim.profile import (STATISTICS, Profiler, calibrate, calibration_record, grid_cells,
                               profile_engine_config, record_shapes)
from framework.harness.workload import WorkloadContext, WorkloadRequest
from framework.harness.workloads.synthetic import SyntheticWorkload
from models.presets import SHAPE_ONLY_PRESETS

#: The profile grid covers the regime the workload runs in: batches of 1-16, prompts up to 320.
LENGTHS, COUNTS = [16, 48, 96, 192, 320], [1, 2, 3, 4, 6, 8, 12, 16]


def workload(seed: int, vocab_size: int = 1024) -> list[WorkloadRequest]:
    """A chat mix (``conf/workload/chat.yaml``'s shape) scaled to the tiny model: prompts of 4-272
    tokens after one of 4 system prompts of 48, outputs of 4-96, Poisson at 5 req/s."""
    chat = SyntheticWorkload(num_requests=60, rate=5.0, seed=seed,
                             prompt_len={"dist": "lognormal", "mean": 80, "std": 60, "min": 4, "max": 272},
                             output_len={"dist": "lognormal", "mean": 36, "std": 20, "min": 4, "max": 96},
                             shared_prefix={"fraction": 0.8, "num_prefixes": 4, "prefix_len": 48})
    return chat.generate(WorkloadContext(vocab_size=vocab_size))


def engine_config(executor: str, model: str = "tiny-llama", **options) -> EngineConfig:
    # Synchronous steps on both sides: the cost models time a step's host side and forward pass one after
    # the other, and async scheduling (on by default on CUDA) would overlap them in the real engine only.
    return EngineConfig(model=model, executor=executor, executor_options=options, max_model_len=512,
                        max_num_seqs=32, max_num_batched_tokens=1024, num_threads=1 if executor == "model" else None,
                        async_scheduling=False)


class PausableCPUClock(CPUClock):
    def pause(self) -> None:
        self._paused_at = time.process_time()

    def resume(self) -> None:
        self._skipped -= time.process_time() - self._paused_at


def serve(engine: LLMEngine, seed: int, between_steps=None) -> tuple[dict, list[tuple[BatchShape, float]]]:
    """Serve the workload; for the model executor also record (shape, measured seconds) per step
    and call ``between_steps()`` after every step."""
    steps: list[tuple[BatchShape, float]] = []
    if engine.config.executor == "model":
        shapes = record_shapes(engine)

        def on_step(stats, out):
            if out.scheduled:
                steps.append((shapes[-1], stats.duration))
            if between_steps is not None:
                between_steps()

        engine.step_callbacks.append(on_step)
    outs = [o for _, o in Cluster([engine]).run(workload(seed, engine.model_config.vocab_size)).outputs]
    ttft = np.array([o.metrics.ttft for o in outs])
    tpot = np.array([o.metrics.tpot for o in outs if o.metrics.tpot is not None])
    stats = {"ttft_p50": float(np.median(ttft)), "ttft_p90": float(np.percentile(ttft, 90)),
             "tpot_p50": float(np.median(tpot)), "tpot_p90": float(np.percentile(tpot, 90)),
             "duration": engine.clock.now(), "steps": engine.num_steps}
    return stats, steps


def real_run_with_calibration(seed: int, profile_repeats: int, clock: str, statistic: str = "median",
                              model: str = "tiny-llama") -> tuple[dict, list, dict]:
    """The real run, with the profile grid's cells run between its steps (its clock paused);
    each grid shape's repeats reduce to ``statistic`` (``framework.sim.profile.STATISTICS``)."""
    cells = grid_cells("default", LENGTHS, COUNTS)
    profile_engine = LLMEngine(profile_engine_config(cells, model, num_threads=1))
    timer = time.process_time if clock == "cpu" else time.perf_counter
    profiler = Profiler(profile_engine, seed, timer)
    for cell in cells:  # warm-up pass, not recorded
        profiler.run_cell(*cell, record=False)
    queue = [cell for _ in range(profile_repeats) for cell in cells]
    real_clock = PausableCPUClock() if clock == "cpu" else WallClock()
    every = 12
    count = 0

    def between_steps():
        nonlocal count
        count += 1
        if queue and count % every == 0 and isinstance(real_clock, PausableCPUClock):
            real_clock.pause()
            profiler.run_cell(*queue.pop())
            real_clock.resume()

    real, steps = serve(LLMEngine(engine_config("model", model), clock=real_clock), seed, between_steps)
    while queue:
        profiler.run_cell(*queue.pop())
    profiler.close()
    samples = profiler.samples(statistic)
    hardware = load_hardware("cpu")
    dtype_bytes = profile_engine.executor.dtype.itemsize
    params, fit = calibrate(samples, profile_engine.model_config, hardware, dtype_bytes)
    calibration = calibration_record("roofline", model, hardware, dtype_bytes, 16, params, fit, samples,
                                     {"clock": clock, "cells": [list(c) for c in cells], "repeats": profile_repeats, "statistic": statistic,
                                      "interleaved_with_real_run": clock == "cpu"}, profile_engine.model_config)
    return real, steps, calibration


def noise_floor(steps: list[tuple[BatchShape, float]], bin_tokens: int = 16, min_group: int = 5) -> float | None:
    """Median of |t / median of its group - 1| over steps grouped by (decode rows, prefill rows,
    prefill tokens, decode context, prefill context), the last three in ``bin_tokens`` bins;
    only groups of ``min_group`` or more steps count. None when no group is that large."""
    groups: dict[tuple[int, ...], list[float]] = {}
    for s, t in steps:
        key = (s.num_decode_seqs, s.num_prefill_seqs, s.prefill_tokens // bin_tokens,
               s.decode_context // bin_tokens, s.prefill_context // bin_tokens)
        groups.setdefault(key, []).append(t)
    devs = [abs(t / m - 1) for ts in groups.values() if len(ts) >= min_group for m in [statistics.median(ts)] for t in ts]
    return statistics.median(devs) if devs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default=None, help="a calibration YAML (default: calibrate alongside each real run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--statistic", choices=sorted(STATISTICS), default="median",
                    help="what a grid shape's repeats reduce to: min fits typical steps more closely but "
                         "predicts TPOT ~16%% low (docs/simulator.md)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--model", default="tiny-llama", help="preset or Hugging Face checkpoint directory")
    ap.add_argument("--save-calibration", default=None, help="write the last interleaved calibration here")
    args = ap.parse_args()
    # --profile-repeats 0 used to fail after the real run, with a traceback from calibrate (no
    # measured steps); --repeats 0 printed an empty table.
    for name in ("repeats", "profile_repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.model in SHAPE_ONLY_PRESETS:
        ap.error(f"--model {args.model} is a shape-only preset (no weights), and the real runs need weights: give a "
                 f"checkpoint directory or a preset with weights (tiny-llama)")
    if args.calibration is not None and args.save_calibration is not None:
        ap.error("--save-calibration writes the calibration measured alongside each real run, which --calibration "
                 "replaces: give one of them")
    try:  # a bad --model, --calibration or --save-calibration fails here, not after a real run of tens of seconds
        if args.save_calibration is not None:
            check_writable_file("--save-calibration", args.save_calibration)
        LLMEngine(engine_config("sim", args.model, hardware="cpu",
                                cost_model={"name": "roofline", "calibration": args.calibration}))
    except ValueError as exc:
        ap.error(str(exc))
    rows = []
    for rep in range(args.repeats):
        started = time.perf_counter()
        if args.calibration is None:
            real, steps, calibration = real_run_with_calibration(args.seed, args.profile_repeats, args.clock,
                                                                 args.statistic, args.model)
            if args.save_calibration:
                import yaml

                Path(args.save_calibration).parent.mkdir(parents=True, exist_ok=True)
                with open(args.save_calibration, "w") as f:
                    yaml.safe_dump(calibration, f, sort_keys=False, default_flow_style=None, width=120)
        else:
            calibration = args.calibration
            clock = CPUClock() if args.clock == "cpu" else WallClock()
            real, steps = serve(LLMEngine(engine_config("model", args.model), clock=clock), args.seed)
        sim_engine = LLMEngine(engine_config("sim", args.model, hardware="cpu",
                                             cost_model={"name": "roofline", "calibration": calibration}))
        sim, _ = serve(sim_engine, args.seed)
        cost = sim_engine.executor.cost_model
        errors = sorted(abs(cost.step_time(shape) / t - 1) for shape, t in steps)
        row = {"step_time_median_abs_err": statistics.median(errors), "step_time_p90_abs_err": errors[int(0.9 * len(errors))],
               "noise_floor_median_abs": noise_floor(steps),
               "steps": len(steps),
               **{f"{k}_rel_err": sim[k] / real[k] - 1 for k in ("ttft_p50", "tpot_p50", "ttft_p90", "tpot_p90")},
               "fit_median_abs_err": cost.calibration["fit"]["median_abs_rel_error"] if cost.calibration else None,
               "real": real, "sim": sim, "seconds": time.perf_counter() - started}
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if not isinstance(v, dict)}), flush=True)
        print("   real", json.dumps({k: round(v, 5) for k, v in real.items()}))
        print("   sim ", json.dumps({k: round(v, 5) for k, v in sim.items()}), flush=True)
    for key in ("step_time_median_abs_err", "noise_floor_median_abs", "ttft_p50_rel_err", "tpot_p50_rel_err"):
        # The floor is None when no batch shape repeats often enough to have one.
        print(f"{key:26s} " + "  ".join("     -" if r[key] is None else f"{r[key]:+.3f}" for r in rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
