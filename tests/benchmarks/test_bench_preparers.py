"""v0 against v1 input preparation at 8, 64, 256 and 1024 requests (``make bench``; in the
default test run each case runs once, untimed).

The steps are those of ``experiments/bench_preparers.py`` (which also prints the speed-up table of
docs/input-preparation.md): a busy server's step mixing decodes, newly admitted full prefills and
chunked prefills, built as scheduler outputs directly (no model). Each round refills a reused
preparer with the previous step, untimed, then times what the runner asks of the preparer
between the two forward passes: ``record_sampled`` of the previous step's tokens and ``prepare``
of the step. Read the ratios within a group (``--benchmark-group-by=group``), not absolute times.
"""
from functools import lru_cache

import pytest

from experiments.bench_preparers import make_steps, new_preparer, refill, scheduler_pass

make_steps = lru_cache(maxsize=None)(make_steps)


@pytest.mark.parametrize("num_reqs", [8, 64, 256, 1024])
@pytest.mark.parametrize("preparer", ["v0", "v1"])
def test_prepare_step(benchmark, preparer, num_reqs):
    steps = make_steps(num_reqs)
    prep = new_preparer(preparer, steps)

    def setup():
        model_input, sampled = refill(prep, steps)
        scheduler_pass(steps[1])
        return (model_input, sampled), {}

    def step(model_input, sampled):
        prep.record_sampled(model_input, sampled)
        return prep.prepare(steps[1])

    benchmark.group = f"prepare, {num_reqs} requests"
    benchmark.extra_info["scheduled_tokens"] = steps[1].total_num_scheduled_tokens
    out = benchmark.pedantic(step, setup=setup, rounds=max(10, 4000 // num_reqs), warmup_rounds=1)
    assert len(out.req_ids) == num_reqs and out.attn_metadata.num_actual_tokens == steps[1].total_num_scheduled_tokens
