"""Seeds 000 and 003's worked examples through the public engine, as a user builds it: the policy, allocator and
preparer the engine makes must lay out the seeds' steps (the preparer tests build those parts by hand)."""
import pytest

from framework import LLMEngine, SamplingParams


def engine_recording(**kw):
    """An engine, and the list each step's model input (``ModelInput``) is appended to."""
    engine = LLMEngine(model="tiny-llama", dtype="float32", seed=0, backend="naive", check_invariants=True, **kw)
    preparer = engine.executor.runner.preparer
    inputs, prepare = [], preparer.prepare
    preparer.prepare = lambda out: inputs.append(prepare(out)) or inputs[-1]
    return engine, inputs


def drain(engine):
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seed_000_through_the_engine(async_scheduling):
    # Block size 2, budget 10: prompts of 3, 2 and 8 tokens; the third is chunked (5, then 3). The seed's
    # prompts all start 100, 101: with prefix caching the later ones would hit the first one's block.
    engine, inputs = engine_recording(policy="chunked", preparer="v1", enable_prefix_caching=False, block_size=2,
                                      max_num_seqs=4, max_num_batched_tokens=10, max_model_len=12,
                                      num_gpu_blocks_override=16, async_scheduling=async_scheduling)
    for i, n in enumerate([3, 2, 8]):
        engine.add_request(str(i), {"prompt_token_ids": [100 + j for j in range(n)]},
                           SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    step1, step2 = (inputs[0].host, inputs[1].host)
    assert step1["positions"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert step1["block_numbers"].tolist() == [1, 1, 2, 3, 3, 4, 4, 5, 5, 6]
    assert step1["slot_mapping"].tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert step1["query_start_loc"].tolist() == [0, 3, 5, 10]
    assert step1["seq_lens"].tolist() == [3, 2, 5]
    assert step1["logits_indices"].tolist() == [2, 4]
    # Blocks 7 and 8 go to requests 1 and 2 as they grow past their last ones.
    assert list(inputs[1].req_ids) == ["0", "1", "2"]
    assert step2["positions"].tolist() == [3, 2, 5, 6, 7]
    assert step2["slot_mapping"].tolist() == [5, 14, 13, 16, 17]
    assert step2["query_start_loc"].tolist() == [0, 1, 2, 5]
    assert step2["seq_lens"].tolist() == [4, 3, 8]
    drain(engine)


@pytest.mark.parametrize("preparer", ["v1", "v0"])
def test_seed_003_prefix_hit_computes_only_the_uncached_tail(preparer):
    # Block size 4: a 9-token prompt fills two blocks and starts a third; the same prompt arriving while the
    # first decodes takes the two full blocks from the cache and computes its ninth token alone.
    engine, inputs = engine_recording(policy="chunked", preparer=preparer, enable_prefix_caching=True, block_size=4,
                                      max_num_seqs=4,
                                      max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks_override=20)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = list(range(20, 29))
    engine.add_request("A", {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.add_request("B", {"prompt_token_ids": prompt}, params)
    engine.step()
    a, b = engine.scheduler.requests["A"], engine.scheduler.requests["B"]
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    assert b.num_cached_tokens == 8
    row = list(inputs[-1].req_ids).index("B")
    host = inputs[-1].host
    start, end = host["query_start_loc"][row:row + 2].tolist()
    assert host["positions"][start:end].tolist() == [8]
    assert host["slot_mapping"][start:end].tolist() == [b.block_ids[2] * 4]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert outputs["A"] == outputs["B"]
    assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks
