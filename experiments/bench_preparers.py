"""v0 (per sequence group, Python) against v1 (flat persistent batch, numpy) input preparation.

    python -m experiments.bench_preparers [--repeats 30]

Builds scheduler outputs directly (no model, no scheduler): a step that fills the preparers'
state (untimed), then the timed step of a busy server, in which those requests have moved on by
one step (decodes appended their sampled token, some crossing into a new block; chunked
prefills continue with their next chunk; a few finished) and new requests are admitted with
full prefills. What is timed is the preparer's share of a real step: the runner's
``record_sampled`` of the first step's tokens, then ``prepare`` of the second. Preparers are
reused across repeats (steady state); v0 and v1 take turns so both see the same load (one step
each by default; ``--turn N`` runs N consecutive steps of one before the other); times are CPU
times. Prints markdown tables: the speed-up at 8, 64, 256 and
1024 requests, and v1's step time as the prefill tokens of 256 requests grow.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import numpy as np

from framework.execution.input_preparer import PREPARERS, InputPreparer, ModelInput
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.scheduling.output import SchedulerOutput

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
SIZES = (8, 64, 256, 1024)


def _request(rid: str, num_prompt: int, num_out: int, num_computed: int, num_sched: int, rng: random.Random,
             blocks: list[int]) -> Request:
    tokens = [rng.randrange(3, 32000) for _ in range(num_prompt + num_out)]
    r = Request(rid, tokens[:num_prompt], SamplingParams(temperature=rng.choice([0.0, 0.8])), 0.0)
    r.token_ids = tokens
    r.num_computed_tokens = num_computed
    r.status = RequestStatus.RUNNING
    need = -(-(num_computed + num_sched) // BLOCK_SIZE)
    r.block_ids = [blocks.pop() for _ in range(need)]
    return r


def make_steps(num_reqs: int, seed: int = 0, prefill_scale: int = 1, chunk: int = 256,
               ) -> tuple[SchedulerOutput, SchedulerOutput]:
    """Two consecutive steps of a server running ``num_reqs`` requests; the second one (timed)
    schedules them all: ``num_reqs // 32`` newly admitted full prefills (16 to 256 prompt
    tokens, times ``prefill_scale``, at most 4000), ``num_reqs // 64`` chunked prefills
    continuing with their next ``chunk`` tokens (at least one of each kind), and decodes of
    contexts of 16 to 2048 tokens. The first step, untimed, schedules the decodes and chunked
    prefills one step earlier, plus 2% more decodes that finish there."""
    rng = random.Random(seed)
    blocks = list(range(1, 1 + 2 * num_reqs * (MAX_MODEL_LEN // BLOCK_SIZE)))
    rng.shuffle(blocks)
    num_new, num_chunked = max(1, num_reqs // 32), max(1, num_reqs // 64)
    num_finishing = num_reqs // 50
    running, counts, arrivals = [], {}, []
    for i in range(num_reqs + num_finishing):
        if i < num_new:          # admitted in the second step
            length = min(4000, rng.randrange(16, 256) * prefill_scale)
            arrivals.append(_request(str(i), length, 0, 0, length, rng, blocks))
            continue
        if i < num_new + num_chunked:  # a chunked prefill, somewhere in its prompt
            length = rng.randrange(512 + 2 * chunk, 4000)
            done = rng.randrange(0, length - 2 * chunk) // chunk * chunk
            r = _request(str(i), length, 0, done, chunk, rng, blocks)
            n = chunk
        else:                    # a decode: one sampled token to feed back
            length = rng.randrange(16, 2048)
            num_prompt = rng.randrange(1, length)
            r = _request(str(i), num_prompt, length - num_prompt, length - 1, 1, rng, blocks)
            n = 1
        running.append(r)
        counts[r.request_id] = n
    rng.shuffle(running)
    counts = {r.request_id: counts[r.request_id] for r in running}  # the scheduled order, as a scheduler lists them
    step0 = SchedulerOutput(scheduled=list(running), num_scheduled_tokens=counts, new_requests=list(running))

    finishing = {r.request_id for r in running[:num_finishing]}
    scheduled, next_counts = [], {}
    for r in running:
        if r.request_id in finishing:
            continue
        computed = r.num_computed_tokens + counts[r.request_id]
        tokens = list(r.token_ids)
        if computed == len(tokens):
            tokens.append(rng.randrange(3, 32000))
        n = min(chunk, len(tokens) - computed)
        q = Request(r.request_id, r.prompt_token_ids, r.sampling_params, 0.0)
        q.token_ids, q.num_computed_tokens, q.status = tokens, computed, RequestStatus.RUNNING
        q.block_ids = list(r.block_ids)
        while len(q.block_ids) * BLOCK_SIZE < computed + n:
            q.block_ids.append(blocks.pop())
        scheduled.append(q)
        next_counts[q.request_id] = n
    for r in arrivals:
        scheduled.append(r)
        next_counts[r.request_id] = r.num_tokens
    step1 = SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=next_counts, new_requests=list(arrivals),
                            finished_req_ids=finishing)
    return step0, step1


def new_preparer(name: str, steps: tuple[SchedulerOutput, SchedulerOutput]) -> InputPreparer:
    step0, step1 = steps
    budget = max(step0.total_num_scheduled_tokens, step1.total_num_scheduled_tokens)
    return PREPARERS.create(name, max_num_reqs=step0.num_reqs + len(step1.new_requests), max_model_len=MAX_MODEL_LEN,
                            block_size=BLOCK_SIZE, max_num_batched_tokens=budget)


def scheduler_pass(out: SchedulerOutput) -> int:
    """What the scheduler reads of each request just before the runner prepares the step
    (appending the sampled token, allocating slots, hashing a new prompt's blocks for the prefix
    cache): in an engine the preparer finds these in the CPU caches, not in main memory."""
    touched = sum(r.token_ids[-1] + r.num_computed_tokens + len(r.block_ids) + out.num_scheduled_tokens[r.request_id]
                  for r in out.scheduled)
    return touched + sum(hash(tuple(r.token_ids)) & 1 for r in out.new_requests)


def sampled_tokens(model_input: ModelInput, step1: SchedulerOutput) -> np.ndarray:
    """What the sampler returned for ``model_input`` (the first step): the tokens the second
    step's requests gained (any token for a request that finished)."""
    gained = {r.request_id: r.token_ids[r.num_computed_tokens] for r in step1.scheduled
              if r.num_computed_tokens < r.num_tokens}
    return np.array([gained.get(rid, 0) for rid in model_input.sample_req_ids], dtype=np.int64)


def refill(prep: InputPreparer, steps: tuple[SchedulerOutput, SchedulerOutput]) -> tuple[ModelInput, np.ndarray]:
    """Empty the preparer and prepare the first step again: the model input whose sampled tokens
    the runner reports next, and those tokens."""
    step0, step1 = steps
    prep.prepare(SchedulerOutput(finished_req_ids={r.request_id for r in step0.scheduled + step1.scheduled}))
    model_input = prep.prepare(step0)
    return model_input, sampled_tokens(model_input, step1)


def time_step(prep: InputPreparer, steps: tuple[SchedulerOutput, SchedulerOutput]) -> float:
    """Seconds of preparer work between the first step's sampling and the second step's forward
    pass: the runner's ``record_sampled`` of the first step, then ``prepare`` of the second. The
    preparer is emptied and refilled with the first step before, so a reused preparer is timed in
    its steady state (rows it touched before), as in a long-running engine, with the scheduler's
    pass over the requests in between (untimed) and the garbage collector off. CPU time, not wall
    time: on a shared machine the time other processes take the core is not the preparer's."""
    model_input, tokens = refill(prep, steps)
    gc.disable()
    try:
        start = time.process_time()
        prep.record_sampled(model_input, tokens)
        recorded = time.process_time()
        scheduler_pass(steps[1])
        resumed = time.process_time()
        prep.prepare(steps[1])
        return time.process_time() - resumed + recorded - start
    finally:
        gc.enable()


def measure(steps, repeats: int, names=("v0", "v1"), turn: int = 1) -> dict[str, list[float]]:
    """``repeats`` timings of each preparer on ``steps``; the preparers take turns of ``turn``
    consecutive steps, so both see the same load. With ``turn=1`` each preparer's step follows
    the other's (its caches then hold the other's data, v0's Python objects above all); a longer
    turn times each in the steady state of an engine that runs one preparer step after step."""
    preps = {n: new_preparer(n, steps) for n in names}
    for prep in preps.values():
        time_step(prep, steps)  # warm-up: first touch of the tables' memory
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(0, repeats, turn):
        for n, prep in preps.items():
            samples[n] += [time_step(prep, steps) for _ in range(min(turn, repeats - i))]
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--turn", type=int, default=1,
                        help="consecutive steps per preparer before the other takes over (default 1: strict alternation)")
    args = parser.parse_args(argv)
    # 0 used to fail after the warm-up, in statistics.median of no timings (--repeats) or in
    # range() with a zero step (--turn).
    for name in ("repeats", "turn"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    print("| requests | scheduled tokens | v0 median (ms) | v1 median (ms) | v1 speed-up (median) "
          "| v1 speed-up (min) | v1 us / 1k tokens |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in SIZES:
        steps = make_steps(n)
        t = measure(steps, args.repeats, turn=args.turn)
        v0, v1 = statistics.median(t["v0"]), statistics.median(t["v1"])
        tokens = steps[1].total_num_scheduled_tokens
        print(f"| {n} | {tokens} | {v0 * 1e3:.3f} | {v1 * 1e3:.3f} | {v0 / v1:.1f}x | {min(t['v0']) / min(t['v1']):.1f}x "
              f"| {v1 * 1e9 / tokens:.0f} |")
    print()
    print("| 256 requests, prefill lengths x | scheduled tokens | v1 min (ms) | v1 us / 1k tokens |")
    print("| ---: | ---: | ---: | ---: |")
    points = []
    for scale in (1, 2, 4, 8, 16):
        steps = make_steps(256, prefill_scale=scale)
        v1 = min(measure(steps, args.repeats, names=("v1",))["v1"])  # min: the least disturbed run
        tokens = steps[1].total_num_scheduled_tokens
        points.append((tokens, v1))
        print(f"| {scale} | {tokens} | {v1 * 1e3:.3f} | {v1 * 1e9 / tokens:.0f} |")
    slope = np.polyfit(np.log([t for t, _ in points]), np.log([v for _, v in points]), 1)[0]
    print(f"\nv1 step time ~ tokens^{slope:.2f} (log-log fit; 1.0 would be linear)")


if __name__ == "__main__":
    main()
