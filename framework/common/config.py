"""Engine configuration: one dataclass, keyword names as in vLLM's ``LLM(...)``."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar


#: The engine's pluggable parts, each an ``EngineConfig`` field naming a registered implementation.
PART_NAMES = ("policy", "backend", "allocator", "preparer", "executor")

_Cls = TypeVar("_Cls", bound=type)


def names_valid_keywords(cls: _Cls) -> _Cls:
    """``cls`` (a dataclass) whose constructor answers an unknown keyword argument with a TypeError naming the
    nearest field and every field, in one line, as the command line's unknown keys are answered."""
    init = cls.__init__
    valid = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except TypeError:
            unknown = [name for name in kwargs if name not in valid]
            if not unknown:
                raise
            near = difflib.get_close_matches(unknown[0], valid, n=1)
            raise TypeError(f"{cls.__name__} has no option {unknown[0]!r}"
                            f"{f' (did you mean {near[0]}?)' if near else ''}; options: {', '.join(valid)}") from None

    cls.__init__ = __init__
    return cls


@names_valid_keywords
@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    The pluggable parts are picked by registry name (``policy``, ``allocator``, ``backend``,
    ``preparer``, ``executor``) and receive their ``*_options`` as keyword arguments.
    ``max_model_len=None`` takes the model's longest context (``ModelConfig.max_context``:
    ``max_position_embeddings``, stretched by linear or YaRN RoPE scaling), capped at 8192 so the
    persistent batch stays small on a laptop. ``max_num_batched_tokens=None`` is 2048 (or
    ``max_num_seqs``, if more), raised to ``max_model_len`` for a policy that prefills each prompt
    whole (vLLM v0's default); such a policy's budget below ``max_model_len`` is refused when the
    engine is built (``LLMEngine``), as in vLLM. The KV block count comes from
    ``num_gpu_blocks_override`` when set, else from ``kv_cache_memory_gb``, else (CUDA) from
    ``gpu_memory_utilization`` of the card, else (CPU) from ``cpu_kv_cache_gb``. ``swap_space``
    is the CPU swap space in GiB, as in vLLM.
    ``seed`` drives sampling; ``model_seed`` the random weights of a preset model.
    ``max_logprobs`` caps ``SamplingParams.logprobs``, as in vLLM (default 20).
    ``async_scheduling`` (vLLM's): the engine schedules step N+1 while step N runs, N's sampled tokens
    placeholders until known (``LLMEngine``); ``auto``: on for an executor that can on CUDA.
    ``generation_config`` (vLLM's): ``auto`` takes the sampling options a request leaves unset (offline
    ``generate`` given no ``SamplingParams``, the server's omitted fields) from the checkpoint's
    ``generation_config.json`` (temperature, top_p, top_k, min_p, penalties, max_new_tokens); ``vllm``: never.
    """

    model: str = "tiny-llama"
    policy: str = "fcfs"
    allocator: str = "paged"
    backend: str = "torch_paged"
    preparer: str = "v1"
    executor: str = "model"
    policy_options: dict[str, Any] = field(default_factory=dict)
    allocator_options: dict[str, Any] = field(default_factory=dict)
    backend_options: dict[str, Any] = field(default_factory=dict)
    preparer_options: dict[str, Any] = field(default_factory=dict)
    executor_options: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0
    swap_space: float = 4.0
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    model_seed: int = 0
    num_threads: int | None = None
    check_invariants: bool = False
    max_logprobs: int = 20
    async_scheduling: bool | str = "auto"
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        for part in PART_NAMES:  # None means no options, as an omitted argument does
            if getattr(self, f"{part}_options") is None:
                setattr(self, f"{part}_options", {})
        self.validate()

    def validate(self) -> None:
        """Checks that need no model; model-dependent limits are checked when the engine is built."""
        for part in PART_NAMES:
            options = getattr(self, f"{part}_options")
            if not isinstance(options, Mapping):
                raise ValueError(f"{part}_options must be a mapping of option names to values, got {options!r}")
        bs = self.block_size
        if not is_int(bs) or bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two (1, 2, 4, ..., 16, 32, ...), got {bs!r}")
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens, optional=True)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # As vLLM: every running sequence needs a token a step, or the ones past the budget
            # hold their KV blocks and a seat without decoding until those ahead finish.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}); raise max_num_batched_tokens or lower max_num_seqs")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 or None, got {self.max_model_len!r}")
        if self.num_gpu_blocks_override is not None and not (is_int(self.num_gpu_blocks_override)
                                                             and self.num_gpu_blocks_override >= 2):
            raise ValueError(
                f"num_gpu_blocks_override must be an integer >= 2 (block 0 is the reserved null block), "
                f"got {self.num_gpu_blocks_override!r}")
        if not is_finite_number(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        kv_gb = self.kv_cache_memory_gb
        if kv_gb is not None and not (is_finite_number(kv_gb) and kv_gb > 0):
            raise ValueError(f"kv_cache_memory_gb must be a number > 0 (GiB) or null, got {self.kv_cache_memory_gb!r}")
        if not is_finite_number(self.cpu_kv_cache_gb) or not self.cpu_kv_cache_gb > 0:
            raise ValueError(f"cpu_kv_cache_gb must be a number > 0 (GiB), got {self.cpu_kv_cache_gb!r}")
        if not is_finite_number(self.swap_space) or not self.swap_space >= 0:
            raise ValueError(f"swap_space must be a number >= 0 (GiB), got {self.swap_space!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("seed", "model_seed"):
            check_seed(name, getattr(self, name))
            # torch's manual_seed refuses a numpy integer ("an integer is required"), mid-build.
            setattr(self, name, int(getattr(self, name)))
        check_positive_int("num_threads", self.num_threads, optional=True)
        if not is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        for name in ("enable_prefix_caching", "check_invariants"):
            check_bool(name, getattr(self, name))
        if self.async_scheduling not in (True, False, "auto"):
            raise ValueError(f"async_scheduling must be auto, true or false, got {self.async_scheduling!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be auto (the model's generation_config.json) or vllm (vLLM's "
                             f"neutral defaults), got {self.generation_config!r}")
        if self.dtype != "auto" and not (isinstance(self.dtype, str) and self.dtype in DTYPE_ALIASES):
            raise ValueError(f"dtype must be one of {sorted({'auto', *DTYPE_ALIASES})}, got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_int(value: Any) -> bool:
    """An integer, numpy's included, but not a bool (``max_tokens=True`` is a mistake, not 1)."""
    # The plain-int test first: every request of a million-request simulation passes here.
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def is_finite_number(value: Any) -> bool:
    """A finite number (a bool, NaN, infinity or an integer past float's range is none)."""
    try:
        if type(value) is float or type(value) is int:
            return math.isfinite(value)
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float: every later float() of it would fail
        return False


def parse_finite_float(value: Any) -> float | None:
    """``value`` as a float when it is a finite number or a string of one (a hand-written YAML, a
    CSV cell), else None: a bool, NaN, infinity or other text is no such number."""
    if isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML file at ``path``, parsed; a ValueError naming it as ``what`` (``hardware file
    'x.yaml'``) when it is not valid YAML, rather than the parser's traceback."""
    import yaml  # here: most runs read no YAML of their own

    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ValueError(f"{what} is not valid YAML: {exc}") from None


def check_writable_file(name: str, path: str | Path) -> None:
    """ValueError naming the option ``name`` unless a file can be written at ``path`` (its folders made as
    needed): checked before a long measurement whose result goes there. Makes nothing."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{name} {path} is a folder; give a file path")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{name} {path}: {parent} is a file, not a folder")
    if not os.access(target if target.exists() else parent, os.W_OK):
        raise ValueError(f"{name} {path}: no permission to write {target if target.exists() else 'in ' + str(parent)}")


def check_positive_int(name: str, value: Any, optional: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (a bool is not), or None when
    ``optional``."""
    if optional and value is None:
        return
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or null' if optional else ''}, got {value!r}")


def check_seed(name: str, value: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer in ``[0, 2**63)``, what numpy's
    and torch's generators take (a string or a negative number fails there, naming nothing)."""
    if not is_int(value) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be an integer in [0, 2**63), got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is a bool: ``bool("no")`` would read a config's
    string as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


#: Every dtype name the configs accept, and the one it means.
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16", "fp16": "float16",
                 "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def resolve_dtype_name(name: str, model_dtype: str | None, device_type: str, default: str) -> str:
    """The dtype an engine runs in: ``name`` (any alias), or for ``auto`` the checkpoint's 16-bit
    dtype on a GPU and the device's ``default`` otherwise. Executors real and simulated share it."""
    if name != "auto":
        return DTYPE_ALIASES[name]
    if device_type == "cuda" and model_dtype in ("float16", "bfloat16"):
        return model_dtype
    return DTYPE_ALIASES[default]
