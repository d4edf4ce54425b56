"""Dtype names: one table for the config, the real executor and the simulator."""
import pytest
import torch

from framework.common.config import DTYPE_BYTES, EngineConfig, resolve_dtype_name
from framework.execution.executors.model import resolve_dtype


@pytest.mark.parametrize("name, canonical", [("fp16", "float16"), ("half", "float16"), ("bf16", "bfloat16"),
                                             ("float", "float32"), ("float32", "float32")])
def test_aliases_resolve_to_one_name(name, canonical):
    assert resolve_dtype_name(name, "bfloat16", "cuda", "float32") == canonical
    assert resolve_dtype(name, None, torch.device("cpu")) == getattr(torch, canonical)
    assert DTYPE_BYTES[canonical] == getattr(torch, canonical).itemsize


def test_auto_takes_the_checkpoints_16_bit_dtype_on_a_gpu_only():
    assert resolve_dtype_name("auto", "float16", "cuda", "bfloat16") == "float16"
    assert resolve_dtype_name("auto", "float32", "cuda", "bfloat16") == "bfloat16"
    assert resolve_dtype_name("auto", "float16", "cpu", "fp32") == "float32"
    assert resolve_dtype("auto", "bfloat16", torch.device("cpu")) == torch.float32


def test_an_unknown_dtype_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', 'bf16', .*'half'.*got 'fp8'"):
        EngineConfig(dtype="fp8")


@pytest.mark.parametrize("part", ["policy", "allocator", "backend", "preparer", "executor"])
def test_part_options_are_a_mapping_or_none(part):
    # They are passed as **options: None or a list used to fail there with a TypeError.
    assert getattr(EngineConfig(**{f"{part}_options": None}), f"{part}_options") == {}
    with pytest.raises(ValueError, match=f"{part}_options must be a mapping of option names to values, got"):
        EngineConfig(**{f"{part}_options": ["preemption_mode", "swap"]})


def test_a_token_budget_below_max_num_seqs_is_rejected():
    """With fewer tokens a step than running sequences, the sequences past the budget were admitted
    (holding KV blocks and a seat) yet never decoded until those ahead of them finished."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2\) must be >= max_num_seqs \(4\)"):
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=2)
    EngineConfig(max_num_seqs=4, max_num_batched_tokens=4)


def test_numpy_seeds_build_and_sample_as_the_same_int_seeds():
    """A numpy integer passes the seed checks; it used to fail building the engine with torch's
    "an integer is required" (``seed`` seeds the sampler's generator, ``model_seed`` a preset's
    random weights)."""
    import numpy as np

    from framework import LLM, SamplingParams

    def tokens(**seeds):
        llm = LLM(model="tiny-llama", max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8, **seeds)
        return llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))[0].outputs[0].token_ids

    assert tokens(seed=np.int64(3), model_seed=np.uint32(4)) == tokens(seed=3, model_seed=4)
    config = EngineConfig(seed=np.int64(3), model_seed=np.int32(4))
    assert type(config.seed) is int and type(config.model_seed) is int


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 3}, "block_size must be a power of two"), ({"block_size": 0}, "block_size must be a power of two"),
    ({"max_num_seqs": None}, "max_num_seqs must be a positive integer, got None"),
    ({"max_num_batched_tokens": 256.5}, "max_num_batched_tokens must be a positive integer or null, got 256.5"),
    ({"max_model_len": 1}, "max_model_len must be an integer >= 2"),
    ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override must be an integer >= 2"),
    ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb must be a number > 0"),
    ({"device": "cuda:"}, "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"seed": 2**63}, r"seed must be an integer in \[0, 2\*\*63\)"),
    ({"check_invariants": "no"}, "check_invariants must be true or false"),
    ({"async_scheduling": "on"}, "async_scheduling must be auto, true or false"),
])
def test_a_setting_just_outside_its_valid_values_is_refused_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=rf"^{message}"):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"block_size": 1}, {"max_model_len": 2}, {"num_gpu_blocks_override": 2}, {"gpu_memory_utilization": 1.0},
    {"swap_space": 0}, {"max_logprobs": 0}, {"device": "cuda:1"}, {"seed": 2**63 - 1},
])
def test_the_ends_of_each_valid_range_are_taken(kwargs):
    config = EngineConfig(**kwargs)
    assert all(getattr(config, key) == value for key, value in kwargs.items())


def test_an_unknown_engine_option_is_answered_with_the_nearest_and_every_option():
    with pytest.raises(TypeError) as refused:
        EngineConfig(model="tiny-llama", max_num_seq=4)
    message = str(refused.value)
    assert message.startswith("EngineConfig has no option 'max_num_seq' (did you mean max_num_seqs?); options: model, ")
    assert "\n" not in message and "async_scheduling" in message
    with pytest.raises(TypeError, match=r"^EngineConfig has no option 'zzz'; options: "):
        EngineConfig(zzz=1)
