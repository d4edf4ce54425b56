"""The worked examples of seeds 000 and 001 through the v0 preparer: the same numbers as v1's,
laid out prefills first, with the SequenceGroupMetadata v0's scheduler would have built."""
import numpy as np

from framework import LLM, SamplingParams
from framework.execution.preparers.v0 import SequenceGroupPreparer
from tests.framework.execution.preparers.support import (assert_equivalent, make_req, preparer_pair, schedule, seed_000_requests,
                                               seed_000_step_2)


def meta_summary(metas):
    return [(m.request_id, m.is_prompt, list(m.seq_data), m.token_chunk_size, m.do_sample, m.computed_block_nums)
            for m in metas]


def test_seed_000_steps_1_and_2():
    v0, v1 = preparer_pair(2, max_num_reqs=4, max_model_len=12, max_num_batched_tokens=10)
    r0, r1, r2 = seed_000_requests()
    out = schedule([r0, r1, r2], [3, 2, 5], new=[r0, r1, r2])
    metas = v0.to_metadata(out)
    sid = {rid: seq.seq_id for rid, seq in v0.seqs.items()}
    assert meta_summary(metas) == [("0", True, [sid["0"]], 3, True, []), ("1", True, [sid["1"]], 2, True, []),
                                   ("2", True, [sid["2"]], 5, False, [])]
    assert metas[2].block_tables == {sid["2"]: [4, 5, 6]}
    mi = v0.build(metas)
    step1 = mi.host
    assert mi.req_ids == ["0", "1", "2"]
    assert step1["positions"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert step1["input_ids"].tolist() == [100, 101, 102, 100, 101, 100, 101, 102, 103, 104]
    assert step1["slot_mapping"].tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert step1["query_start_loc"].tolist() == [0, 3, 5, 10]
    assert step1["seq_lens"].tolist() == [3, 2, 5]
    assert step1["logits_indices"].tolist() == [2, 4] and mi.sample_req_ids == ["0", "1"]
    assert step1["block_table"].tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    assert_equivalent(mi, v1.prepare(out))

    # Step 2: 0 and 1 decode their sampled token (v0: decode groups, after the prompt of 2).
    out = seed_000_step_2(r0, r1, r2)
    metas = v0.to_metadata(out)
    assert meta_summary(metas) == [("2", True, [sid["2"]], 3, True, [4, 5]), ("0", False, [sid["0"]], 1, True, []),
                                   ("1", False, [sid["1"]], 1, True, [])]
    assert v0.seqs["0"].data.output_token_ids == [500]
    mi = v0.build(metas)
    step2 = mi.host
    assert mi.req_ids == ["2", "0", "1"]
    assert step2["positions"].tolist() == [5, 6, 7, 3, 2]
    assert step2["input_ids"].tolist() == [105, 106, 107, 500, 501]
    assert step2["slot_mapping"].tolist() == [13, 16, 17, 5, 14]
    assert step2["query_start_loc"].tolist() == [0, 3, 4, 5]
    assert step2["seq_lens"].tolist() == [8, 4, 3]
    assert step2["logits_indices"].tolist() == [2, 3, 4] and mi.sample_req_ids == ["2", "0", "1"]
    assert (mi.attn_metadata.num_prefills, mi.attn_metadata.num_prefill_tokens,
            mi.attn_metadata.num_decode_tokens) == (1, 3, 2)
    assert_equivalent(mi, v1.prepare(out))


def test_seed_001_five_requests():
    bs = 16
    v0, v1 = preparer_pair(bs, max_num_reqs=8, max_model_len=240, max_num_batched_tokens=200)
    reqs = [
        make_req("0", 55, range(1, 5), num_computed=54, num_outputs=1),     # decode
        make_req("1", 146, range(5, 15), num_computed=145, num_outputs=1),  # decode
        make_req("2", 93, range(15, 21)),                                   # full prefill
        make_req("3", 75, range(21, 26)),                                   # full prefill
        make_req("4", 120, range(26, 28)),                                  # chunked prefill: 30 of 120
    ]
    out = schedule(reqs, [1, 1, 93, 75, 30], new=reqs)
    metas = v0.to_metadata(out)
    assert [(m.request_id, m.is_prompt, m.token_chunk_size, m.do_sample) for m in metas] == [
        ("2", True, 93, True), ("3", True, 75, True), ("4", True, 30, False), ("0", False, 1, True), ("1", False, 1, True)]
    mi = v0.build(metas)
    host = mi.host
    assert mi.req_ids == ["2", "3", "4", "0", "1"]
    # The seed's slots, request by request: 2 in blocks 15-20, 3 in 21-25, 4 in 26-27, then the
    # decodes at 70 (block 4, offset 6) and 225 (block 14, offset 1).
    assert host["slot_mapping"].tolist() == (list(range(240, 333)) + list(range(336, 411)) + list(range(416, 446))
                                             + [70, 225])
    assert host["positions"].tolist() == list(range(93)) + list(range(75)) + list(range(30)) + [54, 145]
    assert host["query_start_loc"].tolist() == [0, 93, 168, 198, 199, 200]
    assert host["seq_lens"].tolist() == [93, 75, 30, 55, 146]
    assert host["num_computed_tokens"].tolist() == [0, 0, 0, 54, 145]
    assert host["logits_indices"].tolist() == [92, 167, 198, 199] and mi.sample_req_ids == ["2", "3", "0", "1"]
    expected_table = np.zeros((5, 10), dtype=np.int64)
    for i, r in enumerate([reqs[k] for k in (2, 3, 4, 0, 1)]):
        expected_table[i, : len(r.block_ids)] = r.block_ids
    assert np.array_equal(host["block_table"], expected_table)
    meta = mi.attn_metadata
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decode_tokens) == (3, 198, 2)
    assert (meta.max_query_len, meta.max_seq_len) == (93, 146)
    assert_equivalent(mi, v1.prepare(out))


def test_prefix_cache_hit_is_a_computed_block_and_the_chunk_starts_after_it():
    v0, v1 = preparer_pair(4, max_num_reqs=2, max_model_len=64, max_num_batched_tokens=64)
    r = make_req("p", 11, [7, 3, 9], num_computed=8)  # two cached blocks, three tokens to compute
    out = schedule([r], [3], new=[r])
    (meta,) = v0.to_metadata(out)
    assert meta.is_prompt and meta.computed_block_nums == [7, 3] and meta.token_chunk_size == 3
    mi = v0.build([meta])
    assert mi.host["positions"].tolist() == [8, 9, 10] and mi.host["slot_mapping"].tolist() == [36, 37, 38]
    assert_equivalent(mi, v1.prepare(out))


def test_the_v0_preparer_lets_go_of_every_finished_requests_group():
    llm = LLM(model="tiny-llama", preparer="v0", max_model_len=64)
    preparer = llm.engine.executor.runner.preparer
    assert isinstance(preparer, SequenceGroupPreparer)
    for _ in range(3):
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(preparer.groups) <= 4  # at most the last batch's, dropped by the next step that runs
