"""fcfs vs chunked vs priority_swap on a mixed workload, and swap vs recompute under one memory
pressure, on the CPU tiny model.

Many short chats (priority 0) and a few long prompts (priority 1) arrive as a Poisson process,
served by the run driver (``framework.harness.cluster.Cluster``), which adds each at its arrival time.
Prints p50/p99 TTFT (chats, long prompts, all) and TPOT per run, the same figures as ratios
against fcfs, and preemptions, swap volumes, time spent copying blocks and tokens recomputed
after preemption.

Times on a shared machine are noisy. ``--clock cpu`` runs the engine on this process's CPU time
(jumping over idle waits) instead of the wall clock: latencies as on a dedicated core, which
other jobs on the machine barely disturb.

    python experiments/compare_policies.py [--chats 96] [--long 6] [--rate 16] [--blocks 64] [--clock cpu] [--seeds 0 1 2]
"""
from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from framework import EngineConfig, LLMEngine  # noqa: E402
from framework.common.clock import CPUClock, WallClock  # noqa: E402
from framework.harness.cluster import Cluster  # noqa: E402
from framework.harness.experiment import warm_up  # noqa: E402
from framework.harness.workload import WorkloadRequest  # noqa: E402

BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_SEQS = 16, 896, 32


def workload(args, seed) -> tuple[list[WorkloadRequest], dict[str, str]]:
    """The requests in arrival order (exactly ``args.chats`` chats and ``args.long`` long
    prompts, shuffled), and the kind of each by id."""
    rng = random.Random(seed)
    jobs = [("chat", rng.randint(24, 96), rng.randint(24, 48), 0) for _ in range(args.chats)]
    jobs += [("long", rng.randint(600, 800), 16, 1) for _ in range(args.long)]
    rng.shuffle(jobs)
    t, requests, kinds = 0.0, [], {}
    for i, (kind, n_in, n_out, prio) in enumerate(jobs):
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(3, 1024) for _ in range(n_in)]
        requests.append(WorkloadRequest(str(i), prompt, n_out, t, prio))
        kinds[str(i)] = kind
    return requests, kinds


def run(args, seed, name, policy, **engine_kw):
    config = dict(model="tiny-llama", policy=policy, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                  max_num_seqs=MAX_NUM_SEQS, num_gpu_blocks_override=args.blocks, swap_space=1.0, dtype="float32", num_threads=args.threads,
                  enable_prefix_caching=False)
    config.update(engine_kw)
    engine = LLMEngine(EngineConfig(**config), clock=CPUClock() if args.clock == "cpu" else WallClock())
    runner = engine.executor.runner
    apply, block_op_time = runner.apply_block_ops, [0.0]

    def timed_block_ops(out):
        t0 = engine.clock.now()
        apply(out)
        block_op_time[0] += engine.clock.now() - t0

    runner.apply_block_ops = timed_block_ops
    computed = [0]
    engine.step_callbacks.append(lambda stats, out: computed.__setitem__(0, computed[0] + stats.num_scheduled_tokens))
    warm_up(engine, 1)
    computed[0] = 0

    requests, kinds = workload(args, seed)
    result = Cluster([engine]).run(requests)  # greedy, exactly each request's output_len tokens
    done = [o for _, o in result.outputs]
    makespan = result.end_time - result.start_time

    s, stats = engine.scheduler, engine.allocator.stats
    ttft = {k: [o.metrics.ttft for o in done if k in ("all", kinds[o.request_id])] for k in ("chat", "long", "all")}
    tpot = [o.metrics.tpot for o in done if o.metrics.tpot is not None]
    needed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in done)
    return {
        "run": name,
        "ttft_chat_p50": np.percentile(ttft["chat"], 50), "ttft_chat_p99": np.percentile(ttft["chat"], 99),
        "ttft_long_p50": np.percentile(ttft["long"], 50),
        "ttft_p50": np.percentile(ttft["all"], 50), "ttft_p99": np.percentile(ttft["all"], 99),
        "tpot_p50": np.percentile(tpot, 50), "tpot_p99": np.percentile(tpot, 99),
        "makespan": makespan,
        "preemptions": s.num_preemptions, "swap_outs": s.num_swap_outs, "recomputes": s.num_preemptions - s.num_swap_outs,
        "blocks_out": stats.blocks_swapped_out, "blocks_in": stats.blocks_swapped_in,
        "swap_MiB": (stats.blocks_swapped_out + stats.blocks_swapped_in) * engine.executor.bytes_per_block / 2**20,
        "block_op_s": block_op_time[0], "recomputed_tokens": computed[0] - needed,
    }


TIMES = ("ttft_chat_p50", "ttft_chat_p99", "ttft_long_p50", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "makespan")
COUNTS = ("preemptions", "swap_outs", "recomputes", "blocks_out", "blocks_in", "swap_MiB", "block_op_s",
          "recomputed_tokens")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=96)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--rate", type=float, default=16.0, help="arrivals per second (Poisson)")
    p.add_argument("--blocks", type=int, default=64, help="KV blocks of 16 tokens (the memory pressure)")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the chunked policies")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="workload seeds; medians are printed")
    args = p.parse_args(argv)
    # Checked before any run: a zero count used to fail after minutes of serving, in a percentile
    # of no requests (every table has chat and long-prompt columns), a zero rate in expovariate.
    for name in ("chats", "long", "blocks", "budget", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (0 < args.rate < float("inf")):
        p.error(f"--rate must be a positive number of arrivals per second, got {args.rate}")
    # The cache holds one request of max_model_len besides the null block; the budget a token per running request.
    if args.blocks < MAX_MODEL_LEN // BLOCK_SIZE + 1:
        p.error(f"--blocks must hold one request of {MAX_MODEL_LEN} tokens: at least {MAX_MODEL_LEN // BLOCK_SIZE + 1} "
                f"blocks of {BLOCK_SIZE}, got {args.blocks}")
    if args.budget < MAX_NUM_SEQS:
        p.error(f"--budget must be at least {MAX_NUM_SEQS} tokens, one per running request, got {args.budget}")
    configs = [
        # fcfs admits whole prompts only: its budget must hold the longest one.
        ("fcfs", "fcfs", dict(max_num_batched_tokens=1024)),
        ("chunked", "chunked", dict(max_num_batched_tokens=args.budget)),
        ("priority_swap", "priority_swap", dict(max_num_batched_tokens=args.budget)),
        ("priority_recompute", "priority_swap",
         dict(max_num_batched_tokens=args.budget, policy_options={"preemption_mode": "recompute"})),
    ]
    runs = {name: [] for name, _, _ in configs}
    for seed in args.seeds:
        for name, policy, kw in configs:
            runs[name].append(run(args, seed, name, policy, **kw))
    med = {name: {k: float(np.median([r[k] for r in rs])) for k in TIMES + COUNTS} for name, rs in runs.items()}
    ratio = {name: {k: float(np.median([r[k] / b[k] for r, b in zip(rs, runs["fcfs"])])) for k in TIMES}
             for name, rs in runs.items()}
    print(f"{args.chats + args.long} requests ({args.chats} chats, {args.long} long) at {args.rate}/s, "
          f"{args.blocks} KV blocks, chunk budget {args.budget}, {args.clock} clock, "
          f"median of seeds {args.seeds}")
    for title, table, fmt in (("seconds", med, "15.3f"), ("ratio vs fcfs", ratio, "15.2f")):
        print(f"{title:28s}" + "".join(f"{k:>15s}" for k in TIMES))
        for name in runs:
            print(f"{name:28s}" + "".join(f"{table[name][k]:{fmt}}" for k in TIMES))
    print(f"{'median counts':28s}" + "".join(f"{k:>18s}" for k in COUNTS))
    for name in runs:
        print(f"{name:28s}" + "".join(f"{med[name][k]:18.2f}" for k in COUNTS))


if __name__ == "__main__":
    main()
