"""Scale benchmark of the simulated executor through the standard run path: the same Hydra
config, ``run_experiment``, recorder and metrics as ``python -m framework.run``, every output
written (config.yaml, workload.jsonl, requests.csv, steps.csv, summary.json; the figures with
--plots; --no-workload leaves out workload.jsonl, the replayable copy of the requests).

    python experiments/bench_sim_scale.py                      # 10,000 chat requests, 4 req/s, llama-3-8b, 1 A100
    python experiments/bench_sim_scale.py --requests 100000 --replicas 16 --rate 64
    python experiments/bench_sim_scale.py --plots              # the figures too (PNG and PDF)
    python experiments/bench_sim_scale.py --no-workload        # without workload.jsonl
    python experiments/bench_sim_scale.py -- executor.fast_forward=false   # any further override

It is ``python -m framework.run executor=sim workload=chat model.name=llama-3-8b
workload.num_requests=10000 progress=false plots=false ...`` with the phases timed: imports, composing
the config, the run (building the engines, generating the workload, simulating and writing), and
the whole process (interpreter start to files written), plus the peak resident memory.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from framework.harness.experiment import run_experiment  # noqa: E402
from framework.harness.overrides import hydra_error_line  # noqa: E402
from framework.common.registry import UnavailableError  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def overrides(args: argparse.Namespace) -> list[str]:
    out = ["executor=sim", f"+hardware={args.hardware}", f"model.name={args.model}",
           f"executor.tensor_parallel_size={args.tp}", "workload=chat", f"workload.num_requests={args.requests}",
           f"workload.rate={args.rate}", f"workload.seed={args.seed}", "progress=false", f"plots={args.plots}", f"save_workload={not args.no_workload}"]
    if args.replicas > 1:
        out += [f"+cluster={args.router}", f"cluster.num_replicas={args.replicas}"]
    return out + args.overrides


def _mtimes(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (whole cluster)")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="a100-80gb")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--router", default="round_robin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plots", action="store_true", help="write the figures too (PNG and PDF)")
    ap.add_argument("--no-workload", action="store_true", help="do not write workload.jsonl")
    ap.add_argument("--out", default="outputs/bench_sim_scale")
    ap.add_argument("overrides", nargs="*", help="further Hydra overrides (after --)")
    args = ap.parse_args()
    # Checked here: --replicas 0 used to run one replica silently (no +cluster below 2), and the
    # others failed with a traceback from deep in the run.
    for name in ("requests", "tp", "replicas"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (0 < args.rate < float("inf")):
        ap.error(f"--rate must be a positive number of requests per second, got {args.rate}")
    if args.replicas == 1 and args.router != ap.get_default("router"):
        ap.error(f"--router {args.router} routes among replicas: give --replicas 2 or more")

    t_compose = time.perf_counter()
    before = _mtimes(Path(args.out))
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = compose(config_name="config", overrides=overrides(args))
        t_run = time.perf_counter()
        summary = run_experiment(cfg, args.out, run_name="bench_sim_scale")
    except (ValueError, UnavailableError, HydraException, OmegaConfBaseException) as exc:
        # A configuration error (--router bogus, --hardware h100, a model that does not fit, a bad
        # override), as python -m framework.run reports one; run_experiment raises ValueError for
        # nothing else.
        print(f"error: {hydra_error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    t_end = time.perf_counter()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = Path(args.out)
    steps = summary.get("num_steps")
    print(f"requests={summary['completed']} steps={steps} simulated={summary['duration_s']:.0f}s "
          f"preemptions={summary['num_preemptions']} prefix_hit_rate={summary['prefix_cache_hit_rate']:.3f}")
    print(f"wall: total {t_end - _T0:.2f}s (imports {t_compose - _T0:.2f}s, compose {t_run - t_compose:.2f}s, "
          f"run {t_end - t_run:.2f}s of which serving {summary['wall_time_s']:.2f}s); cpu {time.process_time():.2f}s; "
          f"peak RSS {peak_mb:.0f} MB; torch loaded: {'torch' in sys.modules}")
    # Only what this run wrote: an earlier run's files (its plots, its workload.jsonl) may be there too.
    written = [p for p, mtime in sorted(_mtimes(out).items()) if before.get(p) != mtime]
    print("files: " + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in written))
    print(json.dumps({"ttft_p50_ms": summary["median_ttft_ms"], "ttft_p99_ms": summary["p99_ttft_ms"],
                      "tpot_p50_ms": summary["median_tpot_ms"], "tpot_p99_ms": summary["p99_tpot_ms"]}))
    sys.stdout.flush()
    os._exit(0)  # skip tearing down a few million objects: the files are written


if __name__ == "__main__":
    main()
