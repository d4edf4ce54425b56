"""Async scheduling (``EngineConfig.async_scheduling``): step N+1 is scheduled and launched while step N runs,
N's sampled tokens placeholders until known. Outputs must be the synchronous engine's, request for request."""
import random

import pytest
import torch

from framework import LLM, EngineConfig, LLMEngine, SamplingParams
from framework.common.clock import VirtualClock
from framework.common.request import PLACEHOLDER, Request
from framework.execution.executor import EXECUTORS
from framework.execution.model_runner import ModelRunner
from framework.testing.shadow import ShadowExecutor, reference_output
from framework.testing.parity import hf_greedy
from framework.testing.registries import forget_registrations
from tests.conftest import step_through_interrupts

PARAMS = {
    "greedy": lambda rng, i: SamplingParams(max_tokens=rng.randrange(1, 50), temperature=0.0, ignore_eos=True),
    "stop tokens": lambda rng, i: SamplingParams(max_tokens=rng.randrange(1, 50), temperature=0.0,
                                                 stop_token_ids=[7, 11, 13, 17, 19, 23, 29]),
    "seeded": lambda rng, i: SamplingParams(max_tokens=rng.randrange(1, 50), temperature=1.0, top_k=50, seed=i,
                                            ignore_eos=True),
    "logprobs": lambda rng, i: SamplingParams(max_tokens=rng.randrange(1, 25), temperature=0.0, logprobs=2,
                                              prompt_logprobs=1 if i % 3 == 0 else None, ignore_eos=True),
    "penalties": lambda rng, i: SamplingParams(max_tokens=rng.randrange(1, 25), temperature=0.0,
                                               repetition_penalty=1.3 if i % 2 else 1.0, ignore_eos=True),
}
SHORT_OF_BLOCKS = {  # each preempts (by recompute or swap) with 19 usable blocks of 16 tokens
    "fcfs": {},
    "priority_swap": {},
    "chunked": {"max_num_batched_tokens": 16},
}


def generate(async_scheduling, params, policy="fcfs", device="cpu", num_requests=24, **kwargs):
    """Requests sharing prefixes of one another, run to the end; their outputs and the engine."""
    config = dict(model="tiny-llama", max_model_len=256, block_size=16, max_num_batched_tokens=256, max_num_seqs=8,
                  num_gpu_blocks_override=20, seed=0, check_invariants=True, policy=policy, device=device,
                  async_scheduling=async_scheduling)
    llm = LLM(**{**config, **kwargs})
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [shared[:rng.randrange(0, 40)] + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))]
               for _ in range(num_requests)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params(rng, i) for i in range(num_requests)],
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, _flat(o.outputs[0].logprobs), _flat(o.prompt_logprobs))
            for o in outs], llm.engine


def _flat(logprobs):
    """Logprobs as (token ids, values) per position."""
    if logprobs is None:
        return None
    return [None if d is None else (list(d), [p.logprob for p in d.values()]) for d in logprobs]


@pytest.mark.parametrize("policy", SHORT_OF_BLOCKS)
@pytest.mark.parametrize("kind", PARAMS)
def test_async_outputs_are_the_synchronous_ones_through_preemption_swaps_and_prefix_hits(policy, kind):
    """Tokens, finish reasons, logprobs and prompt logprobs, request for request, with the invariants checked
    every step; the engines preempt (swap, for priority_swap) and hit cached prefixes."""
    want, sync = generate(False, PARAMS[kind], policy, **SHORT_OF_BLOCKS[policy])
    got, engine = generate(True, PARAMS[kind], policy, **SHORT_OF_BLOCKS[policy])
    assert engine.async_scheduling and not sync.async_scheduling
    assert_same_outputs(got, want)
    assert engine.scheduler.num_preemptions > 0 and engine.allocator.stats.prefix_hit_tokens > 0
    if policy == "priority_swap":
        assert engine.scheduler.num_swap_outs > 0
    alloc = engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks


def assert_same_outputs(got, want):
    """Tokens, finish reasons and logprobs' token ids equal; logprob values within float32 noise (the
    runs' batches differ)."""
    def values(outputs):
        return [v for out in outputs for lps in out[2:] for pos in lps or () if pos for v in pos[1]]

    def shape(outputs):
        return [(tokens, reason, *[[pos and pos[0] for pos in lps] if lps else lps for lps in rest])
                for tokens, reason, *rest in outputs]

    assert shape(got) == shape(want)
    assert values(got) == pytest.approx(values(want), abs=1e-4)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_async_outputs_are_the_synchronous_ones_with_inputs_packed_as_for_a_gpu(monkeypatch, kind):
    """Off the CPU a step's arrays, the deferred tokens' indices among them, go to the device in one packed
    transfer: forced here on the CPU, the async engine still gives the synchronous outputs."""
    from framework.execution.input_preparer import InputPreparer

    init = InputPreparer.__init__

    def packing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.on_cpu = False

    monkeypatch.setattr(InputPreparer, "__init__", packing)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    want, _ = generate(False, PARAMS[kind], "chunked", max_num_batched_tokens=16)
    deferred = []
    run = ModelRunner._run

    def recorded(self, inputs):
        deferred.append(inputs.deferred_tokens is not None and inputs.deferred_tokens.untyped_storage().data_ptr()
                        == inputs.input_ids.untyped_storage().data_ptr())
        return run(self, inputs)

    monkeypatch.setattr(ModelRunner, "_run", recorded)
    got, engine = generate(True, PARAMS[kind], "chunked", max_num_batched_tokens=16)
    assert engine.async_scheduling and not engine.executor.runner.preparer.on_cpu
    assert_same_outputs(got, want)
    assert sum(deferred) > len(deferred) / 2, "most steps should read deferred tokens from the packed transfer"


def test_async_greedy_outputs_are_transformers(llama_ckpt):
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), backend="naive", block_size=4, max_model_len=64, max_num_seqs=3,
              async_scheduling=True, check_invariants=True)
    prompts = [list(range(10, 13)), list(range(40, 60)), list(range(60, 65)), list(range(40, 62))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (2, 9, 1, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, s.max_tokens)
                                                      for p, s in zip(prompts, params)]


def test_a_request_whose_token_in_flight_is_its_last_is_not_scheduled_again():
    """Capped by max_tokens, a request leaves the batch once its last token is in flight: it runs as many
    steps as without async scheduling. One stopped by a stop token runs one step more (its token was unknown)."""
    scheduled = {}
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, async_scheduling=async_scheduling))
        engine.step_callbacks.append(lambda stats, out: [scheduled.setdefault(async_scheduling, []).append(r.request_id)
                                                         for r in out.scheduled])
        engine.add_request("capped", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.step()  # collects a step still in flight
        assert len(outs["capped"].outputs[0].token_ids) == 5
    assert scheduled[True].count("capped") == scheduled[False].count("capped") == 5


def test_a_request_stopped_by_its_token_in_flight_wastes_one_step_and_nothing_else():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, async_scheduling=True,
                                    check_invariants=True))
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("free", [5, 6, 7], free)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    stop = tokens[0][3]
    scheduled = []
    engine.step_callbacks.append(lambda stats, out: scheduled.extend(r.request_id for r in out.scheduled))
    engine.add_request("stopped", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    engine.step()
    assert outs[0].outputs[0].token_ids == tokens[0][:tokens[0].index(stop) + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert scheduled.count("stopped") == tokens[0].index(stop) + 2  # the prompt, each token, one wasted


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_aborted_while_its_prompt_chunk_runs_takes_its_prompt_logprobs_with_it(async_scheduling):
    """Aborted while its prompt chunk (asking for prompt logprobs) runs, a request's entries are dropped when
    the chunk's results arrive: the engine steps on, and the other request's tokens are the undisturbed run's."""
    def run(abort):
        engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=256, block_size=16, max_num_batched_tokens=32,
                                        max_num_seqs=4, num_gpu_blocks_override=20, seed=0, policy="chunked",
                                        async_scheduling=async_scheduling, check_invariants=True))
        engine.add_request("other", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        engine.add_request("r", list(range(3, 103)), SamplingParams(max_tokens=4, prompt_logprobs=1))
        engine.step()
        engine.step()
        if abort:
            assert engine.scheduler.requests["r"].num_computed_tokens < 100, "r should be mid-prompt"
            engine.abort_request("r")
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks
        return outs

    outs, undisturbed = run(abort=True), run(abort=False)
    assert outs["r"].outputs[0].finish_reason == "abort"
    assert outs["other"].outputs[0].token_ids == undisturbed["other"].outputs[0].token_ids
    assert PLACEHOLDER not in outs["other"].outputs[0].token_ids


def test_an_aborted_request_ends_at_its_known_tokens():
    """Aborted while a token is in flight, a request's output holds no placeholder and its blocks are freed."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, async_scheduling=True,
                                    check_invariants=True))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.requests["a"].num_placeholders == 1
    engine.abort_request("a")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    engine.step()
    aborted = outs["a"].outputs[0]
    assert aborted.finish_reason == "abort" and PLACEHOLDER not in aborted.token_ids and len(aborted.token_ids) == 3
    assert len(outs["b"].outputs[0].token_ids) == 20
    assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks


def test_a_block_ending_in_a_placeholder_is_cached_once_its_token_is_known():
    """The block a sampled token completes is sealed for the prefix cache only when that token is known
    (a later request with the same tokens then hits it); never with the placeholder's id."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, block_size=4, async_scheduling=True,
                                    check_invariants=True))
    engine.add_request("first", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    engine.step()
    tokens = [5, 6, 7] + outs[0].outputs[0].token_ids  # blocks [5, 6, 7, t0], [t1, t2, t3, t4]
    hit_before = engine.allocator.stats.prefix_hit_tokens
    engine.add_request("again", tokens[:8] + [9], SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert engine.allocator.stats.prefix_hit_tokens - hit_before == 8


def test_async_scheduling_is_refused_where_it_cannot_run_and_off_by_default_on_a_cpu():
    with pytest.raises(ValueError, match=r"^async_scheduling=true cannot run with preparer=v0, which does not defer "
                                         r"sampled tokens \(v1 does\): set async_scheduling to auto or false$"):
        LLMEngine(EngineConfig(model="tiny-llama", preparer="v0", async_scheduling=True))
    with pytest.raises(ValueError, match=r"^async_scheduling must be auto, true or false, got 'yes'$"):
        EngineConfig(async_scheduling="yes")
    assert not LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, device="cpu")).async_scheduling
    assert not LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, preparer="v0")).async_scheduling


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "torch_paged"])
def test_on_a_gpu_async_outputs_are_the_synchronous_ones(backend):
    """On CUDA (the default there), graphs replayed for decode steps, through preemption and swaps."""
    for kind in ("greedy", "seeded"):
        # float32: batches differ between the runs, and bfloat16 rounding would flip near ties.
        want, sync = generate(False, PARAMS[kind], "priority_swap", device="cuda", backend=backend, dtype="float32")
        got, engine = generate("auto", PARAMS[kind], "priority_swap", device="cuda", backend=backend, dtype="float32")
        assert engine.async_scheduling, kind
        assert_same_outputs(got, want)
        assert engine.scheduler.num_swap_outs > 0


class StepFailed(Exception):
    pass


class FailingShadow(ShadowExecutor):
    """The shadow engine (each request must read its own tokens back) whose launches number ``fail`` write no KV
    and raise when collected: a sticky device error also fails the step launched behind the failed one."""

    fail = (2, 3)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launches = 0

    def launch(self, out):
        self.launches += 1
        return "failed" if self.launches in self.fail else super().launch(out)

    def collect(self, handle):
        if handle == "failed":
            raise StepFailed
        return handle


@pytest.mark.parametrize("gone", ["aborted", "preempted"])
def test_blocks_a_failed_step_was_to_fill_leave_the_prefix_cache_though_their_request_let_them_go(monkeypatch,
                                                                                                    gone):
    """R's prefill (launch 2) fails on the device, found only when launch 3 is collected. Meanwhile R let its
    blocks go: aborted by the client, or preempted by X's decode when the 5 blocks run out. Those blocks were
    sealed for the prefix cache when R was scheduled; left there, a later prompt like R's (or R recomputed)
    would take them as a hit and read KV never written, which the shadow executor asserts against."""
    forget_registrations(monkeypatch, EXECUTORS)
    EXECUTORS.register("test_failing_shadow")(FailingShadow)
    engine = LLMEngine(EngineConfig(model="tiny-llama", executor="test_failing_shadow", policy="chunked",
                                    executor_options={"num_blocks": 5}, block_size=4, max_model_len=16,
                                    max_num_batched_tokens=16, max_num_seqs=8, check_invariants=True,
                                    async_scheduling=True), clock=VirtualClock())
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {"X": list(range(3, 10)), "R": list(range(20, 28))}  # R: two full blocks
    engine.add_request("X", prompts["X"], params)
    engine.step()  # launch 1: X's prefill
    engine.add_request("R", prompts["R"], params)
    engine.step()  # launch 2: X's decode and R's prefill, which fails
    if gone == "aborted":
        engine.abort_request("R")
        prompts["again"] = prompts.pop("R")
        engine.add_request("again", prompts["again"], params)
    with pytest.raises(StepFailed):
        engine.step()  # launch 3 (preempting R for X's next block); collecting launch 2 raises
    probe = Request("probe", list(range(20, 28)), params, arrival_time=0.0)
    assert engine.allocator.find_prefix(probe).num_tokens == 0, "R's unwritten blocks are still cached"
    outs, _ = step_through_interrupts(engine)
    assert {rid: outs[rid].outputs[0].token_ids for rid in prompts} == {
        rid: reference_output(prompt, params, 16) for rid, prompt in prompts.items()}
    assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks
