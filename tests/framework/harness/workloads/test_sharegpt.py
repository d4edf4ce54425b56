"""ShareGPT conversations: tokenised with the checkpoint's tokenizer when it has one."""
import json

import pytest
from transformers import AutoTokenizer

from framework.harness.workload import WorkloadContext, create_workload
from framework.harness.workloads.text import tokenize


def conversations(n):
    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": " ".join(f"w{(i * 7 + j) % 400}" for j in range(5 + i))},
        {"from": "gpt", "value": " ".join(f"w{j}" for j in range(6 + 2 * i))}]} for i in range(n)]
    convs.append({"id": "lonely", "conversations": [{"from": "human", "value": "w1 w2 w3 w4 w5"}]})
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w1 w2 w3 w4"}]})
    return convs


@pytest.fixture
def sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations(12)))
    return path


def generate(path, ctx, **options):
    workload, _ = create_workload({"name": "sharegpt", "path": str(path), **options})
    return workload.generate(ctx)


def test_tokenised_with_the_checkpoint_tokenizer(sharegpt_file, llama_ckpt):
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt[0]))
    ctx = WorkloadContext(vocab_size=512, tokenizer=tok)
    reqs = generate(sharegpt_file, ctx, num_requests=12, max_output_len=20)
    by_text = {c["conversations"][0]["value"]: c for c in conversations(12)}
    assert len(reqs) == 12 and all(r.prompt in by_text for r in reqs)  # single-turn and too-short skipped
    for r in reqs:
        conv = by_text[r.prompt]["conversations"]
        assert r.prompt_token_ids == tok.encode(conv[0]["value"])
        assert r.output_len == min(len(tok.encode(conv[1]["value"])), 20)


def test_without_tokenizer_one_id_per_word_and_deterministic(sharegpt_file):
    ctx = WorkloadContext(vocab_size=1024)
    a = generate(sharegpt_file, ctx, num_requests=5, rate=4.0, seed=3)
    assert a == generate(sharegpt_file, ctx, num_requests=5, rate=4.0, seed=3)
    assert [r.prompt for r in a] != [r.prompt for r in generate(sharegpt_file, ctx, num_requests=5, seed=4)]
    for r in a:
        assert r.prompt_token_ids == tokenize(r.prompt, ctx) and r.prompt_len == len(r.prompt.split())
    assert all(x.arrival_time < y.arrival_time for x, y in zip(a, a[1:]))
    assert {r.output_len for r in generate(sharegpt_file, ctx, num_requests=5, output_len=9)} == {9}


def test_a_fixed_output_len_is_taken_as_given(sharegpt_file):
    # min_len and max_output_len bound the completions' own lengths, as in vLLM's benchmark;
    # a fixed length is the experimenter's choice, below min_len or above the cap.
    ctx = WorkloadContext(vocab_size=1024)
    assert {r.output_len for r in generate(sharegpt_file, ctx, num_requests=4, output_len=2)} == {2}
    assert {r.output_len for r in generate(sharegpt_file, ctx, num_requests=4, output_len=20, max_output_len=5)} == {20}


def test_filters_and_errors(sharegpt_file, tmp_path):
    ctx = WorkloadContext(vocab_size=1024, max_model_len=24)
    reqs = generate(sharegpt_file, ctx, num_requests=3)
    assert all(r.prompt_len + r.output_len <= 24 for r in reqs)
    with pytest.raises(ValueError, match="only .* usable conversations for num_requests=50"):
        generate(sharegpt_file, ctx, num_requests=50)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"from": "human"}]}]))
    with pytest.raises(ValueError, match="entry 0 is not a conversation"):
        generate(bad, ctx)


def test_a_pair_is_kept_only_while_prompt_and_output_fit_max_model_len(tmp_path):
    def pair(prompt, output):
        return {"conversations": [{"from": "human", "value": " ".join(["w"] * prompt)},
                                  {"from": "gpt", "value": " ".join(["w"] * output)}]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps([pair(10, 10), pair(10, 11), pair(12, 10)]))
    ctx = WorkloadContext(vocab_size=1024, max_model_len=20)
    assert [(r.prompt_len, r.output_len) for r in generate(path, ctx, num_requests=1)] == [(10, 10)]
    with pytest.raises(ValueError, match="only 1 usable conversations for num_requests=2"):
        generate(path, ctx, num_requests=2)


@pytest.mark.parametrize("min_len", [0, "abc", 2.5])
def test_min_len_must_be_a_positive_integer(sharegpt_file, min_len):
    with pytest.raises(ValueError, match="min_len must be a positive integer"):
        generate(sharegpt_file, WorkloadContext(vocab_size=1024), min_len=min_len)


def test_the_shipped_sample_loads():
    reqs = generate("conf/workload/samples/sharegpt.json", WorkloadContext(vocab_size=1024), num_requests=16)
    assert len(reqs) == 16


def words(n):
    return " ".join(["w"] * n)


def test_min_len_and_max_prompt_len_skip_pairs_at_their_bounds(tmp_path):
    def pair(prompt, output):
        return {"conversations": [{"from": "human", "value": words(prompt)}, {"from": "gpt", "value": words(output)}]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps([pair(3, 8), pair(8, 3), pair(4, 4), pair(9, 8), pair(8, 8)]))
    ctx = WorkloadContext(vocab_size=1024)
    kept = generate(path, ctx, num_requests=2, min_len=4, max_prompt_len=8)
    assert sorted((r.prompt_len, r.output_len) for r in kept) == [(4, 4), (8, 8)]
    with pytest.raises(ValueError, match="only 2 usable conversations"):
        generate(path, ctx, num_requests=3, min_len=4, max_prompt_len=8)
    # A fixed output length leaves the completions' own lengths unchecked.
    assert len(generate(path, ctx, num_requests=3, min_len=4, max_prompt_len=8, output_len=5)) == 3
