"""Scale benchmark of the simulated executor: a Poisson chat workload on N simulated replicas,
every output written (summary.json, requests.csv, steps.csv).

    python experiments/bench_sim_scale.py                      # 10,000 requests, 4 req/s, llama-3-8b, 1 A100
    python experiments/bench_sim_scale.py --requests 100000 --replicas 16 --rate 64
    python experiments/bench_sim_scale.py --no-fast-forward    # step by step (same results, slower)

Prints the wall time of the whole process (interpreter start to files written), the simulation
part, and the peak resident memory. The output writers are deliberately plain (csv, json): the
experiments' own writers replace them when run.py drives simulated runs.
"""
from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from framework.chat_workload import ChatWorkload  # noqa: E402
from framework.cluster import Cluster  # noqa: E402
from framework.config import EngineConfig  # noqa: E402
from framework.outputs import RequestOutput  # noqa: E402
from framework.step_log import StepLog  # noqa: E402

REQUEST_COLUMNS = ["request_id", "replica", "arrival_time", "first_scheduled_time", "first_token_time",
                   "finished_time", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens",
                   "num_preemptions", "num_swaps", "ttft", "tpot", "e2el", "finish_reason"]


class Collector:
    """Keeps one compact row per finished request and every inter-token latency."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.token_times: list[float] = []  # every request's token times, back to back
        self.first_token: list[int] = []     # where each request's times start

    def itl(self) -> np.ndarray:
        gaps = np.diff(np.asarray(self.token_times))
        return np.delete(gaps, np.asarray(self.first_token[1:], dtype=np.int64) - 1)

    def __call__(self, replica: int, out: RequestOutput) -> None:
        m = out.metrics
        times = m.token_times
        ttft = m.ttft
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        self.first_token.append(len(self.token_times))
        self.token_times.extend(times)
        self.rows.append((out.request_id, replica, m.arrival_time, m.first_scheduled_time, m.first_token_time,
                          m.finished_time, m.num_prompt_tokens, m.num_generated_tokens, m.num_cached_tokens,
                          m.num_preemptions, m.num_swaps, ttft, tpot, m.e2el, out.outputs[0].finish_reason))


def percentiles(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


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
    ap.add_argument("--out", default="outputs/bench_sim_scale")
    ap.add_argument("--no-fast-forward", action="store_true")
    args = ap.parse_args()

    t_build = time.perf_counter()
    config = EngineConfig(model=args.model, executor="sim", max_num_seqs=256, max_num_batched_tokens=8192,
                          executor_options={"hardware": args.hardware, "tensor_parallel_size": args.tp,
                                            "fast_forward": not args.no_fast_forward})
    cluster = Cluster.build(config, args.replicas, args.router)
    logs = []
    for engine in cluster.engines:
        logs.append(StepLog())
        engine.step_callbacks.append(logs[-1])
    vocab = cluster.engines[0].model_config.vocab_size
    workload = ChatWorkload(num_requests=args.requests, rate=args.rate, seed=args.seed, vocab_size=vocab)
    collect = Collector()
    t_run = time.perf_counter()
    cluster.run(workload, on_output=collect)
    t_write = time.perf_counter()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(REQUEST_COLUMNS)
        writer.writerows(collect.rows)
    with open(out / "steps.csv", "w") as f:
        for i, log in enumerate(logs):
            log.write_csv(f, {"replica": i}, header=i == 0)
    ttft = np.array([r[11] for r in collect.rows if r[11] is not None])
    tpot = np.array([r[12] for r in collect.rows if r[12] is not None])
    e2el = np.array([r[13] for r in collect.rows if r[13] is not None])
    itl = collect.itl()
    duration = max(e.clock.now() for e in cluster.engines)
    out_tokens = sum(r[7] for r in collect.rows)
    allocators = [e.allocator for e in cluster.engines]
    query = sum(a.stats.prefix_query_tokens for a in allocators)
    summary = {
        "requests": len(collect.rows), "replicas": args.replicas, "model": args.model, "hardware": args.hardware,
        "tensor_parallel_size": args.tp, "rate": args.rate, "router": args.router,
        "fast_forward": not args.no_fast_forward, "simulated_duration_s": duration,
        "steps": sum(len(log) for log in logs), "output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / duration if duration else 0.0,
        "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "itl_s": percentiles(itl), "e2el_s": percentiles(e2el),
        "prefix_hit_rate": sum(a.stats.prefix_hit_tokens for a in allocators) / query if query else 0.0,
        "preemptions": sum(e.scheduler.num_preemptions for e in cluster.engines),
        "kv_blocks_per_replica": allocators[0].num_usable_blocks,
    }
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    t_end = time.perf_counter()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(summary["ttft_s"]), json.dumps(summary["tpot_s"]))
    print(f"requests={summary['requests']} steps={summary['steps']} simulated={duration:.0f}s "
          f"preemptions={summary['preemptions']} prefix_hit_rate={summary['prefix_hit_rate']:.3f}")
    print(f"wall: total {t_end - _T0:.2f}s (imports {t_build - _T0:.2f}s, build {t_run - t_build:.2f}s, "
          f"simulate {t_write - t_run:.2f}s, write {t_end - t_write:.2f}s); cpu {time.process_time():.2f}s; "
          f"peak RSS {peak_mb:.0f} MB; torch loaded: {'torch' in sys.modules}")
    sys.stdout.flush()
    os._exit(0)  # skip tearing down a few million objects: the files are written


if __name__ == "__main__":
    main()
