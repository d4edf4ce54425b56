"""The worked examples of seeds 000 and 001 must come out exactly."""
import numpy as np
import pytest

from framework.preparers.v1 import FlatBatchPreparer
from tests.framework.preparers.support import make_req, record, schedule, seed_000_requests, seed_000_step_2


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
