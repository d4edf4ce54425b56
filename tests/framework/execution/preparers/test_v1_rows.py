"""v1's runner-owned rows: the runner's report of sampled tokens, the check that rows follow their
requests, full rows, the scheduler output's order, and the per-step sampling parameters."""
import random

import numpy as np
import pytest
import torch

from experiments.bench_preparers import make_steps, new_preparer, refill
from framework.execution.input_preparer import InputPreparer
from framework.execution.preparers.v1 import FlatBatchPreparer
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.scheduling.output import SchedulerOutput
from tests.framework.execution.preparers.support import assert_equivalent, make_req, record, schedule


def preparer(**kw):
    args = dict(max_num_reqs=4, max_model_len=16, block_size=4, max_num_batched_tokens=32, check=True)
    return FlatBatchPreparer(**{**args, **kw})


def decode_step(reqs, sampled):
    """The step after ``reqs`` computed all their tokens: each appends its sampled token, and
    gets a block if that token starts one."""
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
        r.token_ids.append(sampled[r.request_id])
        if len(r.block_ids) * 4 < r.num_tokens:
            r.block_ids.append(max(r.block_ids) + 10)
    return schedule(reqs, [1] * len(reqs))


def test_runner_recorded_tokens_feed_the_next_step():
    prep = preparer()
    a, b = make_req("a", 5, [1, 2]), make_req("b", 4, [3])
    mi = prep.prepare(schedule([a, b], [5, 4], new=[a, b]))
    record(prep, mi, {"a": 900, "b": 901})
    host = prep.prepare(decode_step([a, b], {"a": 900, "b": 901})).host
    assert host["input_ids"].tolist() == [900, 901]
    assert host["positions"].tolist() == [5, 4]
    assert host["slot_mapping"].tolist() == [2 * 4 + 1, 13 * 4 + 0]  # b's token 4 opens its new block 13
    assert prep.row_num_tokens[[prep.row_of["a"], prep.row_of["b"]]].tolist() == [6, 5]


def test_check_catches_a_row_that_diverged_from_its_request():
    prep = preparer()
    a, b = make_req("a", 5, [1, 2]), make_req("b", 4, [3])
    mi = prep.prepare(schedule([a, b], [5, 4], new=[a, b]))
    record(prep, mi, {"a": 900, "b": 777})  # the runner reports a token the scheduler does not append
    with pytest.raises(AssertionError, match=r"row \d of b diverged from its request \(token ids\)"):
        prep.prepare(decode_step([a, b], {"a": 900, "b": 901}))


def test_check_catches_progress_the_preparer_did_not_see():
    prep = preparer()
    a = make_req("a", 9, [1, 2, 3])
    prep.prepare(schedule([a], [4], new=[a]))
    a.num_computed_tokens = 6  # the scheduler says 6 computed; the preparer prepared 4
    with pytest.raises(AssertionError, match=r"of a diverged from its request \(computed tokens\)"):
        prep.prepare(schedule([a], [3]))


def test_without_check_a_diverged_row_goes_unnoticed():
    """What the check is for: the rows, not the requests, feed the step."""
    prep = preparer(check=False)
    a = make_req("a", 5, [1, 2])
    mi = prep.prepare(schedule([a], [5], new=[a]))
    record(prep, mi, {"a": 777})
    assert prep.prepare(decode_step([a], {"a": 901})).host["input_ids"].tolist() == [777]


def test_record_sampled_takes_the_last_step_once_with_one_token_per_sample():
    prep = preparer()
    a, b = make_req("a", 5, [1, 2]), make_req("b", 4, [3])
    first = prep.prepare(schedule([a, b], [5, 4], new=[a, b]))
    with pytest.raises(ValueError, match="2 sampled rows"):
        prep.record_sampled(first, np.array([1], dtype=np.int64))
    record(prep, first, {"a": 900, "b": 901})
    with pytest.raises(ValueError, match="prepared last, once"):
        record(prep, first, {"a": 900, "b": 901})
    second = prep.prepare(decode_step([a, b], {"a": 900, "b": 901}))
    with pytest.raises(ValueError, match="prepared last"):
        record(prep, first, {"a": 900, "b": 901})
    record(prep, second, {"a": 1, "b": 2})


def test_a_full_row_takes_no_sampled_token():
    """A prompt as long as the table's rows: its sampled token ends the request and has nowhere
    to go; recording it must not spill into the next row."""
    prep = preparer(max_model_len=8, block_size=4)
    a, b = make_req("a", 8, [1, 2]), make_req("b", 3, [3])
    mi = prep.prepare(schedule([a, b], [8, 3], new=[a, b]))
    assert mi.sample_req_ids == ["a", "b"]
    record(prep, mi, {"a": 900, "b": 901})
    assert prep.token_ids.tolist() == [list(range(100, 108)), [100, 101, 102, 901, 0, 0, 0, 0]] + [[0] * 8] * 2
    assert prep.row_num_tokens[:2].tolist() == [8, 4]


def test_scheduled_and_token_counts_out_of_order_is_an_error():
    prep = preparer(check=False)
    a, b = make_req("a", 4, [1]), make_req("b", 4, [2])
    prep.prepare(schedule([a, b], [4, 4], new=[a, b]))
    decode_step([a, b], {"a": 900, "b": 901})  # their new tokens and blocks are read off the requests
    swapped = SchedulerOutput(scheduled=[a, b], num_scheduled_tokens={"b": 1, "a": 1})
    with pytest.raises(ValueError, match="in scheduled order"):
        prep.prepare(swapped)


def test_the_benchmark_step_matches_v0_with_the_runner_hook():
    """The step experiments/bench_preparers.py times: the tokens it reports for the first step
    are the ones the second step's requests gained, so v1's inputs equal v0's."""
    steps = make_steps(64)
    v0, v1 = new_preparer("v0", steps), new_preparer("v1", steps)
    v1.check = True
    mi, sampled = refill(v1, steps)
    v1.record_sampled(mi, sampled)
    refill(v0, steps)
    assert_equivalent(v0.prepare(steps[1]), v1.prepare(steps[1]))


def test_sampling_parameters_follow_the_rows_that_sample():
    """Temperature, top-k, top-p, generators and logprobs of the sampled rows, as the generic
    ``InputPreparer.sampling_metadata`` computes them, while rows using each filter come and go."""
    rng, lp_rng = random.Random(0), random.Random(1)  # logprobs drawn apart: the steps stay as they were
    prep = preparer(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=512)
    live: dict[str, Request] = {}
    for step in range(60):
        finished = {rid for rid in live if rng.random() < 0.3}
        for rid in finished:
            del live[rid]
        new = []
        for k in range(rng.randint(0, 8 - len(live))):
            params = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 0, 5]),
                                    top_p=rng.choice([1.0, 1.0, 0.9]), seed=rng.choice([None, 3]),
                                    logprobs=lp_rng.choice([None, None, 0, 4]))
            r = Request(f"{step}.{k}", [5, 6, 7], params, 0.0)
            r.status, r.block_ids = RequestStatus.RUNNING, [1]
            if params.seed is not None:
                r.generator = torch.Generator().manual_seed(params.seed)
            live[r.request_id] = r
            new.append(r)
        scheduled = list(live.values())
        if not scheduled:
            continue
        # Full prompts sample; a request scheduled for fewer tokens does not.
        counts = [rng.choice([2, 3]) if r in new else 1 for r in scheduled]
        for r in scheduled:
            if r not in new:  # rebuild it: only the sampling parameters are under test
                new.append(r)
                r.num_computed_tokens = 0
        out = schedule(scheduled, counts, new=new)
        out.finished_req_ids = finished | {r.request_id for r in new}
        mi = prep.prepare(out)
        sampled = [live[rid] for rid in mi.sample_req_ids]
        want = InputPreparer.sampling_metadata(
            prep, np.array([r.sampling_params.temperature for r in sampled], dtype=np.float32),
            np.array([r.sampling_params.top_k for r in sampled], dtype=np.int64),
            np.array([r.sampling_params.top_p for r in sampled], dtype=np.float32),
            {i: r.generator for i, r in enumerate(sampled) if r.generator is not None},
            num_logprobs=np.array([-1 if r.sampling_params.logprobs is None else r.sampling_params.logprobs
                                   for r in sampled]))
        got = mi.sampling
        assert got.all_greedy == want.all_greedy == (got.temperature is None)
        assert got.all_greedy or torch.equal(got.temperature, want.temperature)
        for name in ("top_k", "top_p"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
        assert got.generators.keys() == want.generators.keys()
        assert all(got.generators[i] is want.generators[i] for i in got.generators)
        assert got.num_logprobs == want.num_logprobs
        assert (got.logprob_rows is None) == (want.logprob_rows is None)
        if got.logprob_rows is not None:
            assert got.logprob_rows.tolist() == got.logprob_rows_cpu.tolist() == want.logprob_rows_cpu.tolist()
        asking = [i for i, r in enumerate(sampled) if r.sampling_params.logprobs is not None]
        assert (got.logprob_rows_cpu.tolist() if asking else got.logprob_rows_cpu) == (asking or None)


def test_deferred_tokens_feed_the_next_step_from_the_device_and_never_a_reused_row():
    """Async scheduling: a deferred step's rows count its tokens at once; the next step says which of its
    inputs they are; recorded later, a token whose row went to another request since is not written."""
    prep = preparer()
    a, b = make_req("a", 5, [1, 2]), make_req("b", 4, [3])
    mi = prep.prepare(schedule([a, b], [5, 4], new=[a, b]))
    prep.defer_sampled(mi)
    for r in (a, b):  # as Scheduler.commit leaves them
        r.num_computed_tokens = r.num_tokens
        r.token_ids.append(-1)
    b.block_ids.append(13)
    a.status = RequestStatus.FINISHED_ABORTED
    c = make_req("c", 6, [4, 5])
    out = schedule([b, c], [1, 6], new=[c])
    out.finished_req_ids = {"a"}
    nxt = prep.prepare(out)  # c takes a's row
    assert prep.row_of["c"] == 0
    dst, src = nxt.deferred_tokens
    assert dst.tolist() == [0] and src.tolist() == [1]  # b's one input is the deferred step's second token
    prep.record_sampled(mi, np.array([900, 901]))
    assert prep.token_ids[0, :6].tolist() == c.token_ids  # a's token not written into c's row
    assert prep.token_ids[prep.row_of["b"], 4] == 901


def test_a_top_p_just_below_one_still_filters():
    preparer = FlatBatchPreparer(4, 64, 16, 64)
    meta = preparer.sampling_metadata(np.array([1.0], dtype=np.float32), None, np.array([0.995], dtype=np.float32))
    assert meta.top_p is not None and meta.top_p.tolist() == pytest.approx([0.995])
    assert preparer.sampling_metadata(np.array([1.0], dtype=np.float32), None,
                                      np.array([1.0], dtype=np.float32)).top_p is None
