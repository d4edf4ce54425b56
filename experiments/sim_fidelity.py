"""Fidelity of the simulator on this CPU: calibrate on the tiny model, then serve a held-out
workload for real and in simulation and compare.

    python experiments/sim_fidelity.py --calibration cal.yaml --repeats 3 --clock cpu
    python experiments/sim_fidelity.py --profile --clock cpu       # calibrate first (profile grid)

Per repeat: one real run (the ``model`` executor, one torch thread) and one simulated run (the
``sim`` executor on the ``cpu`` hardware with the calibration) of the same Poisson chat workload,
which differs from the profile grid (random lengths, arrivals, prefix hits, queueing). Reported:

- step times: the calibrated cost model's prediction for every real step's exact batch shape
  against the step's measured duration (median and p90 of |pred/measured - 1|);
- TTFT and TPOT p50 (and p90) of the simulated run against the real one.

``--clock cpu`` times the real run by process CPU time (``framework.clock.CPUClock``): on a
machine shared with other work it leaves out the time other processes held the cores; ``wall``
is the plain wall clock.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from framework.chat_workload import ChatWorkload
from framework.clock import CPUClock, WallClock
from framework.cluster import Cluster
from framework.config import EngineConfig
from framework.cost_model import BatchShape
from framework.engine import LLMEngine


def workload(seed: int) -> ChatWorkload:
    return ChatWorkload(num_requests=60, rate=5.0, seed=seed, vocab_size=1024, system_prompt_len=48,
                        user_len_median=48, output_len_median=32, max_prompt_len=320, max_output_len=96)


def engine_config(executor: str, **options) -> EngineConfig:
    return EngineConfig(model="tiny-llama", executor=executor, executor_options=options, max_model_len=512,
                        max_num_seqs=32, max_num_batched_tokens=1024, num_threads=1 if executor == "model" else None)


def serve(engine: LLMEngine, seed: int) -> tuple[dict, list[tuple[BatchShape, float]]]:
    shapes: list[BatchShape] = []
    durations: list[float] = []
    if engine.config.executor == "model":
        execute = engine.executor.execute

        def recording_execute(out):
            shapes.append(BatchShape.from_scheduler_output(out))
            return execute(out)

        engine.executor.execute = recording_execute

        def on_step(stats, out):
            if out.scheduled:
                durations.append(stats.duration)

        engine.step_callbacks.append(on_step)
    outs = [o for _, o in Cluster([engine]).run(workload(seed))]
    ttft = np.array([o.metrics.ttft for o in outs])
    tpot = np.array([o.metrics.tpot for o in outs if o.metrics.tpot is not None])
    stats = {"ttft_p50": float(np.median(ttft)), "ttft_p90": float(np.percentile(ttft, 90)),
             "tpot_p50": float(np.median(tpot)), "tpot_p90": float(np.percentile(tpot, 90)),
             "duration": engine.clock.now(), "steps": engine.num_steps}
    return stats, list(zip(shapes, durations))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default="outputs/fidelity/calibration.yaml")
    ap.add_argument("--profile", action="store_true", help="run python -m framework.profile first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=5)
    ap.add_argument("--profile-each", action="store_true", help="recalibrate before every repeat (implies --profile)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    args.profile = args.profile or args.profile_each
    def calibrate() -> None:
        from framework.profile import main as profile

        Path(args.calibration).parent.mkdir(parents=True, exist_ok=True)
        # The grid covers the regime the workload runs in: batches of 1-16, prompts up to 320.
        profile(["--out", args.calibration, "--threads", "1", "--clock", args.clock, "--repeats", str(args.profile_repeats),
                 "--counts", "1,2,3,4,6,8,12,16", "--lengths", "16,48,96,192,320"])

    if args.profile:
        calibrate()
    sim_options = {"hardware": "cpu", "cost_model": {"name": "roofline", "calibration": args.calibration}}
    rows = []
    for rep in range(args.repeats):
        if args.profile_each and rep:
            calibrate()  # right before the real run, under the same load (a shared machine drifts)
        started = time.perf_counter()
        real_engine = LLMEngine(engine_config("model"), clock=CPUClock() if args.clock == "cpu" else WallClock())
        real, steps = serve(real_engine, args.seed)
        sim_engine = LLMEngine(engine_config("sim", **sim_options))
        assert sim_engine.allocator.num_blocks == real_engine.allocator.num_blocks
        sim, _ = serve(sim_engine, args.seed)
        cost = sim_engine.executor.cost_model
        errors = sorted(abs(cost.step_time(shape) / t - 1) for shape, t in steps)
        row = {"step_time_median_abs_err": statistics.median(errors), "step_time_p90_abs_err": errors[int(0.9 * len(errors))],
               "steps": len(steps),
               **{f"{k}_rel_err": sim[k] / real[k] - 1 for k in ("ttft_p50", "tpot_p50", "ttft_p90", "tpot_p90")},
               "real": real, "sim": sim, "seconds": time.perf_counter() - started}
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if not isinstance(v, dict)}), flush=True)
        print("   real", json.dumps({k: round(v, 5) for k, v in real.items()}))
        print("   sim ", json.dumps({k: round(v, 5) for k, v in sim.items()}), flush=True)
    for key in ("step_time_median_abs_err", "ttft_p50_rel_err", "tpot_p50_rel_err"):
        values = [r[key] for r in rows]
        print(f"{key:26s} " + "  ".join(f"{v:+.3f}" for v in values))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
