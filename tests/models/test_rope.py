import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from models.rope import RotaryEmbedding, rope_inv_freq

CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
                    "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    "yarn-mscale-without-all-dim": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                                    "mscale": 1.0},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "truncate": False},
    # A base this low puts the slow correction dimension past the last one.
    "yarn-low-theta": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                       "rope_theta": 10.0},
}


def scaling_and_theta(case):
    """``CASES[case]``'s scaling without its base, and the base (50000 unless it gives one)."""
    scaling = dict(CASES[case])
    return scaling, scaling.pop("rope_theta", 50000.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_scaled_rope_matches_transformers(case):
    scaling, theta = scaling_and_theta(case)
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
                                   rope_parameters={"rope_theta": theta, **scaling})
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    freq, scale = rope_inv_freq(64, theta, scaling, 2048)
    torch.testing.assert_close(freq, ref_freq, rtol=0, atol=0)
    assert math.isclose(scale, ref_scale)


def test_unknown_rope_type_names_supported_ones():
    with pytest.raises(ValueError, match="llama3"):
        rope_inv_freq(64, 1e4, {"rope_type": "warp-drive", "factor": 2.0}, 2048)


@pytest.mark.parametrize("scaling", [
    {"type": "yarn", "factor": 4.0},
    {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
])
@pytest.mark.parametrize("top_level_original", [None, 512])
@pytest.mark.parametrize("scaling_original", [None, 256])
def test_rope_without_original_length_reads_as_transformers(scaling, top_level_original, scaling_original):
    """A transformers 4.x config.json may give yarn or llama3 scaling no original_max_position_embeddings (or give
    it at the top level): transformers then takes the top-level one (also over the scaling's own), else
    max_position_embeddings, and so does the engine."""
    from models.config import ModelConfig

    d = dict(model_type="llama", vocab_size=10, hidden_size=256, intermediate_size=16, num_hidden_layers=1,
             num_attention_heads=4, max_position_embeddings=2048, rope_theta=50000.0, rope_scaling=dict(scaling))
    if top_level_original is not None:
        d["original_max_position_embeddings"] = top_level_original
    if scaling_original is not None:
        d["rope_scaling"]["original_max_position_embeddings"] = scaling_original
    cfg = ModelConfig.from_hf(d)
    hf_cfg = transformers.LlamaConfig(**d)
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["type"]](hf_cfg, "cpu")
    freq, scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    torch.testing.assert_close(freq, ref_freq, rtol=0, atol=0)
    assert math.isclose(scale, ref_scale)


def test_yarn_without_a_factor_scales_by_the_extension_over_the_original_length():
    derived = rope_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256}, 2048)
    explicit = rope_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": 2048 / 256, "original_max_position_embeddings": 256},
                             2048)
    torch.testing.assert_close(derived[0], explicit[0], rtol=0, atol=0)
    assert derived[1] == explicit[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tables_are_the_float32_tables_rounded(dtype):
    scaling = CASES["yarn"]
    full = RotaryEmbedding(64, 512, 1e4, scaling, 2048, torch.float32)
    half = RotaryEmbedding(64, 512, 1e4, scaling, 2048, dtype)
    assert torch.equal(half.cos, full.cos.to(dtype)) and torch.equal(half.sin, full.sin.to(dtype))


@pytest.mark.parametrize("case", sorted(CASES))
def test_cos_and_sin_tables_equal_transformers_rotary_embedding(case):
    scaling, theta = scaling_and_theta(case)
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
                                   rope_parameters={"rope_theta": theta, **scaling})
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 512, 64), torch.arange(512)[None])
    ours = RotaryEmbedding(64, 512, theta, scaling, 2048, torch.float32)
    torch.testing.assert_close(ours.cos, cos[0, :, :32], rtol=0, atol=0)
    torch.testing.assert_close(ours.sin, sin[0, :, :32], rtol=0, atol=0)
