"""Named model descriptions that need no download.

``tiny-*`` presets are small random-weight models built deterministically from the engine's
seed: what tests, examples and CPU experiments run. Their configs use Hugging Face's keys, so
they go through the same parser as a real ``config.json``.
"""
from __future__ import annotations

from typing import Any

_TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
             rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.05)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {**_TINY, "model_type": "llama", "tie_word_embeddings": False},
    "tiny-qwen2": {**_TINY, "model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1000000.0},
    "tiny-mistral": {**_TINY, "model_type": "mistral", "sliding_window": None},
}
