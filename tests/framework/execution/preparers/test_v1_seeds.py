"""The worked examples of seeds 000 and 001 must come out exactly."""
import numpy as np
import pytest

from framework.execution.preparers.v1 import FlatBatchPreparer
from tests.framework.execution.preparers.support import (assert_equivalent, make_req, preparer_pair, record, schedule,
                                               seed_000_requests, seed_000_step_2)


@pytest.mark.parametrize("runner_records", [True, False], ids=["runner-records-sampled", "read-from-requests"])
def test_seed_000_steps_1_and_2(runner_records):
    prep = FlatBatchPreparer(max_num_reqs=4, max_model_len=12, block_size=2, max_num_batched_tokens=10, check=True)
    r0, r1, r2 = seed_000_requests()
    mi = prep.prepare(schedule([r0, r1, r2], [3, 2, 5], new=[r0, r1, r2]))
    step1 = mi.host
    assert step1["req_indices"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert step1["positions"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert step1["token_indices"].tolist() == [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]
    assert step1["block_table_indices"].tolist() == [0, 0, 1, 6, 6, 12, 12, 13, 13, 14]
    assert step1["block_numbers"].tolist() == [1, 1, 2, 3, 3, 4, 4, 5, 5, 6]
    assert step1["block_offsets"].tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert step1["slot_mapping"].tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert step1["query_start_loc"].tolist() == [0, 3, 5, 10]
    assert step1["seq_lens"].tolist() == [3, 2, 5]
    assert step1["num_computed_tokens"].tolist() == [0, 0, 0]
    assert step1["input_ids"].tolist() == [100, 101, 102, 100, 101, 100, 101, 102, 103, 104]
    # Request 2 is mid-prompt (3 tokens left): it does not sample.
    assert step1["logits_indices"].tolist() == [2, 4]
    assert prep.block_table[:4, :6].tolist() == [[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0],
                                                [4, 5, 6, 0, 0, 0], [0, 0, 0, 0, 0, 0]]

    # Step 2: requests 0 and 1 decode their sampled token, request 2 finishes its prompt; blocks
    # 7 and 8 are allocated to requests 1 and 2. In an engine the runner reports the sampled
    # tokens right after sampling; otherwise the rows catch up from the requests.
    if runner_records:
        record(prep, mi, {"0": 500, "1": 501})
        assert prep.token_ids[:2, :4].tolist() == [[100, 101, 102, 500], [100, 101, 501, 0]]
    step2 = prep.prepare(seed_000_step_2(r0, r1, r2)).host
    assert prep.block_table[:3, :6].tolist() == [[1, 2, 0, 0, 0, 0], [3, 7, 0, 0, 0, 0], [4, 5, 6, 8, 0, 0]]
    assert step2["positions"].tolist() == [3, 2, 5, 6, 7]
    assert step2["input_ids"].tolist() == [500, 501, 105, 106, 107]
    assert step2["block_table_indices"].tolist() == [1, 7, 14, 15, 15]
    assert step2["slot_mapping"].tolist() == [5, 14, 13, 16, 17]
    assert step2["query_start_loc"].tolist() == [0, 1, 2, 5]
    assert step2["seq_lens"].tolist() == [4, 3, 8]
    assert step2["logits_indices"].tolist() == [0, 1, 4]


def test_seed_001_five_requests():
    bs, max_len = 16, 240
    prep = FlatBatchPreparer(max_num_reqs=8, max_model_len=max_len, block_size=bs, max_num_batched_tokens=200,
                             check=True)
    reqs = [
        make_req("0", 55, range(1, 5), num_computed=54),     # decode
        make_req("1", 146, range(5, 15), num_computed=145),  # decode
        make_req("2", 93, range(15, 21)),                    # full prefill
        make_req("3", 75, range(21, 26)),                    # full prefill
        make_req("4", 120, range(26, 28)),                   # chunked prefill: 30 of 120
    ]
    host = prep.prepare(schedule(reqs, [1, 1, 93, 75, 30], new=reqs)).host
    M, K = max_len, 15
    assert host["req_indices"].tolist() == [0, 1] + [2] * 93 + [3] * 75 + [4] * 30
    assert host["cu_num_tokens"].tolist() == [1, 2, 95, 170, 200]
    assert host["arange"].tolist() == [0, 0] + list(range(93)) + list(range(75)) + list(range(30))
    positions = [54, 145] + list(range(93)) + list(range(75)) + list(range(30))
    assert host["positions"].tolist() == positions
    assert host["token_indices"].tolist() == ([54, 145 + M] + [p + 2 * M for p in range(93)]
                                              + [p + 3 * M for p in range(75)] + [p + 4 * M for p in range(30)])
    bti = host["block_table_indices"].tolist()
    assert bti[:3] == [3, 24, 30] and bti[94] == 35 and bti[95] == 45 and bti[169] == 49
    assert bti[170] == 60 and bti[-1] == 61
    assert bti == [r * K + p // bs for r, p in zip(host["req_indices"].tolist(), positions)]
    numbers = host["block_numbers"].tolist()
    assert numbers[:3] == [4, 14, 15] and numbers[94] == 20 and numbers[95] == 21
    assert numbers[169] == 25 and numbers[170] == 26 and numbers[-1] == 27
    assert host["block_offsets"].tolist()[:4] == [6, 1, 0, 1]
    slots = host["slot_mapping"].tolist()
    assert slots[:4] == [70, 225, 240, 241]
    assert slots[94] == 332 and slots[95:97] == [336, 337] and slots[169] == 410
    assert slots[170:172] == [416, 417] and slots[-1] == 445
    assert host["query_start_loc"].tolist() == [0, 1, 2, 95, 170, 200]
    assert host["seq_lens"].tolist() == [55, 146, 93, 75, 30]
    # Requests 0-3 reach their last token and sample; the chunked request 4 does not.
    assert host["logits_indices"].tolist() == [0, 1, 94, 169]
    expected_table = np.zeros((5, 10), dtype=np.int64)
    for i, r in enumerate(reqs):
        expected_table[i, : len(r.block_ids)] = r.block_ids
    assert np.array_equal(host["block_table"], expected_table)


def test_rows_are_dropped_and_reused_with_null_padding():
    prep = FlatBatchPreparer(max_num_reqs=2, max_model_len=8, block_size=2, max_num_batched_tokens=8, check=True)
    a, b = make_req("a", 6, [1, 2, 3]), make_req("b", 2, [4])
    prep.prepare(schedule([a, b], [6, 2], new=[a, b]))
    c = make_req("c", 2, [5])
    out = schedule([c], [2], new=[c])
    out.finished_req_ids = {"a"}
    host = prep.prepare(out).host
    assert prep.row_of == {"b": 1, "c": 0}
    assert prep.block_table[0].tolist() == [5, 0, 0, 0]
    assert host["slot_mapping"].tolist() == [10, 11]


def test_seed_001_index_identities_hold_when_rows_are_not_in_step_order():
    """Seed 001 defines ``token_indices = req_indices * M + positions`` and ``block_table_indices =
    req_indices * K + positions // block_size``, ``block_numbers`` being the block table at those
    indices. Once a freed row is reused the step's order is not the rows' order; the identities
    must still hold, ``req_indices`` naming each token's batch row."""
    bs = 2
    prep = FlatBatchPreparer(max_num_reqs=2, max_model_len=8, block_size=bs, max_num_batched_tokens=8, check=True)
    a, b = make_req("a", 2, [1]), make_req("b", 4, [2, 4])
    prep.prepare(schedule([a, b], [2, 2], new=[a, b]))
    b.num_computed_tokens = 2
    c = make_req("c", 2, [3])
    out = schedule([b, c], [2, 2], new=[c])
    out.finished_req_ids = {"a"}
    host = prep.prepare(out).host
    assert prep.row_of == {"b": 1, "c": 0}
    req_indices, positions = host["req_indices"], host["positions"]
    assert req_indices.tolist() == [1, 1, 0, 0] and positions.tolist() == [2, 3, 0, 1]
    width, K = prep.token_ids.shape[1], prep.max_blocks_per_req
    assert host["token_indices"].tolist() == (req_indices * width + positions).tolist()
    assert host["block_table_indices"].tolist() == (req_indices * K + positions // bs).tolist()
    assert host["block_numbers"].tolist() == prep.block_table.ravel()[host["block_table_indices"]].tolist() == [4, 4, 3, 3]
    assert host["input_ids"].tolist() == prep.token_ids.ravel()[host["token_indices"]].tolist() == [102, 103, 100, 101]
    assert host["arange"].tolist() == [0, 1, 0, 1]


def test_copy_on_write_replacement_rewrites_the_row():
    prep = FlatBatchPreparer(max_num_reqs=2, max_model_len=8, block_size=2, max_num_batched_tokens=8, check=True)
    r = make_req("r", 3, [1, 2], num_computed=2)
    prep.prepare(schedule([r], [1], new=[r]))
    # The step computed token 2; token 3 is sampled and goes into block 2, shared with another
    # sequence: the allocator gave r a private copy (block 5) and queued the copy 2 -> 5.
    r.num_computed_tokens = 3
    r.token_ids.append(500)
    r.block_ids[1] = 5
    out = schedule([r], [1])
    out.blocks_to_copy = [(2, 5)]
    host = prep.prepare(out).host
    assert prep.block_table[prep.row_of["r"]].tolist() == [1, 5, 0, 0]
    assert host["slot_mapping"].tolist() == [11]


def _real_scheduler(block_size, budget, max_model_len, num_blocks):
    """The engine's scheduler with the chunked policy (vLLM v1's) and the paged allocator."""
    from framework.kv.allocators.paged import PagedBlockAllocator
    from framework.common.clock import VirtualClock
    from framework.common.config import EngineConfig
    from framework.scheduling.policy import POLICIES
    from framework.scheduling.scheduler import Scheduler

    config = EngineConfig(block_size=block_size, max_num_seqs=8, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, check_invariants=True)
    return Scheduler(config, POLICIES.create("chunked"), PagedBlockAllocator(num_blocks, block_size), VirtualClock())


def _prompt(i, n):
    from framework.common.request import Request
    from framework.common.sampling_params import SamplingParams

    # Disjoint token ids per request, so no prefix is shared and blocks go out in order.
    return Request(str(i), list(range(1000 * (i + 1), 1000 * (i + 1) + n)),
                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), arrival_time=0.0)


def _run(sched, prep, out, v0=None):
    """One step as the engine runs it: prepare, sample (token 7), record, fold back. A ``v0``
    preparer given too must describe the same step, request by request."""
    mi = prep.prepare(out)
    if v0 is not None:
        assert_equivalent(v0.prepare(out), mi)
    prep.record_sampled(mi, np.full(len(mi.sample_req_ids), 7, dtype=np.int64))
    sched.update_from_output(out, {rid: 7 for rid in mi.sample_req_ids})
    return mi


def test_seed_000_comes_out_of_the_real_scheduler_and_allocator():
    """Seed 000 end to end: a token budget of 10 schedules {0: 3, 1: 2, 2: 5} (request 2 is left
    with 3 prompt tokens), blocks are handed out in order from block 1, and step 2 gives block 7
    to request 1 and block 8 to request 2."""
    sched = _real_scheduler(block_size=2, budget=10, max_model_len=12, num_blocks=16)
    reqs = [_prompt(i, n) for i, n in enumerate([3, 2, 8])]
    for r in reqs:
        sched.add_request(r)
    v0, prep = preparer_pair(2, max_num_reqs=4, max_model_len=12, max_num_batched_tokens=10)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 3, "1": 2, "2": 5}
    mi = _run(sched, prep, out, v0)
    meta, host = mi.attn_metadata, mi.host
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len) == (3, 10, 5)
    assert host["req_indices"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert host["positions"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert host["block_table_indices"].tolist() == [0, 0, 1, 6, 6, 12, 12, 13, 13, 14]
    assert host["block_numbers"].tolist() == [1, 1, 2, 3, 3, 4, 4, 5, 5, 6]
    assert host["block_offsets"].tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert host["slot_mapping"].tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert host["query_start_loc"].tolist() == [0, 3, 5, 10]
    assert host["seq_lens"].tolist() == [3, 2, 5]
    assert host["num_computed_tokens"].tolist() == [0, 0, 0]
    assert prep.block_table[:4].tolist() == [[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0],
                                             [4, 5, 6, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 3}
    _run(sched, prep, out, v0)
    assert prep.block_table[:3].tolist() == [[1, 2, 0, 0, 0, 0], [3, 7, 0, 0, 0, 0], [4, 5, 6, 8, 0, 0]]


def test_seed_001_comes_out_of_the_real_scheduler_and_allocator():
    """Seed 001 end to end: requests 0 and 1 have computed 54 and 145 tokens and decode;
    requests 2, 3 and 4 arrive; the budget of 200 gives them 93, 75 and 30 tokens, and the
    blocks are allocated sequentially: 1-4, 5-14, 15-20, 21-25, 26-27."""
    bs, max_len = 16, 240
    sched = _real_scheduler(block_size=bs, budget=200, max_model_len=max_len, num_blocks=64)
    v0, prep = preparer_pair(bs, max_num_reqs=8, max_model_len=max_len, max_num_batched_tokens=200)
    r0, r1 = _prompt(0, 54), _prompt(1, 145)
    sched.add_request(r0)
    sched.add_request(r1)
    _run(sched, prep, sched.schedule(), v0)  # their prompts: 54 + 145 tokens, then one sampled token each
    assert (r0.num_computed_tokens, r1.num_computed_tokens) == (54, 145)
    reqs = [r0, r1] + [_prompt(i, n) for i, n in ((2, 93), (3, 75), (4, 120))]
    for r in reqs[2:]:
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 93, "3": 75, "4": 30}
    assert [len(r.block_ids) for r in reqs] == [4, 10, 6, 5, 2]
    assert [r.block_ids for r in reqs] == [list(range(1, 5)), list(range(5, 15)), list(range(15, 21)),
                                           list(range(21, 26)), [26, 27]]
    mi = _run(sched, prep, out, v0)
    host = mi.host
    positions = [54, 145] + list(range(93)) + list(range(75)) + list(range(30))
    assert host["cu_num_tokens"].tolist() == [1, 2, 95, 170, 200]
    assert host["positions"].tolist() == positions
    assert host["block_offsets"].tolist() == [p % bs for p in positions]
    assert host["block_offsets"].tolist()[:4] == [6, 1, 0, 1]
    assert host["block_table_indices"].tolist() == ([3, 24] + [30 + p // bs for p in range(93)]
                                                    + [45 + p // bs for p in range(75)] + [60 + p // bs for p in range(30)])
    assert host["block_numbers"].tolist() == ([4, 14] + [15 + p // bs for p in range(93)]
                                              + [21 + p // bs for p in range(75)] + [26 + p // bs for p in range(30)])
    assert host["slot_mapping"].tolist() == ([70, 225] + list(range(240, 333)) + list(range(336, 411))
                                             + list(range(416, 446)))
    assert host["query_start_loc"].tolist() == [0, 1, 2, 95, 170, 200]
    assert host["seq_lens"].tolist() == [55, 146, 93, 75, 30]
    meta = mi.attn_metadata
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (5, 200, 93, 146)
    assert prep.block_table[:5].tolist() == [r.block_ids + [0] * (15 - len(r.block_ids)) for r in reqs]
