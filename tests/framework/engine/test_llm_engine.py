import errno

import numpy as np
import pytest
import torch

from framework import LLM, EngineConfig, LLMEngine, SamplingParams, UnknownNameError
from framework.common.clock import VirtualClock
from framework.common.registry import BadOptionsError
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import RequestOutputKind
from framework.engine.output_processor import OutputProcessor
from framework.testing.parity import hf_greedy
from tests.conftest import step_through_interrupts


def small_llm(**kw):
    args = dict(max_model_len=256, block_size=16, max_num_batched_tokens=256, max_num_seqs=8, seed=0)
    args.update(kw)
    return LLM(model="tiny-llama", **args)


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [80, 64])
def test_a_prompt_leaving_no_room_for_output_is_ignored_with_reason(prompt_len):
    llm = small_llm(max_model_len=64, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + prompt_len))}, {"prompt_token_ids": [5, 6, 7]},
                         {"prompt_token_ids": list(range(3, 3 + 63))}], GREEDY)
    assert outs[0].finished and outs[0].outputs[0].token_ids == []
    assert outs[0].outputs[0].finish_reason == "length"
    assert "max_model_len=64" in outs[0].status_message
    assert len(outs[1].outputs[0].token_ids) == 6
    assert len(outs[2].outputs[0].token_ids) == 1  # up to max_model_len


def test_fcfs_with_a_token_budget_below_max_model_len_is_refused_when_built():
    # Built, it would drop every prompt longer than the budget; vLLM refuses it too.
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens=32 is below max_model_len=256 and policy 'fcfs' "
                                         r"prefills each prompt whole.*lower max_model_len to <= 32.*chunked\)$"):
        small_llm(max_num_batched_tokens=32)
    assert small_llm(max_num_batched_tokens=32, max_model_len=32).engine.config.max_num_batched_tokens == 32
    assert small_llm(max_num_batched_tokens=32, policy="chunked").engine.config.max_model_len == 256
    # Left out, the budget is vLLM v0's: 2048, or max_model_len for a policy that prefills whole prompts.
    assert small_llm(max_num_batched_tokens=None, max_model_len=4096).engine.config.max_num_batched_tokens == 4096
    assert small_llm(max_num_batched_tokens=None, policy="chunked").engine.config.max_num_batched_tokens == 2048
    assert LLM(model="tiny-llama").engine.config.max_num_batched_tokens == 4096  # the preset's context


def test_prompt_longer_than_token_budget_is_ignored_by_fcfs():
    # An engine told the longest prompt it will get (a run knows its workload's) may keep a smaller budget.
    config = dict(model="tiny-llama", max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8)
    engine = LLMEngine(EngineConfig(**config), max_prompt_len=32)
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens=32 is below the longest prompt sent \(33 tokens\)"):
        LLMEngine(EngineConfig(**config), max_prompt_len=33)
    engine.add_request("r", list(range(3, 50)), GREEDY)
    (out,) = engine.step()
    assert "max_num_batched_tokens=32" in out.status_message and "does not chunk" in out.status_message


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 2, 5000]}, "5000 is out of the vocabulary"),
    ({"prompt_token_ids": [-1]}, "out of the vocabulary"),
    ("some text", "has no tokenizer"),
    ({"tokens": [1]}, "prompt_token_ids"),
    ({"prompt_token_ids": [3, 4.5]}, "float"),
    ({"prompt_token_ids": [True, False]}, "a bool is not a token id"),
    ({"prompt_token_ids": [np.int64(3), True]}, "a bool is not a token id"),
    ({"prompt_token_ids": [3, np.bool_(True)]}, "numpy.bool"),
    ({"prompt_token_ids": 7}, "not iterable"),
    ({"prompt_token_ids": np.array([3, 5000], dtype=np.int32)}, "5000 is out of the vocabulary"),
    ({"prompt_token_ids": np.array([3, -2])}, "-2 is out of the vocabulary"),
    ({"prompt_token_ids": np.array([3.0, 4.0])}, "1-D integer array"),
    ({"prompt_token_ids": np.array([[3, 4]])}, "1-D integer array"),
    ({"prompt_token_ids": np.array([], dtype=np.int64)}, "empty"),
    # These used to be tokenized as text ("has no tokenizer", or transformers' own error) or, bytes,
    # taken as token ids.
    (None, "a prompt is text"),
    ({"prompt": None}, "a prompt is text"),
    ({"prompt": 7}, "a prompt is text"),
    ({"prompt_token_ids": None}, "a prompt is text"),
    (b"\x05\x06", "a prompt is text"),
])
def test_bad_prompts_raise_clear_errors_and_queue_nothing(prompt, match):
    llm = small_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [4, 5]}, prompt], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_token_ids_as_numpy_arrays_or_numpy_scalars_are_plain_ints_inside():
    llm = small_llm()
    as_list = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, GREEDY)[0]
    for ids in (np.array([5, 6, 7, 8], dtype=np.int32), list(np.array([5, 6, 7, 8])), np.array([5, 6, 7, 8], dtype=np.uint16)):
        llm.engine.add_request("r", {"prompt_token_ids": ids}, GREEDY)
        (req,) = llm.engine.scheduler.requests.values()
        assert all(type(t) is int for t in req.token_ids)
        while llm.engine.has_unfinished_requests():
            out = llm.engine.step()
        assert out[0].prompt_token_ids == [5, 6, 7, 8] and out[0].outputs[0].token_ids == as_list.outputs[0].token_ids


def test_generate_takes_numpy_token_ids_as_one_prompt():
    """A list of numpy ints (or a 1-D array) is one prompt, as a list of ints is: it used to be
    taken for a list of prompts, each failing with "'numpy.int64' object is not iterable"."""
    llm = small_llm()
    (plain,) = llm.generate([5, 6, 7, 8], GREEDY)
    for prompt in (list(np.array([5, 6, 7, 8])), np.array([5, 6, 7, 8], dtype=np.int32), [np.int64(5), 6, 7, 8]):
        (out,) = llm.generate(prompt, GREEDY)
        assert out.prompt_token_ids == [5, 6, 7, 8] and out.outputs[0].token_ids == plain.outputs[0].token_ids
    # A 2-D array is a list of prompts, one per row.
    assert [o.outputs[0].token_ids for o in llm.generate(np.array([[5, 6, 7, 8], [5, 6, 7, 8]]), GREEDY)] == \
        [plain.outputs[0].token_ids] * 2


def test_generate_takes_a_1d_torch_tensor_as_one_prompt():
    """A 1-D tensor of token ids (a tokenizer's input_ids[0]) is one prompt, as a 1-D numpy array
    is: it used to be taken for a list of prompts, each failing with "iteration over a 0-d tensor"."""
    import torch

    llm = small_llm()
    (plain,) = llm.generate([5, 6, 7, 8], GREEDY)
    for prompt in (torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7, 8], dtype=torch.int32),
                   {"prompt_token_ids": torch.tensor([5, 6, 7, 8])}):
        (out,) = llm.generate(prompt, GREEDY)
        assert out.prompt_token_ids == [5, 6, 7, 8] and out.outputs[0].token_ids == plain.outputs[0].token_ids
    # A 2-D tensor is a list of prompts, one per row.
    assert [o.outputs[0].token_ids for o in llm.generate(torch.tensor([[5, 6, 7, 8]] * 2), GREEDY)] == \
        [plain.outputs[0].token_ids] * 2
    with pytest.raises(ValueError, match="must be integers"):
        llm.generate(torch.tensor([5.0, 6.0]), GREEDY)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "nope"}, "registered policies: .*fcfs"),
    ({"backend": "nope"}, "registered backends: .*naive"),
    ({"allocator": "nope"}, "registered allocators: .*paged"),
    ({"preparer": "nope"}, "registered preparers: .*v1"),
])
def test_unknown_component_names_list_registered_ones(kwargs, match):
    with pytest.raises(UnknownNameError, match=match):
        small_llm(**kwargs)


class OutOfMemoryError(RuntimeError):
    """Named as torch's CUDA one."""


@pytest.mark.parametrize("error", [OSError(errno.ENOMEM, "Cannot allocate memory"), MemoryError(),
                                   OutOfMemoryError("CUDA out of memory")])
def test_a_kv_cache_that_does_not_fit_in_memory_names_the_setting(monkeypatch, error):
    """Allocating the cache ran out of memory (a mapping the OS refused, past the host's memory): a one-line
    error naming the setting that sized it, not a traceback."""
    from framework.execution.executors.model import ModelExecutor

    def refuse(self, num_blocks, num_cpu_blocks):
        raise error

    monkeypatch.setattr(ModelExecutor, "initialize", refuse)
    with pytest.raises(ValueError, match=r"^the KV cache of \d+ blocks x 16 tokens does not fit in cpu memory "
                                         rf"\({type(error).__name__}\); lower kv_cache_memory_gb \(now 0.5\)$"):
        small_llm(block_size=16, kv_cache_memory_gb=0.5)
    monkeypatch.setattr(ModelExecutor, "initialize", lambda *a: (_ for _ in ()).throw(OSError(errno.EACCES, "no")))
    with pytest.raises(PermissionError):  # not memory: as raised
        small_llm(block_size=16, kv_cache_memory_gb=0.5)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 12}, "power of two"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"num_gpu_blocks_override": 4}, "less than one request of max_model_len=256"),
    # A budget below one block: no negative block count, and the setting that sized the cache named.
    ({"cpu_kv_cache_gb": 1e-6}, r"holds 0 blocks .*; raise cpu_kv_cache_gb \(now 1e-06"),
    ({"kv_cache_memory_gb": 1e-6}, r"holds 0 blocks .*; raise kv_cache_memory_gb \(now 1e-06\)"),
    ({"num_gpu_blocks_override": 3}, r"raise num_gpu_blocks_override \(now 3\) or lower max_model_len"),
    ({"max_model_len": 100_000}, "exceeds the model's max_position_embeddings"),
    ({"policy_options": {"bogus": 1}}, "bogus"),
    ({"num_gpu_blocks_override": 2.5}, "num_gpu_blocks_override must be an integer"),
    ({"cpu_kv_cache_gb": 0}, "cpu_kv_cache_gb must be a number > 0"),
    ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
    ({"model_seed": -1}, "model_seed must be an integer"),
    ({"device": "cuda:x"}, "device must be"),
    ({"num_threads": -1}, "num_threads"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be true or false"),
    ({"block_size": True}, "block_size must be a power of two"),  # a bool is not 1
    ({"max_model_len": True}, "max_model_len must be an integer"),
])
def test_bad_engine_config_fails_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        small_llm(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"allocator_options": {"block_size": 8}}, r"allocator 'paged': block_size is given by the framework"),
    ({"allocator_options": {"enable_prefix_caching": False, "num_blocks": 9}},
     r"allocator 'paged': enable_prefix_caching, num_blocks are given by the framework"),
    ({"backend_options": {"block_size": 8}}, r"backend 'torch_paged': block_size is given by the framework"),
    ({"preparer_options": {"max_model_len": 64}}, r"preparer 'v1': max_model_len is given by the framework"),
    # It overrode check_invariants silently (check_invariants=True, the preparer's checks off).
    ({"preparer_options": {"check": False}}, r"preparer 'v1': check is given by the framework"),
    ({"executor_options": {"config": None}}, r"executor 'model': config is given by the framework"),
])
def test_an_option_the_engine_sets_itself_is_a_one_line_configuration_error(kwargs, match):
    """``+allocator.block_size=8`` failed with Python's "got multiple values for keyword argument"
    TypeError and a traceback, naming neither the part nor why."""
    with pytest.raises(BadOptionsError, match=match):
        small_llm(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"allocator_options": {"promote_duplicat": "oldest"}}, r"allocator 'paged': .*promote_duplicat"),
    # A bad value too: only the names were checked, the value when the KV cache was built, after the model.
    ({"allocator_options": {"promote_duplicate": "middle"}}, "promote_duplicate must be one of 'oldest', 'newest'"),
    ({"preparer_options": {"chek": True}}, r"preparer 'v1': .*chek"),
    ({"preparer": "v0", "preparer_options": {"chek": True}}, r"preparer 'v0': .*chek"),
    ({"backend_options": {"bogus": 1}}, r"backend 'torch_paged': .*bogus"),
])
def test_a_bad_allocator_or_preparer_option_is_refused_before_the_model_is_built(kwargs, match, monkeypatch):
    """Both parts' options are checked before the weights load: a typo costs no load."""
    from framework.execution.executors import model

    def built(*args, **kw):
        raise AssertionError("the model was built before the options were checked")

    monkeypatch.setattr(model.LlamaForCausalLM, "empty_on", built)
    with pytest.raises(ValueError, match=match):
        small_llm(**kwargs)


def test_an_allocator_option_checked_against_its_pool_is_checked_against_the_real_one():
    # Its options were once checked by building a pool of 2 blocks, which refused this allocator's every value.
    from framework import ALLOCATORS
    from framework.kv.allocators.paged import PagedBlockAllocator

    @ALLOCATORS.register("test_reserving")
    class Reserving(PagedBlockAllocator):
        def __init__(self, *args, reserve: int = 4, **kwargs):
            super().__init__(*args, **kwargs)
            if not 0 <= reserve < self.num_usable_blocks:
                raise ValueError(f"reserve must be in [0, {self.num_usable_blocks}), got {reserve}")

    llm = small_llm(allocator="test_reserving", allocator_options={"reserve": 4}, num_gpu_blocks_override=100)
    assert len(llm.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="promote_duplicate must be one of"):  # the base's own, still checked early
        small_llm(allocator="test_reserving", allocator_options={"promote_duplicate": "middle"})


@pytest.mark.parametrize("options, match", [
    ({"backend_options": {"bogus": 1}}, r"backend 'torch_paged': .*bogus"),
    ({"preparer_options": {"bogus": 1}}, r"preparer 'v1': .*bogus"),
])
def test_a_bad_backend_or_preparer_option_is_refused_before_loading(options, match):
    # Only their names had been resolved before loading: a sweep's pre-check let every job run into the error.
    from framework.engine.llm_engine import check_before_loading

    with pytest.raises(ValueError, match=match):
        check_before_loading(EngineConfig(model="tiny-llama", **options))


def test_a_subclass_options_error_lists_its_bases_options_too():
    from framework.common.registry import BadOptionsError
    from framework.execution.attention import BACKENDS
    from backends.torch_paged import TorchPagedBackend

    @BACKENDS.register("test_counting")
    class Counting(TorchPagedBackend):
        def __init__(self, *args, tag: str = "", **kwargs):
            super().__init__(*args, **kwargs)

    with pytest.raises(BadOptionsError, match=r"backend 'test_counting': block_size is given by the framework.*"
                                              r"its options: tag, decode_kernel, prefill_kernel"):
        small_llm(backend="test_counting", backend_options={"block_size": 8})


def test_a_cost_model_option_the_simulator_sets_itself_is_named_as_such():
    with pytest.raises(BadOptionsError, match=r"cost model 'roofline': block_size is given by the framework"):
        LLMEngine(model="tiny-llama", executor="sim",
                  executor_options={"cost_model": {"name": "roofline", "block_size": 32}})


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n must be"), ({"top_k": -5}, "top_k"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": None}, "top_k"), ({"top_k": 2**63}, r"top_k .* below 2\*\*63"),
    ({"max_tokens": True}, "max_tokens"), ({"n": True}, "n must be"),
    ({"seed": 2**70}, "seed"), ({"seed": -2**63 - 1}, "signed 64-bit"), ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": 12}, "stop_token_ids"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"min_p": -0.1}, r"^SamplingParams.min_p must be in \[0, 1\], got -0.1$"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"), ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, r"^SamplingParams.repetition_penalty must be a finite number > 0, got 0$"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"repetition_penalty": True}, "repetition_penalty"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_numbers_are_good_sampling_params():
    p = SamplingParams(top_k=np.int64(3), temperature=np.float32(0.5), seed=np.uint32(7), stop_token_ids=(np.int64(5),))
    assert p.top_k == 3 and p.stop_token_ids == [5] and type(p.stop_token_ids[0]) is int


@pytest.mark.parametrize("n", [1, 2])
def test_a_numpy_seed_samples_as_the_same_int_seed(n):
    # Accepted by SamplingParams, a numpy seed used to fail add_request with a TypeError from
    # torch's manual_seed (n=1) or an OverflowError from seed + i wrapping at 2**63 (n > 1).
    llm = small_llm()
    numpy_seeded, int_seeded = (
        [c.token_ids for c in llm.generate([[4, 5, 6]], SamplingParams(
            n=n, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True))[0].outputs]
        for seed in (np.int64(11), 11))
    assert numpy_seeded == int_seeded


@pytest.mark.parametrize("seed", [-1, np.int64(-1)])
def test_a_seed_of_minus_one_samples_unseeded_as_vllm(seed):
    assert SamplingParams(seed=seed).seed is None
    outputs = []
    for given in (None, seed):  # each from a fresh engine of the same engine seed
        params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=given, ignore_eos=True)
        outputs.append([c.token_ids for c in small_llm().generate([[4, 5, 6]], params)[0].outputs])
    seeded = [c.token_ids for c in small_llm().generate([[4, 5, 6]], SamplingParams(
        n=2, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))[0].outputs]
    assert outputs[0] == outputs[1] != seeded


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.generate([[4, 5], [6, 7]], GREEDY, priority=[0, "high"]), "priority must be a finite number"),
    (lambda llm: llm.generate([[4, 5], [6, 7]], GREEDY, priority=[0, float("nan")]), "priority"),
    (lambda llm: llm.generate([[4, 5], [6, 7]], [GREEDY, {"max_tokens": 3}]), "must be a SamplingParams"),
    (lambda llm: llm.generate([[4, 5]], {"max_tokens": 3}), "sampling_params must be"),
    (lambda llm: llm.generate(5, GREEDY), "prompts must be"),
    # Taken silently, the prompt ran as text alone.
    (lambda llm: llm.generate({"prompt": "x", "multi_modal_data": {}}, GREEDY),
     r"^a prompt dict's key\(s\) multi_modal_data are not supported: it takes 'cache_salt', 'prompt', "
     r"'prompt_token_ids'$"),
    (lambda llm: llm.generate({"prompt_token_ids": [4, 5], "cache_salt": ""}, GREEDY),
     "^cache_salt must be a non-empty string, got ''$"),
    (lambda llm: llm.engine.add_request("r", {"prompt_token_ids": [4, 5], "cache_salt": 7}, GREEDY), "cache_salt"),
    (lambda llm: llm.engine.add_request("r", [4, 5], GREEDY, arrival_time="now"), "arrival_time"),
    (lambda llm: llm.engine.add_request("r", [4, 5], GREEDY, priority=None), "priority"),
    # math.isfinite of it raises OverflowError: a one-line ValueError instead, which the server answers with a 400.
    (lambda llm: llm.engine.add_request("r", [4, 5], GREEDY, priority=10**400), "priority must be a finite number"),
    (lambda llm: llm.engine.abort_request(5), "abort_request takes"),
    # An int id used to be queued, and then could not be aborted (abort_request takes str ids).
    (lambda llm: llm.engine.add_request(5, [4, 5], GREEDY), "request_id must be a str, got int"),
    # Falsy params used to be taken for the defaults (16 sampled tokens) without a word.
    (lambda llm: llm.engine.add_request("r", [4, 5], {}), "must be a SamplingParams, got dict"),
    (lambda llm: llm.engine.add_request("r", [4, 5], []), "must be a SamplingParams, got list"),
    (lambda llm: llm.engine.add_request("r", [4, 5], 0), "must be a SamplingParams, got int"),
])
def test_bad_request_arguments_raise_value_errors_and_queue_nothing(call, match):
    """A priority the scheduler could not compare used to fail mid-step and jam every later step."""
    llm = small_llm(policy="priority_swap")
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[4, 5]], GREEDY, priority=[1])[0].outputs[0].token_ids) == GREEDY.max_tokens


# -- prefix caching -----------------------------------------------------------------------------
def _computed_tokens(llm, prompts, params):
    tokens = []
    llm.engine.step_callbacks.append(lambda s, out: tokens.append(s.num_scheduled_tokens))
    outs = []
    for p in prompts:  # one at a time so later requests can find earlier ones' blocks
        outs += llm.generate({"prompt_token_ids": p}, params)
    return outs, sum(tokens)


def test_shared_prefix_computes_only_the_suffix():
    shared = list(range(10, 10 + 64))  # four full blocks
    prompts = [shared + [200 + i, 300 + i, 400 + i] for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cached_outs, cached_work = _computed_tokens(small_llm(enable_prefix_caching=True), prompts, params)
    plain_outs, plain_work = _computed_tokens(small_llm(enable_prefix_caching=False), prompts, params)
    assert [o.outputs[0].token_ids for o in cached_outs] == [o.outputs[0].token_ids for o in plain_outs]
    assert [o.num_cached_tokens for o in cached_outs] == [0, 64, 64, 64]
    assert plain_work - cached_work == 3 * 64
    assert cached_work == 4 * (67 + 3) - 3 * 64


def test_prefix_cache_hit_rate_is_counted():
    llm = small_llm()
    p = list(range(3, 3 + 40))
    llm.generate({"prompt_token_ids": p}, GREEDY)
    llm.generate({"prompt_token_ids": p}, GREEDY)
    stats = llm.engine.allocator.stats
    assert stats.prefix_query_tokens == 80 and stats.prefix_hit_tokens == 32


def test_a_recomputed_requests_lookup_is_kept_out_of_the_prefix_hit_rate():
    # As vLLM: the blocks a preempted request finds again when it is recomputed measure recompute's reuse, not
    # sharing. Counted in the hit rate, prompts that share nothing showed a rate of 0.22 under memory pressure.
    llm = small_llm(num_gpu_blocks_override=12, max_model_len=64)
    prompts = [list(range(10 * i + 3, 10 * i + 35)) for i in range(6)]  # no two share a block
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stats = llm.engine.allocator.stats
    assert llm.engine.scheduler.num_preemptions > 0 and all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (6 * 32, 0)
    assert stats.preempted_query_tokens > 0 and stats.preempted_hit_tokens > 0


def test_a_cache_salt_shares_cached_prefixes_only_with_its_own_salt():
    # vLLM's cache_salt: tenants of one server do not see each other's prefixes in the cache (or in its timing).
    llm = small_llm()
    prompt = list(range(3, 3 + 67))  # four full blocks of 16 and a partial one
    cached = {salt: [] for salt in ("a", "b", None)}
    for salt in ("a", "b", None, "a", "b", None):
        out = llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, GREEDY)[0]
        cached[salt].append(out.num_cached_tokens)
    assert cached == {"a": [0, 64], "b": [0, 64], None: [0, 64]}
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks - 1


def test_the_prefix_cache_holds_more_than_the_running_requests_can_use():
    # As in vLLM, every block of the budget is in the pool: 2 requests of 64 tokens use at most 8 blocks
    # of 16, yet 12 prompts of 3 blocks each are all still cached for a second pass.
    llm = small_llm(max_model_len=64, max_num_seqs=2, kv_cache_memory_gb=0.01)
    assert llm.engine.allocator.num_usable_blocks > 12 * 3
    prompts = [{"prompt_token_ids": [3 + i] * 48} for i in range(12)]
    llm.generate(prompts, GREEDY)
    stats = llm.engine.allocator.stats
    hits = stats.prefix_hit_tokens
    second = llm.generate(prompts, GREEDY)
    assert stats.prefix_hit_tokens - hits == 12 * 32  # each prompt's two full blocks but the last token's
    assert [o.num_cached_tokens for o in second] == [32] * 12


# -- online API ---------------------------------------------------------------------------------
def test_abort_frees_blocks_and_reports():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=256))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["a"].outputs[0].finish_reason == "abort"
    assert len(finished["a"].outputs[0].token_ids) == 2
    assert finished["b"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
def test_rows_of_requests_that_end_before_an_empty_step_are_dropped(preparer):
    # An abort, or a finish followed by an idle step, leaves a step with nothing to run: the
    # engine skips the executor then, so the rows to drop must reach it with a later step, or
    # every such request keeps a persistent-batch row until the batch is full.
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, max_num_seqs=2, **_preparer(preparer),
                                    check_invariants=True))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"abort{i}", [5, 6, 7], params)
        engine.step()
        engine.abort_request(f"abort{i}")
        engine.step()  # reports the abort; nothing runs
        engine.add_request(f"done{i}", [8, 9], params)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.step() == []  # idle
    runner = engine.executor.runner
    rows = runner.preparer.row_of if preparer != "v0" else runner.preparer.seqs
    # Only the last request's row is left, to be dropped with the next step that runs.
    assert set(rows) <= {"done3"}, f"rows of finished requests kept: {sorted(rows)}"


def test_duplicate_request_id_is_rejected():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=128))
    engine.add_request("x", [5], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [6], GREEDY)
    engine.abort_request("x")
    engine.step()


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
@pytest.mark.parametrize("first, second", [("a#1", "a"), ("a", "a#1")])
def test_a_request_id_clashing_with_a_parallel_sample_is_rejected_with_nothing_queued(preparer, first, second):
    # "a" with n=2 runs sequences "a#0" and "a#1" (v0 forks "a#1" only after the prompt).
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, **_preparer(preparer)))
    params = {"a": SamplingParams(n=2, max_tokens=3, temperature=0.0, ignore_eos=True), "a#1": GREEDY}
    engine.add_request(first, [5, 6, 7], params[first])
    with pytest.raises(ValueError, match="'a#1'"):
        engine.add_request(second, [8, 9], params[second])
    finished = {}
    for _ in range(20):
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {first} and not engine.has_unfinished_requests()


def test_metrics_on_a_virtual_clock():
    clock = VirtualClock()
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=128), clock=clock)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        clock.advance(0.5)
        outs += engine.step()
    m = outs[-1].metrics
    assert m.arrival_time == 0.0 and m.first_scheduled_time == 0.5
    assert m.ttft == 0.5 and m.token_times == [0.5, 1.0, 1.5]
    assert m.tpot == 0.5 and m.itl == [0.5, 0.5] and m.e2el == 1.5
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]


def test_stop_token_and_eos():
    llm = small_llm()
    free = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    stop = tokens[3]
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == tokens[: tokens.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    # An EOS ends it too, with no stop reason (as vLLM), though the token is also a stop token.
    eos = Request("e", [5, 6], SamplingParams(max_tokens=8, stop_token_ids=[2]), 0.0, eos_token_ids=frozenset({2}))
    eos.append_output_token(2, 1.0)
    assert eos.check_stop() == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None


def test_a_delta_request_aborted_after_streaming_ends_with_an_abort():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=128))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                      output_kind=RequestOutputKind.DELTA))
    engine.step()
    engine.step()
    engine.abort_request("r")
    (last,) = engine.step()
    assert last.finished and [(c.token_ids, c.finish_reason) for c in last.outputs] == [([], "abort")]


def test_a_delta_request_finished_by_a_final_only_step_gets_its_whole_output_and_its_id_streams_afresh():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=128))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", [5, 6, 7], params)
    streamed = [t for _ in range(2) for o in engine.step() for t in o.outputs[0].token_ids]
    final = [o for _ in range(5) for o in engine.step(final_only=True)]
    (whole,) = final
    assert len(streamed) == 2 and whole.finished
    assert whole.outputs[0].token_ids[:2] == streamed and len(whole.outputs[0].token_ids) == 5
    engine.add_request("r", [5, 6, 7], params)
    again = [t for _ in range(5) for o in engine.step() for t in o.outputs[0].token_ids]
    assert again == whole.outputs[0].token_ids and not engine.has_unfinished_requests()


def test_generation_stops_at_max_model_len():
    llm = small_llm(max_model_len=32, max_num_batched_tokens=32)
    out = llm.generate({"prompt_token_ids": list(range(3, 3 + 28))},
                       SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
@pytest.mark.parametrize("n", [1, 2])
def test_max_tokens_none_generates_up_to_max_model_len_as_transformers(llama_ckpt, preparer, n):
    """vLLM's max_tokens=None: as many tokens as max_model_len leaves after each prompt."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), **_preparer(preparer), backend="naive", block_size=4, max_model_len=24,
              max_num_batched_tokens=32, max_num_seqs=4, check_invariants=True)
    prompts = [list(range(10, 15)), list(range(40, 60))]
    outs = llm.generate(prompts, SamplingParams(n=n, max_tokens=None, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want = hf_greedy(hf_model, prompt, 24 - len(prompt))
        assert [c.token_ids for c in out.outputs] == [want] * n
        assert [c.finish_reason for c in out.outputs] == ["length"] * n
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks


def test_stop_token_ids_none_is_no_stop_tokens():
    llm = small_llm()
    outs = [llm.generate({"prompt_token_ids": [5, 6, 7]},
                         SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=ids))[0]
            for ids in (None, [])]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids and len(outs[0].outputs[0].token_ids) == 8
    assert outs[0].outputs[0].finish_reason == "length"


def test_max_tokens_none_under_the_simulator_runs_to_max_model_len():
    llm = LLM(model="tiny-llama", executor="sim", max_model_len=40, max_num_batched_tokens=64, max_num_seqs=8)
    outs = llm.generate([list(range(3, 10)), list(range(3, 30))],
                        SamplingParams(n=2, max_tokens=None, temperature=0.0, ignore_eos=True))
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[33, 33], [13, 13]]
    assert {c.finish_reason for o in outs for c in o.outputs} == {"length"}
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks


# -- sampling -----------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_batch_independent():
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = small_llm(seed=1).generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
    crowd = small_llm(seed=2).generate(
        [{"prompt_token_ids": [9, 9, 9, 9]}, {"prompt_token_ids": [5, 6, 7]}],
        [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True), params])[1].outputs[0].token_ids
    assert alone == crowd
    other = small_llm(seed=1).generate({"prompt_token_ids": [5, 6, 7]},
                                       SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other.outputs[0].token_ids != alone


def test_parallel_sampling_n():
    llm = small_llm()
    hot = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(n=4, max_tokens=8, temperature=1.5, seed=7, ignore_eos=True))[0]
    assert [c.index for c in hot.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in hot.outputs}) == 4
    cold = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                        SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in cold.outputs}) == 1
    assert cold.metrics.num_generated_tokens == 24
    # Sample 1 of the largest valid seed takes seed + 1, past the range: it wraps to the smallest.
    top = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(n=2, max_tokens=8, temperature=1.5, seed=2**63 - 1, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in top.outputs}) == 2
    bottom = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                          SamplingParams(max_tokens=8, temperature=1.5, seed=-2**63, ignore_eos=True))[0]
    assert bottom.outputs[0].token_ids == top.outputs[1].token_ids
    # Negative seeds but -1 (unseeded) are seeds, as vLLM's: reproducible, and not seed 2's.
    minus_two, again, two = (llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(
        max_tokens=8, temperature=1.5, seed=seed, ignore_eos=True))[0].outputs[0].token_ids for seed in (-2, -2, 2))
    assert minus_two == again != two


def test_generate_accepts_a_list_of_sampling_params_and_checks_its_length():
    llm = small_llm()
    outs = llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2, temperature=0.0),
                                          SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)])
    assert len(outs[1].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[5], [6], [7]], [GREEDY, GREEDY])


@pytest.mark.parametrize("priority, match", [("high", "priority must be a finite number, got 'high'"),
                                             ([0], "1 priorities for 2 prompts")])
def test_generate_checks_priorities(priority, match):
    llm = small_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate([[5], [6]], GREEDY, priority=priority)
    assert not llm.engine.has_unfinished_requests()


def test_generate_takes_one_priority_for_every_prompt_and_a_tqdm_callable_as_vllm(monkeypatch):
    # A single priority had been refused; a callable use_tqdm ignored (a bar of tqdm's own was shown instead).
    llm = small_llm()
    added, bars = [], []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, priority=0, **k: (added.append(priority),
                                                                                add(*a, priority=priority, **k))[1])

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.done = kwargs, 0
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            pass

    outs = llm.generate([[5], [6], [7]], GREEDY, priority=2, use_tqdm=Bar)
    assert added == [2, 2, 2] and len(outs) == 3
    assert [(b.kwargs["total"], b.done) for b in bars] == [(3, 3)]


def test_scheduler_rejects_a_token_sampled_mid_prompt():
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                                    policy="fcfs"))
    engine.add_request("r", list(range(3, 40)), GREEDY)
    out = engine.scheduler.schedule()
    out.num_scheduled_tokens["r"] = 10  # pretend only a chunk ran, yet a token came back
    with pytest.raises(RuntimeError, match="mid-prompt"):
        engine.scheduler.update_from_output(out, {"r": 7})
    engine.abort_request("r")
    engine.step()


def test_generate_builds_only_final_outputs(monkeypatch):
    """generate reads only finished outputs: it used to build (and detokenize) a cumulative output
    for every running request at every step, quadratic in the output length."""
    llm = small_llm()
    built = []
    original = llm.engine.output_processor._output
    monkeypatch.setattr(llm.engine.output_processor, "_output", lambda rid, children: built.append(rid) or original(rid, children))
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                              SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)])
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [12, 5, 5]
    assert sorted(built) == sorted(o.request_id for o in outs)


def test_engine_refuses_keyword_arguments_beside_a_config():
    """LLMEngine(config, max_model_len=32) used to build the config's engine (max_model_len=64),
    dropping the keyword without a word."""
    with pytest.raises(ValueError, match="not both: set max_model_len, policy in the EngineConfig"):
        LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64), max_model_len=32, policy="chunked")
    assert LLMEngine(model="tiny-llama", max_model_len=32).config.max_model_len == 32


def test_an_interrupted_generate_leaves_nothing_running():
    """generate interrupted (Ctrl-C) mid-run used to leave its requests queued, holding KV blocks:
    the next generate call ran them too, before and beside its own, and dropped their outputs."""
    llm = small_llm()
    steps, interrupted = [], []

    def interrupt(stats, out):
        steps.append(stats.num_scheduled_reqs)
        if len(steps) == 3 and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    llm.engine.step_callbacks.append(interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9], [10, 11, 12]], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    alloc = llm.engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks
    steps.clear()
    (out,) = llm.generate([5, 6, 7], GREEDY)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert len(steps) == GREEDY.max_tokens and max(steps) == 1  # only its own request ran


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
@pytest.mark.parametrize("interrupted_forward", [1, 2])
def test_prompts_rerun_after_a_forward_pass_interrupted_match_transformers(llama_ckpt, preparer, interrupted_forward):
    """Ctrl-C inside a forward pass: the step had already entered the blocks it was filling in the
    prefix cache, so running the same prompts again read their never-computed KV as cached."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), **_preparer(preparer), backend="naive", policy="chunked", block_size=4,
              max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4, check_invariants=True)
    prompts = [list(range(10, 40)), list(range(40, 60)), list(range(60, 65)), list(range(70, 100))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _interrupt(llm.engine.executor.runner.model, "forward", when={interrupted_forward})
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 4) for p in prompts]


def _preparer(name: str) -> dict:
    """Engine arguments of a preparer parameter: ``v1-async`` is v1 with async scheduling."""
    return {"preparer": "v1", "async_scheduling": True} if name == "v1-async" else {"preparer": name}


def _interrupt(obj, method, when):
    """Make the ``when``-th calls (1-based, counted across steps) of ``obj.method`` raise
    KeyboardInterrupt, as a Ctrl-C landing there would."""
    calls, original = [], getattr(obj, method)

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) in when:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    setattr(obj, method, interrupted)


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
def test_generate_works_after_steps_interrupted_again_and_again(llama_ckpt, preparer):
    """The rows a step interrupted before its inputs were prepared listed to drop never reached
    the runner: v1's persistent batch kept them, and after a few Ctrl-Cs failed with "persistent
    batch is full"."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), **_preparer(preparer), backend="naive", policy="chunked", block_size=4,
              max_model_len=64, max_num_batched_tokens=32, max_num_seqs=2, enable_prefix_caching=False,
              check_invariants=True)
    prompts = [list(range(10, 13)), list(range(40, 60)), list(range(60, 65))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (2, 8, 8)]
    # Each interrupted call stops in its third step, the first to drop a row (the first request
    # finished in the second).
    _interrupt(llm.engine.executor.runner.preparer, "prepare", when={3, 6, 9})
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, s.max_tokens) for p, s in zip(prompts, params)]


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
def test_stepping_on_after_a_failed_forward_pass_matches_transformers(llama_ckpt, preparer):
    """An engine whose step raised mid-forward can step on: the runner's rows, which the failed
    step had advanced, are rebuilt from their requests (whose computed tokens did not move)."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), **_preparer(preparer), backend="naive", policy="chunked", block_size=4,
              max_model_len=64, max_num_batched_tokens=16, max_num_seqs=3, check_invariants=True)
    engine = llm.engine
    prompts = [list(range(10, 13)), list(range(40, 60)), list(range(60, 65)), list(range(40, 62))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (2, 8, 8, 5)]
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, s)
    _interrupt(llm.engine.executor.runner.model, "forward", when={3})
    outs, failed = step_through_interrupts(engine)
    assert failed == 1
    assert [outs[str(i)].outputs[0].token_ids for i in range(4)] == [
        hf_greedy(hf_model, p, s.max_tokens) for p, s in zip(prompts, params)]


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
def test_seeded_samples_are_the_same_after_a_step_that_failed_once_it_had_sampled(llama_ckpt, preparer):
    """A step that failed after the sampler drew from the seeded requests' generators (a Ctrl-C
    landing as the sampled tokens come back) left those generators advanced: the recomputed
    requests, and the parallel samples still to fork (v0), then sampled other tokens than a run
    with no failure. Their generators now go back to where the failed step found them."""
    path, _ = llama_ckpt
    prompts = [list(range(10, 30)), list(range(40, 49)), list(range(60, 75))]
    params = [SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=i, ignore_eos=True, presence_penalty=0.5,
                             repetition_penalty=1.2, logprobs=1) for i in range(len(prompts))]

    def run(fail_at):
        llm = LLM(model=str(path), **_preparer(preparer), backend="naive", policy="chunked", block_size=4,
                  max_model_len=64, max_num_batched_tokens=32, max_num_seqs=6, check_invariants=True)
        engine = llm.engine
        for i, (p, s) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, s)
        _interrupt_after(engine.executor.runner.sampler, "sample", when=fail_at)
        outs, failed = step_through_interrupts(engine)
        assert failed == len(fail_at)
        return {rid: [c.token_ids for c in out.outputs] for rid, out in outs.items()}, outs

    (tokens, outs), (want_tokens, want) = run({1, 3, 6}), run(set())
    assert tokens == want_tokens
    for rid, out in want.items():  # each token's logprobs once, as without the failures
        for got, expected in zip(outs[rid].outputs, out.outputs):
            assert [len(d) for d in got.logprobs] == [len(d) for d in expected.logprobs]
            assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-4)


def _interrupt_after(obj, method, when):
    """Make the ``when``-th calls (1-based) of ``obj.method`` raise KeyboardInterrupt once they
    have run, as a Ctrl-C landing just after them would."""
    calls, original = [], getattr(obj, method)

    def interrupted(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) in when:
            raise KeyboardInterrupt
        return result

    setattr(obj, method, interrupted)


@pytest.mark.parametrize("preparer, mode", [("v0", "swap"), ("v1", "swap"), ("v0", "recompute"), ("v1-async", "swap")])
def test_stepping_on_after_steps_that_failed_before_their_swaps_and_copies_matches_transformers(
        llama_ckpt, preparer, mode):
    """A step that failed before its swaps and copies were applied left the requests it swapped
    in (device blocks never filled), swapped out (swap blocks never filled) or gave a private
    copy of a shared block (never copied) reading KV that was never written; they are now
    recomputed."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), **_preparer(preparer), backend="naive", policy="chunked", block_size=4,
              max_model_len=48, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=14,
              policy_options={"preemption_mode": mode}, check_invariants=True)
    engine, runner = llm.engine, llm.engine.executor.runner
    prompts = [list(range(10, 30)), list(range(40, 58)), list(range(60, 75)), list(range(80, 101))]
    params = [SamplingParams(max_tokens=m, n=n, temperature=0.0, ignore_eos=True)
              for m, n in ((20, 1), (16, 2 if preparer == "v0" else 1), (18, 1), (14, 1))]
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, s)
    apply, failed = runner.apply_block_ops, [0, 0, 0]

    def fail_before_block_ops(out):
        # The first two steps that swap in, swap out or copy fail (each kind counted apart).
        kinds = [bool(out.blocks_to_swap_in), bool(out.blocks_to_swap_out), bool(out.blocks_to_copy)]
        if any(k and n < 2 for k, n in zip(kinds, failed)):
            failed[:] = [n + k for n, k in zip(failed, kinds)]
            raise KeyboardInterrupt
        return apply(out)

    runner.apply_block_ops = fail_before_block_ops
    outs, _ = step_through_interrupts(engine)
    assert (failed[0] and failed[1]) if mode == "swap" else failed[2], failed
    assert failed[2] or preparer != "v0"
    assert [[c.token_ids for c in outs[str(i)].outputs] for i in range(4)] == [
        [hf_greedy(hf_model, p, s.max_tokens)] * s.n for p, s in zip(prompts, params)]
    alloc = engine.allocator
    assert alloc.num_free_blocks == alloc.num_usable_blocks and alloc.num_free_cpu_blocks == alloc.num_cpu_blocks


def test_generate_builds_each_output_once_as_stepping_would(llama_ckpt, monkeypatch):
    # generate reads only finished outputs; building (and detokenizing) a cumulative output for
    # every running request on every step made it quadratic in the output length.
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 8, 7, 6, 5]}]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)]
    config = dict(model=str(llama_ckpt[0]), max_model_len=128, block_size=16, backend="naive", seed=0)
    engine = LLMEngine(EngineConfig(**config))
    for rid, prompt, p in zip("01", prompts, params):
        engine.add_request(rid, prompt, p)
    stepped = {}
    while engine.has_unfinished_requests():
        stepped.update({o.request_id: o for o in engine.step() if o.finished})
    built = []
    original = OutputProcessor._output
    monkeypatch.setattr(OutputProcessor, "_output", lambda self, *a: built.append(a[0]) or original(self, *a))
    outs = LLM(**config).generate(prompts, params)
    assert sorted(built) == ["0", "1"]
    assert [o.outputs for o in outs] == [stepped["0"].outputs, stepped["1"].outputs]
    assert len(outs[1].metrics.token_times) == len(stepped["1"].metrics.token_times) == 30  # wall-clock times
    assert outs[0].outputs[0].text and len(outs[1].outputs) == 3


# -- output kinds (SamplingParams.output_kind) ---------------------------------------------------
def _stream(engine):
    """Step ``engine`` to the end; every output it returned, by request id, in order."""
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    return got


def _joined(deltas):
    """The DELTA outputs of one request joined per sample: {index: (token ids, text, finish)}."""
    joined = {}
    for o in deltas:
        for c in o.outputs:
            ids, text, _ = joined.get(c.index, ([], "", None))
            joined[c.index] = (ids + c.token_ids, text + c.text, c.finish_reason)
    return joined


def _kind_requests(engine, kind, hf_model=None):
    prompts = [[5, 6, 7, 8], list(range(20, 31)), [9, 8, 7, 6, 5]]
    stop = 2
    if hf_model is not None:  # a token greedy decoding first samples a few tokens in
        greedy = hf_greedy(hf_model, prompts[1], 30)
        stop = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, output_kind=kind),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], output_kind=kind),
              SamplingParams(n=3, max_tokens=25, temperature=1.0, seed=3, ignore_eos=True, output_kind=kind)]
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, s)
    return prompts


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
def test_delta_outputs_add_up_to_the_cumulative_output(llama_ckpt, preparer):
    # Same greedy / seeded requests: the deltas, joined per sample, are the cumulative run's final
    # token ids and text; the greedy ones are transformers' tokens, their text its decode.
    path, hf_model = llama_ckpt
    config = dict(model=str(path), max_model_len=128, block_size=16, backend="naive", seed=0, **_preparer(preparer))
    runs = {}
    for kind in ("cumulative", "delta"):
        engine = LLMEngine(EngineConfig(**config))
        prompts = _kind_requests(engine, kind, hf_model)
        runs[kind] = _stream(engine)
    tok = engine.tokenizer
    for rid in "012":
        final = runs["cumulative"][rid][-1]
        assert final.finished and not any(o.finished for o in runs["cumulative"][rid][:-1])
        deltas = runs["delta"][rid]
        assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
        assert _joined(deltas) == {c.index: (c.token_ids, c.text, c.finish_reason) for c in final.outputs}
        # Each step's output holds only its new tokens and their times; joined, the times are the
        # cumulative output's count of them (one per step that gave any sample a token).
        assert all(len(c.token_ids) == 1 for o in deltas for c in o.outputs)
        times = [t for o in deltas for t in o.metrics.token_times]
        assert times == sorted(times) and len(times) == len(final.metrics.token_times)
        assert deltas[-1].metrics.num_generated_tokens == final.metrics.num_generated_tokens
    for rid, p in zip("01", prompts):
        ids, text, _ = _joined(runs["delta"][rid])[0]
        assert ids == hf_greedy(hf_model, p, len(ids))
        shown = ids[:-1] if rid == "1" else ids  # the stop token's text is left out
        assert (tok.decode(p[-5:] + shown) == tok.decode(p[-5:]) + text)
    assert _joined(runs["delta"]["1"])[0][2] == "stop"


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
def test_delta_outputs_with_stop_strings_and_logprobs_add_up_to_the_cumulative_output(llama_ckpt, preparer):
    # A stop string taken from the middle of the model's own text, and logprobs: the deltas'
    # text never runs past what the final text keeps, and joined, text, ids, stop reason and
    # logprobs are the cumulative output's.
    path, _ = llama_ckpt
    config = dict(model=str(path), max_model_len=128, block_size=16, backend="naive", seed=0, **_preparer(preparer))
    prompt = list(range(20, 31))
    engine = LLMEngine(EngineConfig(**config))
    engine.add_request("free", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    free = _stream(engine)["free"][-1].outputs[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    assert len(free) > 10 and len(stop) == 3
    runs = {}
    for kind in ("cumulative", "delta"):
        engine = LLMEngine(EngineConfig(**config))
        engine.add_request("0", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=stop,
                                                       logprobs=2, output_kind=kind))
        engine.add_request("1", prompt, SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True,
                                                       stop=[stop], logprobs=1, output_kind=kind))
        runs[kind] = _stream(engine)
    for rid in "01":
        final = runs["cumulative"][rid][-1]
        deltas = runs["delta"][rid]
        joined = _joined(deltas)
        assert joined == {c.index: (c.token_ids, c.text, c.finish_reason) for c in final.outputs}
        for c in final.outputs:
            shown = ""
            for o in deltas:
                for d in o.outputs:
                    if d.index == c.index:
                        shown += d.text
                        assert c.text.startswith(shown)
            got_logprobs = [lp for o in deltas for d in o.outputs if d.index == c.index for lp in d.logprobs]
            assert got_logprobs == c.logprobs and len(got_logprobs) == len(c.token_ids)
            last = [d for o in deltas for d in o.outputs if d.index == c.index][-1]
            assert last.stop_reason == c.stop_reason and last.cumulative_logprob == c.cumulative_logprob
    greedy = runs["cumulative"]["0"][-1].outputs[0]
    assert greedy.finish_reason == "stop" and greedy.stop_reason == stop and stop not in greedy.text
    assert free.startswith(greedy.text) and len(greedy.text) < len(free)


def test_delta_outputs_send_prompt_logprobs_once(llama_ckpt):
    # A chunked prompt (16 tokens a step) asking for prompt logprobs, n=2: exactly one DELTA
    # output carries them, and they are the cumulative run's.
    path, _ = llama_ckpt
    config = dict(model=str(path), max_model_len=128, block_size=16, backend="naive", seed=0, policy="chunked",
                  max_num_batched_tokens=16, max_num_seqs=4)
    prompt = list(range(20, 60))
    runs = {}
    for kind in ("cumulative", "delta"):
        engine = LLMEngine(EngineConfig(**config))
        engine.add_request("0", prompt, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=2, ignore_eos=True,
                                                       prompt_logprobs=2, output_kind=kind))
        runs[kind] = _stream(engine)["0"]
    want = runs["cumulative"][-1].prompt_logprobs
    assert want is not None and len(want) == len(prompt) and want[0] is None
    carrying = [o for o in runs["delta"] if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].prompt_logprobs == want
    assert _joined(runs["delta"]) == {c.index: (c.token_ids, c.text, c.finish_reason)
                                      for c in runs["cumulative"][-1].outputs}


def test_delta_outputs_after_recompute_preemption_send_no_token_twice(llama_ckpt):
    # A small KV cache preempts (recompute): a preempted request prefills its streamed tokens again,
    # but they were sent already.
    path, hf_model = llama_ckpt
    config = dict(model=str(path), backend="naive", policy="chunked", block_size=4, max_model_len=48,
                  max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=14,
                  policy_options={"preemption_mode": "recompute"}, check_invariants=True)
    prompts = [list(range(10, 30)), list(range(40, 58)), list(range(60, 75)), list(range(80, 101))]
    engine = LLMEngine(EngineConfig(**config))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                     output_kind="delta"))
    got = _stream(engine)
    assert sum(got[str(i)][-1].metrics.num_preemptions for i in range(4)) > 0
    for i, p in enumerate(prompts):
        ids, text, reason = _joined(got[str(i)])[0]
        assert ids == hf_greedy(hf_model, p, 20) and reason == "length"
        assert engine.tokenizer.decode(p[-5:] + ids) == engine.tokenizer.decode(p[-5:]) + text


def test_final_only_outputs_come_once_and_generate_returns_final_outputs_whatever_the_kind(llama_ckpt):
    path, _ = llama_ckpt
    config = dict(model=str(path), max_model_len=128, block_size=16, backend="naive", seed=0)
    engine = LLMEngine(EngineConfig(**config))
    _kind_requests(engine, "cumulative")
    cumulative = {rid: outs[-1] for rid, outs in _stream(engine).items()}
    engine = LLMEngine(EngineConfig(**config))
    _kind_requests(engine, "final_only")
    final_only = _stream(engine)
    assert {rid: len(outs) for rid, outs in final_only.items()} == {"0": 1, "1": 1, "2": 1}
    assert all(final_only[rid][0].outputs == cumulative[rid].outputs for rid in "012")
    llm = LLM(**config)
    for kind in ("delta", "final_only"):
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, output_kind=kind),
                  SamplingParams(n=3, max_tokens=25, temperature=1.0, seed=3, ignore_eos=True, output_kind=kind)]
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 8, 7, 6, 5]}], params)
        assert outs[0].outputs == cumulative["0"].outputs and outs[1].outputs == cumulative["2"].outputs
        assert len(outs[1].metrics.token_times) == 25


def test_delta_outputs_decode_a_window_not_the_whole_output_each_step(llama_ckpt, monkeypatch):
    # Cumulative outputs decode the whole text every step (quadratic in the output length); the
    # deltas decode a few tokens per step and the whole output once, at the finish.
    path, _ = llama_ckpt
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=256, block_size=16, backend="naive"))
    decoded = []
    decode = engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    monkeypatch.setattr(OutputProcessor, "_output", lambda *a: pytest.fail("a cumulative output was built"))
    n = 150
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                         output_kind="delta"))
    got = _stream(engine)
    assert len(_joined(got["r"])[0][0]) == n
    assert sum(decoded) < 16 * n  # a cumulative output's decodes would total about n * n


@pytest.mark.parametrize("preparer", ["v1", "v0", "v1-async"])
def test_a_request_of_parallel_samples_aborted_mid_prompt_is_finished_at_once(preparer):
    # v0 forks samples 1.. from sample 0 once its prompt completes: aborted before that, they
    # must finish with it, as every sample of a v1 request does, not only after the next step.
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, **_preparer(preparer), policy="chunked",
                                    max_num_batched_tokens=8, max_num_seqs=8))
    engine.add_request("a", list(range(10, 30)), SamplingParams(n=3, max_tokens=4, temperature=0.0))
    engine.step()  # 8 of the 20 prompt tokens
    engine.abort_request("a")
    assert engine.is_finished("a")
    out = engine.step()
    assert [o.request_id for o in out] == ["a"] and out[0].finished
    assert [c.finish_reason for c in out[0].outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_stats_count_a_prompts_last_one_token_chunk_and_a_one_token_prompt_as_prefill(async_scheduling):
    """A decode token is a request's one token this step past its prompt; a one-token prompt, or the last token
    of a chunked prompt, is a prefill token though its row is one token long, as a decode's is."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, policy="chunked", max_num_batched_tokens=8,
                                    max_num_seqs=4, executor="sim", async_scheduling=async_scheduling))
    rows = []
    engine.step_callbacks.append(lambda s, out: rows.append((s.num_prefill_tokens, s.num_decode_tokens)))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("one", [5], params)
    engine.add_request("nine", list(range(10, 19)), params)
    while engine.has_unfinished_requests():
        engine.step()
    # 1: one's prompt and nine's first 7 tokens; 2: nine's last 2 prompt tokens and one's first decode.
    assert rows[:2] == [(8, 0), (2, 1)]
    assert sum(p for p, _ in rows) == 10 and sum(d for _, d in rows) == 2 * 3 - 2


def test_generate_refuses_more_sampling_params_than_prompts():
    llm = small_llm()
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        llm.generate([[5], [6]], [GREEDY, GREEDY, GREEDY])
    assert not llm.engine.has_unfinished_requests()


def test_generate_of_no_prompts_returns_no_outputs():
    assert small_llm().generate([], GREEDY) == []


@pytest.mark.parametrize("make", [np.array, torch.tensor])
def test_a_0d_array_prompt_is_a_one_line_value_error(make):
    llm = small_llm()
    with pytest.raises(ValueError, match="1-D integer array|must be integers"):
        llm.generate(make(5), GREEDY)


def test_generate_logs_why_a_prompt_was_not_run(caplog):
    llm = small_llm(max_model_len=64, max_num_batched_tokens=64)
    with caplog.at_level("WARNING", logger="framework.engine.llm"):
        (out,) = llm.generate([list(range(3, 3 + 80))], GREEDY)
    assert out.status_message and out.status_message in caplog.text
