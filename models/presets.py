"""Named model descriptions that need no download, in Hugging Face ``config.json`` keys.

``tiny-*`` and ``small-*`` are random-weight models built deterministically from the engine's
``model_seed`` (tests, examples, CPU experiments); ``SHAPE_ONLY_PRESETS`` copy released models' shapes
and carry no weights, so only the simulated executor runs them.
"""
from __future__ import annotations

from typing import Any

_TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
             rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.05)

_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
               torch_dtype="bfloat16")

#: Shapes of released models (meta-llama/Meta-Llama-3-8B and -70B, Qwen/Qwen2-7B-Instruct,
#: mistralai/Mistral-7B-v0.3): for ``executor=sim``; there are no weights to run them for real.
SHAPE_ONLY_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-3-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
    "qwen2-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False,
                 "use_sliding_window": False, "torch_dtype": "bfloat16"},
    "mistral-7b": {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                   "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16"},
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {**_TINY, "model_type": "llama", "tie_word_embeddings": False},
    # Twice tiny-llama's width (13.6 M parameters): a CPU step of a few milliseconds is mostly
    # arithmetic rather than Python, so its times vary less (experiments/sim_fidelity.py).
    "small-llama": {**_TINY, "model_type": "llama", "tie_word_embeddings": False, "hidden_size": 512,
                    "intermediate_size": 1536},
    "tiny-qwen2": {**_TINY, "model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1000000.0},
    "tiny-mistral": {**_TINY, "model_type": "mistral", "sliding_window": None},
    **SHAPE_ONLY_PRESETS,
}
