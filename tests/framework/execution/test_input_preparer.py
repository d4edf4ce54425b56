"""The helpers every preparer shares: block table width, sampling and prompt logprobs metadata, penalties."""
import numpy as np
import pytest
import torch

from framework.common.request import Request
from framework.common.sampling_params import SamplingParams
from framework.execution.preparers.v1 import FlatBatchPreparer
from tests.framework.execution.preparers.support import make_req, schedule


def preparer(**kw):
    args = dict(max_num_reqs=4, max_model_len=64, block_size=4, max_num_batched_tokens=64)
    return FlatBatchPreparer(**{**args, **kw})


def f32(*values):
    return np.array(values, dtype=np.float32)


def test_a_request_as_long_as_a_max_model_len_between_blocks_reaches_its_last_block():
    prep = preparer(max_model_len=10)
    a = make_req("a", 10, [1, 2, 3])
    mi = prep.prepare(schedule([a], [10], new=[a]))
    assert mi.host["slot_mapping"].tolist() == [4 + i for i in range(10)]
    assert mi.host["block_table"][0].tolist() == [1, 2, 3]


def test_the_attention_metadatas_tensors_hold_the_steps_host_arrays():
    a, b = make_req("a", 6, [1, 2]), make_req("b", 3, [3])
    prep = preparer()
    prep.prepare(schedule([a], [4], new=[a]))
    a.num_computed_tokens = 4
    mi = prep.prepare(schedule([a, b], [2, 3], new=[b]))
    meta, host = mi.attn_metadata, mi.host
    for name in ("seq_lens", "num_computed_tokens", "query_start_loc", "slot_mapping", "block_table"):
        assert getattr(meta, name).tolist() == host[name].tolist(), name
    assert meta.seq_lens.tolist() == [6, 3] and meta.num_computed_tokens.tolist() == [4, 0]
    assert mi.input_ids.tolist() == host["input_ids"].tolist() and mi.positions.tolist() == [4, 5, 0, 1, 2]
    assert meta.num_reqs == 2 and meta.num_actual_tokens == 5 and meta.max_query_len == 3 and meta.max_seq_len == 6


def test_one_sampled_row_makes_the_step_not_all_greedy():
    meta = preparer().sampling_metadata(f32(0.0, 0.8, 0.0))
    assert not meta.all_greedy and not meta.argmax_only
    assert meta.temperature.tolist() == [0.0, pytest.approx(0.8), 0.0]


def test_each_seeded_rows_generator_is_kept_at_its_row():
    gen = torch.Generator().manual_seed(3)
    meta = preparer().sampling_metadata(f32(0.7, 0.7), generators={1: gen})
    assert meta.generators.keys() == {1} and meta.generators[1] is gen


def test_filters_no_row_uses_come_out_none_and_used_ones_keep_every_row():
    prep = preparer()
    off = prep.sampling_metadata(f32(1.0, 1.0), np.array([0, 0]), f32(1.0, 1.0), min_p=f32(0.0, 0.0))
    assert off.top_k is None and off.top_p is None and off.min_p is None
    on = prep.sampling_metadata(f32(1.0, 1.0), np.array([0, 5]), f32(1.0, 0.5), min_p=f32(0.1, 0.0))
    assert on.top_k.tolist() == [0, 5]
    assert on.top_p.tolist() == [1.0, 0.5]
    assert on.min_p.tolist() == [pytest.approx(0.1), 0.0]


def test_logprobs_zero_asks_for_the_sampled_tokens_logprob_and_rows_keep_their_own_counts():
    meta = preparer().sampling_metadata(f32(0.0, 0.0, 0.0, 0.0), num_logprobs=np.array([-1, 0, -1, 3]))
    assert meta.logprob_rows.tolist() == meta.logprob_rows_cpu.tolist() == [1, 3]
    assert meta.num_logprobs == [0, 3]
    assert not meta.argmax_only, "a greedy step asking for logprobs still computes them"


def test_no_logprobs_asked_leaves_the_logprob_rows_none():
    meta = preparer().sampling_metadata(f32(0.0, 0.0), num_logprobs=np.array([-1, -1]))
    assert meta.logprob_rows is None and meta.logprob_rows_cpu is None and meta.num_logprobs is None
    assert meta.argmax_only


def test_penalties_of_no_rows_are_none_and_a_greedy_step_with_penalties_is_not_argmax_only():
    prep = preparer()
    empty = np.zeros(0, dtype=np.int64)
    assert prep.penalties(empty, np.zeros((0, 4), dtype=np.int64), empty, f32(), f32(), f32()) is None
    pen = prep.penalties(np.array([1]), np.array([[5, 6, -1]]), np.array([2]), f32(0.5), f32(0.0), f32(1.2))
    assert pen.rows.tolist() == [1] and pen.token_ids.tolist() == [[5, 6, -1]]
    assert not prep.sampling_metadata(f32(0.0, 0.0), penalties=pen).argmax_only


def prompt_req(prompt, have=1, num=2):
    """A request asking for ``num`` prompt logprobs that already has the first ``have`` entries."""
    r = Request("r", list(prompt), SamplingParams(prompt_logprobs=num, logprobs=5), arrival_time=0.0)
    r.prompt_logprobs = [None] * have
    return r


def test_prompt_logprobs_of_a_chunk_are_its_positions_predicting_the_next_prompt_token():
    prompt = list(range(100, 108))
    r = prompt_req(prompt)
    # the chunk computes positions 3..5, the first at flat index 7
    meta = preparer().prompt_logprobs_metadata([r], np.array([7]), np.array([3]), np.array([6]))
    assert meta.req_ids == ["r"] and meta.counts == [3] and meta.num_logprobs == [2]
    assert meta.indices.tolist() == [7, 8, 9]
    assert meta.token_ids.tolist() == prompt[4:7]


def test_prompt_logprobs_stop_before_the_last_prompt_token_and_skip_what_the_request_has():
    prompt = list(range(100, 108))
    r = prompt_req(prompt, have=5)  # positions 0..3 already have theirs
    meta = preparer().prompt_logprobs_metadata([r], np.array([0]), np.array([2]), np.array([8]))
    assert meta.counts == [3] and meta.indices.tolist() == [2, 3, 4]
    assert meta.token_ids.tolist() == prompt[5:8]
    done = prompt_req(prompt, have=8)
    assert preparer().prompt_logprobs_metadata([done], np.array([0]), np.array([7]), np.array([8])) is None
