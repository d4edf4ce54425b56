"""Greedy outputs equal transformers' for Llama-family configurations the default checkpoints
of test_parity.py do not exercise."""
import pytest
import torch

from framework import LLM, SamplingParams
from tests.conftest import hf_greedy, make_hf_checkpoint

PROMPTS = [[5, 9, 33, 2, 7, 120, 64], [300, 4, 17]]


def assert_greedy_matches(path, hf_model, **kwargs) -> None:
    llm = LLM(model=str(path), max_model_len=64, block_size=8, **kwargs)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 10) for p in PROMPTS]


def randomise_biases(model) -> None:
    """transformers zero-initialises biases; random ones make a dropped bias change the outputs."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_llama_biases_match_transformers(tmp_path, bias):
    hf = make_hf_checkpoint(tmp_path / "init", "llama", seed=5, **{bias: True})
    randomise_biases(hf)
    hf.save_pretrained(tmp_path / "ckpt")
    assert_greedy_matches(tmp_path / "ckpt", hf)
