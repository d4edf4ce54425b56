"""``SamplingParams(n > 1)`` under both preparers: v1 runs n requests sharing the prefix cache,
v0 prefills once, samples the prompt's logits n times and forks the sequences, which share the
prompt's blocks until each writes into the shared partial block and gets a copy."""
from __future__ import annotations

import pytest
import torch

from framework import EXECUTORS, LLM, PREPARERS, LLMEngine, SamplingParams
from framework.common.sampling_params import RequestOutputKind
from framework.execution.executors.model import ModelExecutor
from framework.testing.registries import forget_registrations

BS = 4


def llm(preparer, **kw):
    args = dict(model="tiny-llama", preparer=preparer, max_model_len=128, block_size=BS, max_num_batched_tokens=256,
                check_invariants=True, seed=0)
    args.update(kw)
    return LLM(**args)


def prompt(n, start=5):
    return {"prompt_token_ids": list(range(start, start + n))}


def token_lists(out):
    return [o.token_ids for o in out.outputs]


def test_tpot_and_itl_of_n_samples_are_a_sequences_pace():
    # Simulated, so every step of the same batch shape takes the same time.
    engine = LLM(model="qwen2-7b", executor="sim")
    params = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    one = engine.generate(prompt(10), SamplingParams(**params))[0].metrics
    two = engine.generate(prompt(10, start=50), SamplingParams(n=2, **params))[0].metrics
    assert two.num_generated_tokens == 10 and len(two.token_times) == 5 and min(two.itl) > 0
    assert two.tpot == pytest.approx(one.tpot, rel=0.1)  # two decodes a step cost about what one does


@pytest.mark.parametrize("preparer", PREPARERS.list())
def test_n_samples_have_one_token_time_per_step(preparer):
    """On the wall clock too: v0's forks used to time their first tokens apart from the leader's
    (one clock reading per fork), adding n - 1 near-zero ITLs and cutting TPOT by a third."""
    engine = llm(preparer)
    out = engine.generate(prompt(10), SamplingParams(n=4, max_tokens=5, temperature=1.0, ignore_eos=True))[0]
    assert out.metrics.num_generated_tokens == 20 and len(out.metrics.token_times) == 5
    assert out.metrics.first_token_time == out.metrics.token_times[0]


@pytest.mark.parametrize("preparer", PREPARERS.list())
def test_n_samples_are_distinct_when_sampling_and_identical_when_greedy(preparer):
    engine = llm(preparer)
    greedy = SamplingParams(n=4, max_tokens=10, temperature=0.0, ignore_eos=True)
    one = engine.generate(prompt(10), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    out = engine.generate(prompt(10), greedy)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert token_lists(out) == [one.outputs[0].token_ids] * 4
    sampled = engine.generate(prompt(10), SamplingParams(n=4, max_tokens=10, temperature=1.0, ignore_eos=True))[0]
    seqs = token_lists(sampled)
    assert all(len(s) == 10 for s in seqs) and len({tuple(s) for s in seqs}) == 4
    assert all(o.finish_reason == "length" for o in sampled.outputs) and sampled.metrics.num_generated_tokens == 40


@pytest.mark.parametrize("kw", [{}, {"num_gpu_blocks_override": 40}, {"max_num_seqs": 3}],
                         ids=["roomy", "preempting", "few-seats"])
def test_v0_forks_sample_exactly_what_v1_requests_sample(kw):
    """With per-sample seeds the two designs draw the same noise, so any difference would come
    from the KV cache: a missed or misplaced copy-on-write changes the tokens."""
    prompts = [prompt(n, start=7 * n) for n in (3, 8, 10, 13, 21)]  # partial and block-aligned last blocks
    params = [SamplingParams(n=4, max_tokens=12, temperature=0.9, seed=100 * i, ignore_eos=True) for i in range(5)]
    engines = {p: llm(p, **kw) for p in ("v0", "v1")}
    steps = []
    engines["v0"].engine.step_callbacks.append(lambda stats, out: steps.append(out))
    outs = {p: [token_lists(o) for o in e.generate(prompts, params)] for p, e in engines.items()}
    assert outs["v0"] == outs["v1"]
    assert all(len({tuple(s) for s in group}) == 4 for group in outs["v0"])
    v0 = engines["v0"].engine
    assert v0.allocator.stats.cow_copies > 0
    if "num_gpu_blocks_override" in kw:
        assert v0.scheduler.num_preemptions > 0
    if "max_num_seqs" in kw:  # forks found no seat, waited, and were prefilled on their own
        assert any(r.index > 0 for out in steps for r in out.resumed_requests)


class Recorder:
    """Wraps the runner's preparer to see every step's inputs with the block books of that step."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []
        runner = engine.executor.runner
        inner = runner.preparer.prepare

        def prepare(out):
            mi = inner(out)
            alloc = engine.allocator
            owners = {r.request_id: list(r.block_ids) for r in out.scheduled}
            refs = {b: alloc._blocks[b].ref_count for blocks in owners.values() for b in blocks}
            self.steps.append((out, mi, owners, refs))
            return mi

        runner.preparer.prepare = prepare


class SubclassedModelExecutor(ModelExecutor):
    """The model executor under a name of a researcher's own (to time its steps, say)."""


def test_a_subclass_of_the_model_executor_forks_v0_samples_as_the_model_executor_does(monkeypatch):
    """The engine forked parallel samples only for the executor named "model": a subclass ran
    v0's n samples as n requests, prefilling the prompt n times."""
    forget_registrations(monkeypatch, EXECUTORS)
    EXECUTORS.register("test_subclassed_model")(SubclassedModelExecutor)
    runs = {}
    for executor in ("model", "test_subclassed_model"):
        engine = llm("v0", executor=executor, enable_prefix_caching=False)
        prefill = []
        engine.engine.step_callbacks.append(lambda stats, out: prefill.append(stats.num_prefill_tokens))
        out = engine.generate(prompt(11), SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5, ignore_eos=True))
        runs[executor] = (token_lists(out[0]), sum(prefill))
    assert runs["test_subclassed_model"] == runs["model"]
    assert runs["model"][1] == 11  # one prefill of the prompt for all three samples


def test_copy_on_write_stores_shared_blocks_once_and_diverges_into_private_blocks():
    engine = llm("v0").engine
    alloc, runner = engine.allocator, engine.executor.runner
    rec = Recorder(engine)
    prompt_len = 10  # blocks: 2 full + 1 holding tokens 8 and 9
    engine.add_request("g", list(range(20, 20 + prompt_len)), SamplingParams(n=4, max_tokens=9, temperature=1.0))

    engine.step()  # the leader's prefill; its logits are sampled 4 times, then 3 sequences fork
    out, mi, _, _ = rec.steps[0]
    assert [r.request_id for r in out.scheduled] == ["g#0"] and mi.sample_req_ids == ["g#0", "g#1", "g#2", "g#3"]
    assert mi.logits_indices.tolist() == [prompt_len - 1] * 4
    seqs = sorted(engine.scheduler.running, key=lambda r: r.index)
    prompt_blocks = list(seqs[0].block_ids)
    assert len(seqs) == 4 and all(s.block_ids == prompt_blocks for s in seqs)
    assert [alloc._blocks[b].ref_count for b in prompt_blocks] == [4, 4, 4], "shared, stored once"
    assert alloc.num_used_blocks == 3

    engine.step()  # every sequence writes token 10 into the shared partial block
    out, mi, owners, refs = rec.steps[1]
    shared_tail = prompt_blocks[2]
    assert len(out.blocks_to_copy) == 3 and {src for src, _ in out.blocks_to_copy} == {shared_tail}
    tails = [owners[s.request_id][2] for s in seqs]
    assert len(set(tails)) == 4, "each sequence ends up with its own copy of the partial block"
    assert all(owners[s.request_id][:2] == prompt_blocks[:2] for s in seqs)
    assert [alloc._blocks[b].ref_count for b in prompt_blocks[:2]] == [4, 4]
    kv = runner.kv_cache  # [2, layers, blocks, block_size, heads, dim]
    for _, dst in out.blocks_to_copy:  # the copies kept the prompt's two tokens of that block
        assert torch.equal(kv[:, :, dst, :2], kv[:, :, shared_tail, :2])

    while engine.has_unfinished_requests():
        engine.step()
    outs = {}
    for out, mi, owners, refs in rec.steps[1:]:
        pos, slots = mi.host["positions"].tolist(), mi.host["slot_mapping"].tolist()
        for i, rid in enumerate(mi.req_ids):
            block = slots[i] // BS
            assert pos[i] >= prompt_len and block == owners[rid][pos[i] // BS], "writes land in the request's block"
            assert refs[block] == 1, f"{rid} writes position {pos[i]} into block {block}, shared by others"
            outs.setdefault(rid, set()).add(block)
    later = [outs[s.request_id] - set(prompt_blocks[:2]) for s in seqs]
    assert all(not (a & b) for i, a in enumerate(later) for b in later[i + 1:]), "no block written by two sequences"
    assert alloc.num_used_blocks == 0 and alloc.stats.cow_copies == 3


def test_block_aligned_prompt_needs_no_copy():
    engine = llm("v0").engine
    rec = Recorder(engine)
    engine.add_request("g", list(range(20, 28)), SamplingParams(n=3, max_tokens=6, temperature=1.0))
    engine.step()
    shared = list(engine.scheduler.running[0].block_ids)
    assert [engine.allocator._blocks[b].ref_count for b in shared] == [3, 3]
    while engine.has_unfinished_requests():
        engine.step()
    assert all(not out.blocks_to_copy for out, *_ in rec.steps) and engine.allocator.stats.cow_copies == 0


def test_v0_samples_that_finish_on_their_first_token_never_hold_blocks():
    engine = llm("v0")
    out = engine.generate(prompt(6), SamplingParams(n=3, max_tokens=1, temperature=1.0))[0]
    assert out.finished and [len(t) for t in token_lists(out)] == [1, 1, 1]
    assert all(o.finish_reason == "length" for o in out.outputs)
    assert engine.engine.allocator.stats.cow_copies == 0


@pytest.mark.parametrize("preparer", PREPARERS.list())
def test_ignored_and_aborted_groups_finish_every_sample(preparer):
    engine = llm(preparer, max_model_len=64).engine
    engine.add_request("long", list(range(3, 3 + 80)), SamplingParams(n=3))
    engine.add_request("cut", list(range(3, 13)), SamplingParams(n=3, max_tokens=50))
    engine.abort_request("cut")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [o.finish_reason for o in finished["long"].outputs] == ["length"] * 3
    assert "max_model_len=64" in finished["long"].status_message
    assert [o.finish_reason for o in finished["cut"].outputs] == ["abort"] * 3


def test_v0_abort_after_the_fork_frees_every_shared_block():
    engine = llm("v0").engine
    engine.add_request("g", list(range(3, 14)), SamplingParams(n=4, max_tokens=50, temperature=1.0))
    engine.step()
    engine.step()
    assert engine.allocator.num_used_blocks > 0
    engine.abort_request("g")
    outs = engine.step()
    assert outs[0].finished and [o.finish_reason for o in outs[0].outputs] == ["abort"] * 4
    assert all(len(o.token_ids) == 2 for o in outs[0].outputs)
    assert engine.allocator.num_used_blocks == 0


def sampled_until_different_steps(**params):
    """An engine with one request of two samples that finish at different steps (stop tokens on every 7th id)."""
    engine = LLMEngine(model="tiny-llama", max_model_len=128)
    vocab = engine.model_config.vocab_size
    engine.add_request("r", [5, 6, 7], SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=3, ignore_eos=True,
                                                      stop_token_ids=list(range(0, vocab, 7)), **params))
    return engine


def test_a_final_only_request_of_two_samples_gives_one_output_once_both_finished():
    engine = sampled_until_different_steps(output_kind=RequestOutputKind.FINAL_ONLY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = outputs
    lengths = [len(c.token_ids) for c in final.outputs]
    assert final.finished and len(set(lengths)) == 2


def test_two_samples_metrics_take_every_steps_token_and_the_first_token_of_either():
    engine = sampled_until_different_steps()
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    lengths = [len(c.token_ids) for c in final.outputs]
    m = final.metrics
    assert len(set(lengths)) == 2 and len(m.token_times) == max(lengths)  # one a step, while either sample ran
    assert m.first_token_time == min(m.token_times)


def test_the_first_token_time_of_samples_run_one_after_another_is_the_earliest():
    engine = LLMEngine(model="tiny-llama", max_model_len=128, max_num_seqs=1)
    engine.add_request("r", [5, 6, 7], SamplingParams(n=2, max_tokens=5, temperature=0.0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.metrics.first_token_time == min(final.metrics.token_times)


def test_a_v0_request_of_several_samples_ignored_on_arrival_is_finished_at_once():
    engine = LLMEngine(model="tiny-llama", max_model_len=32, preparer="v0")
    engine.add_request("r", list(range(5, 45)), SamplingParams(n=3, max_tokens=4, temperature=0.0))
    assert engine.is_finished("r")
