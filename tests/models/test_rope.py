import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.rope import rope_inv_freq

CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
                    "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scaled_rope_matches_transformers(case):
    scaling = CASES[case]
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
                                   rope_parameters={"rope_theta": 50000.0, **scaling})
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    freq, scale = rope_inv_freq(64, 50000.0, scaling, 2048)
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
def test_rope_without_original_length_reads_as_transformers(scaling, top_level_original):
    """A transformers 4.x config.json may give yarn or llama3 scaling no
    original_max_position_embeddings (or give it at the top level): transformers then takes the
    top-level one, else max_position_embeddings; the engine used to fail with a KeyError."""
    from models.config import ModelConfig

    d = dict(model_type="llama", vocab_size=10, hidden_size=256, intermediate_size=16, num_hidden_layers=1,
             num_attention_heads=4, max_position_embeddings=2048, rope_theta=50000.0, rope_scaling=dict(scaling))
    if top_level_original is not None:
        d["original_max_position_embeddings"] = top_level_original
    cfg = ModelConfig.from_hf(d)
    hf_cfg = transformers.LlamaConfig(**d)
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["type"]](hf_cfg, "cpu")
    freq, scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    torch.testing.assert_close(freq, ref_freq, rtol=0, atol=0)
    assert math.isclose(scale, ref_scale)
