"""Model description read from a Hugging Face ``config.json`` (or a preset): no weights needed."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
#: Shape keys every config must give (the others have defaults), each a positive integer.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: Optional shape keys: a positive integer when given (and not null).
OPTIONAL_SHAPE_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
#: The scaling keys each RoPE type needs, as transformers requires them (llama3 and yarn's
#: original_max_position_embeddings has a default).
ROPE_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


#: Switches that are JSON booleans when given (and not null): ``bool("false")`` would be True.
BOOLEAN_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


#: RoPE scaling parameters that are positive numbers when given (``factor`` always, where its type requires it),
#: and those that are numbers >= 0 (0 asks for the default, as transformers reads YaRN's).
ROPE_POSITIVE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_NON_NEGATIVE_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _check_rope_numbers(scaling: dict[str, Any] | None) -> None:
    """ValueError naming the key unless each RoPE number ``scaling`` gives is in its range (None: no scaling)."""
    for key in ROPE_POSITIVE_KEYS + ROPE_NON_NEGATIVE_KEYS:
        value = (scaling or {}).get(key)
        zero_allowed = key in ROPE_NON_NEGATIVE_KEYS
        if value is None or _positive_number(value) or (zero_allowed and type(value) in (int, float) and value == 0):
            continue
        raise ValueError(f"model config: rope scaling's {key} must be a "
                         f"{'number >= 0' if zero_allowed else 'positive number'}, got {value!r}")


def _positive_number(value: Any) -> bool:
    """A finite number > 0 from JSON (a bool, string or null is none). Not ``framework.common.config``'s
    ``is_finite_number``: ``framework`` imports this module as it loads, so this one imports nothing of it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int past float's range
        return False


def eos_token_ids(value: Any, source: str) -> list[int]:
    """An ``eos_token_id`` (null, a token id or a list of them) as a list. Raises ValueError naming ``source``:
    ``list("</s>")`` would have made four bogus ids."""
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(ids)


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    sliding_window: int | None = None
    initializer_range: float = 0.02

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters``). Raises ValueError for architectures this package does not run."""
        if not isinstance(d, dict):
            raise ValueError(f"a model config must be a mapping of Hugging Face config keys, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        # A supported model type with another head (sequence or token classification, ...)
        # has no LM head to sample from; a bare base model ("LlamaModel") may tie one.
        architectures = d.get("architectures") or []
        if architectures and not any(a.endswith(("ForCausalLM", "Model")) for a in architectures):
            raise ValueError(f"unsupported architecture {', '.join(architectures)}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        # Checked here, so that a bad config.json is named as such rather than failing later as a
        # KeyError, a TypeError in some product of shapes, or a KV head count that splits no heads.
        missing = [k for k in REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)} (every {model_type} config.json gives them)")
        # Qwen2 reads its window only with use_sliding_window (as transformers, which takes any value otherwise).
        window_read = model_type != "qwen2" or d.get("use_sliding_window") is True
        for key in REQUIRED_KEYS + OPTIONAL_SHAPE_KEYS + (("sliding_window",) if window_read else ()):
            value = d.get(key)
            if (key in REQUIRED_KEYS or value is not None) and not (
                    isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"model config: {key} must be a positive integer"
                                 f"{'' if key in REQUIRED_KEYS else ' or null'}, got {value!r}")
        for key in BOOLEAN_KEYS:
            if d.get(key) is not None and not isinstance(d[key], bool):
                raise ValueError(f"model config: {key} must be true or false, got {d[key]!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"model config: num_attention_heads={heads} must be a multiple of "
                             f"num_key_value_heads={kv_heads} (each KV head serves a group of query heads)")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if head_dim % 2:  # refused as transformers does, rather than failing mid-forward
            raise ValueError(f"model config: head_dim={head_dim} must be even (rotary embeddings turn pairs of "
                             f"dimensions); give an even head_dim or hidden_size / num_attention_heads")
        # As transformers 5 reads them: a legacy rope_scaling replaces rope_parameters whole (its theta too).
        for key in ("rope_scaling", "rope_parameters"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise ValueError(f"model config: {key} must be a mapping of RoPE parameters or null, got {d[key]!r}")
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None)
        theta = d.get("rope_theta") if theta is None else theta
        theta = 10000.0 if theta is None else theta
        if not _positive_number(theta):
            raise ValueError(f"model config: rope_theta must be a positive number, got {theta!r}")
        scaling = rope or None
        if scaling is not None:
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            if not isinstance(scaling["rope_type"], str):
                raise ValueError(f"model config: rope_type must be a string, got {scaling['rope_type']!r}")
            # Checked here, as transformers does, rather than as a KeyError when the model is built.
            lacking = [k for k in ROPE_REQUIRED_KEYS.get(scaling["rope_type"], ()) if k not in scaling]
            if lacking:
                raise ValueError(f"model config: rope_type {scaling['rope_type']!r} scaling lacks "
                                 f"{', '.join(lacking)} (rope_scaling or rope_parameters must give it)")
            if scaling["rope_type"] == "default" and len(scaling) == 1:
                scaling = None
            elif scaling["rope_type"] in ("llama3", "yarn"):
                # As transformers reads them: a top-level original_max_position_embeddings
                # wins, and without one the pre-extension length is max_position_embeddings
                # (config.json files written by transformers 4.x often leave it out).
                top = d.get("original_max_position_embeddings")
                if top is not None:
                    scaling["original_max_position_embeddings"] = top
                scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
                if scaling["rope_type"] == "yarn" and scaling["factor"] is None:  # as transformers derives it
                    scaling["factor"] = d.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
            _check_rope_numbers(scaling)
        eps = d.get("rms_norm_eps", 1e-6)
        if not _positive_number(eps):
            raise ValueError(f"model config: rms_norm_eps must be a positive number, got {eps!r}")
        # As transformers reads it: Mistral's and Qwen2's configs default the window to 4096 when
        # the key is absent (Qwen2 uses it only with use_sliding_window, and only in the layers
        # layer_types marks sliding: by default those from max_window_layers (28) on, often none).
        if model_type == "qwen2":
            window = d.get("sliding_window", 4096) if d.get("use_sliding_window") else None
            first_sliding = d.get("max_window_layers")
            first_sliding = 28 if first_sliding is None else first_sliding
            layer_types = d.get("layer_types") or [
                "sliding_attention" if i >= first_sliding else "full_attention" for i in range(d["num_hidden_layers"])]
            if "sliding_attention" not in layer_types:
                window = None
        elif model_type == "mistral":
            window = d.get("sliding_window", 4096)
        else:
            window = d.get("sliding_window")
        eos_ids = eos_token_ids(d.get("eos_token_id"), "model config")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings")),
            # As transformers builds each family: Qwen2 always has q/k/v biases and no MLP bias,
            # Mistral has none whatever its config says; Llama reads both switches.
            attention_bias=model_type == "qwen2" or (model_type == "llama" and bool(d.get("attention_bias", False))),
            mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),
            # transformers' ACT2FN runs "swish" as SiLU.
            hidden_act="silu" if d.get("hidden_act") == "swish" else d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            sliding_window=window,
            initializer_range=d.get("initializer_range", 0.02),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def o_proj_bias(self) -> bool:
        """Whether the attention output projection has a bias: Llama's ``attention_bias`` covers
        it (as transformers' LlamaAttention), Qwen2's q/k/v biases do not."""
        return self.attention_bias and self.model_type != "qwen2"

    def max_context(self) -> tuple[int, str]:
        """(The longest sequence this model serves, what sets it), as vLLM derives it: ``max_position_embeddings``
        (also under llama3 and dynamic NTK) times linear RoPE's factor, or YaRN's factor times
        ``original_max_position_embeddings``; capped by a shorter sliding window (not implemented here)."""
        limit, why = self.max_position_embeddings, "max_position_embeddings"
        rope_type = (self.rope_scaling or {}).get("rope_type")
        if rope_type == "linear":
            factor = self.rope_scaling["factor"]
            limit, why = int(limit * factor), f"linear-RoPE-scaled context (max_position_embeddings {limit} x factor {factor:g})"
        elif rope_type == "yarn":
            original, factor = self.rope_scaling["original_max_position_embeddings"], self.rope_scaling["factor"]
            limit, why = int(original * factor), f"YaRN-scaled context (original_max_position_embeddings {original} x factor {factor:g})"
        if self.sliding_window and self.sliding_window < limit:
            limit, why = self.sliding_window, "sliding_window (sliding-window attention is not implemented)"
        return limit, why

    def num_params(self) -> int:
        """Parameters of the model ``models/llama.py`` builds for this config, biases included."""
        return self.num_params_per_device(1)

    def num_params_per_device(self, tensor_parallel_size: int = 1) -> int:
        """Parameters one device of a tensor-parallel group holds, split as vLLM splits them: query heads,
        the MLP's width and the vocabulary divided, KV heads divided or (when fewer than devices) replicated,
        norms and the row-parallel projections' (o, down) biases whole on every device."""
        tp = tensor_parallel_size
        h = self.hidden_size
        qs, kvs = self.num_attention_heads // tp * self.head_dim, self.kv_size_per_device(tp)
        i, v = self.intermediate_size // tp, -(-self.vocab_size // tp)
        attn = h * (qs + 2 * kvs) + qs * h
        if self.attention_bias:
            attn += qs + 2 * kvs
        if self.o_proj_bias:
            attn += h
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_hidden_layers * (attn + mlp + 2 * h) + v * h + head + h

    def kv_size_per_device(self, tensor_parallel_size: int = 1) -> int:
        """K (or V) width one device of a tensor-parallel group keeps: KV heads are split across
        the devices, and replicated when there are fewer heads than devices."""
        return max(self.num_key_value_heads // tensor_parallel_size, 1) * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """K and V bytes of one token, all layers, on one device."""
        return 2 * self.num_hidden_layers * self.kv_size_per_device(tensor_parallel_size) * dtype_bytes
