"""A checkpoint's generation_config.json sets the sampling defaults of requests that leave them unset, as vLLM's
``generation_config="auto"``; ``generation_config=vllm`` ignores them."""
from __future__ import annotations

import json

import pytest

from framework import LLM, SamplingParams
from framework.common.config import EngineConfig
from models.loader import resolve_model
from framework.testing.parity import make_hf_checkpoint

ENGINE = dict(backend="naive", max_model_len=64, max_num_seqs=8, num_gpu_blocks_override=64)
PROMPT = [5, 9, 33, 2, 7]


@pytest.fixture(scope="module")
def sampling_ckpt(tmp_path_factory):
    """A checkpoint whose generation config samples at temperature 0.7 from the top token alone, 5 tokens."""
    path = tmp_path_factory.mktemp("gen-config")
    make_hf_checkpoint(path, "llama", seed=3)
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 1, "max_new_tokens": 5, "min_p": None, "eos_token_id": 2}))
    return path


def test_the_loader_reads_the_sampling_keys_set(sampling_ckpt):
    # min_p null is unset; do_sample is not a sampling option (vLLM samples at the file's temperature whatever it says).
    assert resolve_model(str(sampling_ckpt)).sampling_defaults == {"temperature": 0.7, "top_k": 1, "max_tokens": 5}


def test_generate_without_params_samples_as_the_generation_config_says(sampling_ckpt):
    greedy = LLM(model=str(sampling_ckpt), **ENGINE).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids
    for seed in (0, 1, 2):
        llm = LLM(model=str(sampling_ckpt), seed=seed, **ENGINE)
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
        out = llm.generate([PROMPT])[0].outputs[0]
        # top_k 1 keeps only the most likely token, whatever the seed; an EOS may end it sooner.
        assert out.token_ids == greedy[:len(out.token_ids)] and len(out.token_ids) <= 5
        assert out.finish_reason == ("length" if len(out.token_ids) == 5 else "stop")
    # A request's own SamplingParams are taken as they are: unfiltered sampling at temperature 1, 16 tokens.
    own = llm.generate([PROMPT], SamplingParams(ignore_eos=True))[0].outputs[0].token_ids
    assert len(own) == 16 and own[:5] != greedy


def test_add_request_without_params_takes_the_defaults_too(sampling_ckpt):
    engine = LLM(model=str(sampling_ckpt), **ENGINE).engine
    engine.add_request("r", {"prompt_token_ids": PROMPT})
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert len(finished[0].outputs[0].token_ids) <= 5


def test_generation_config_vllm_ignores_the_files_sampling_options(sampling_ckpt):
    llm = LLM(model=str(sampling_ckpt), generation_config="vllm", **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert len(llm.generate([PROMPT], SamplingParams(ignore_eos=True))[0].outputs[0].token_ids) == 16


def test_a_refused_default_names_the_file_before_the_weights_load(tmp_path):
    make_hf_checkpoint(tmp_path, "llama")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    (tmp_path / "model.safetensors").unlink()  # the weights would be read after the check: their error is not it
    with pytest.raises(ValueError, match=r"^.*generation_config\.json sets a default sampling option that is refused: "
                                         r"SamplingParams\.temperature must be .*generation_config=vllm") as err:
        LLM(model=str(tmp_path), **ENGINE)
    assert "\n" not in str(err.value)
    # generation_config=vllm does not read the file's sampling options, so the weights' absence is what fails.
    with pytest.raises(ValueError, match="no weights"):
        LLM(model=str(tmp_path), generation_config="vllm", **ENGINE)


def test_an_unknown_generation_config_names_the_choices():
    with pytest.raises(ValueError, match=r"^generation_config must be auto .* or vllm .*, got 'hf'$"):
        EngineConfig(generation_config="hf")
