"""The ``CostModel`` interface: how long one engine step takes, from the step's ``BatchShape``."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from framework.common.config import DTYPE_ALIASES, DTYPE_BYTES, is_int
from framework.common.registry import Registry

if TYPE_CHECKING:
    from framework.sim.hardware import Hardware
    from framework.common.request import Request
    from framework.scheduling.output import SchedulerOutput
    from models.config import ModelConfig


@dataclass
class BatchShape:
    """One step's batch composition, summed over its rows: all a cost model may depend on.

    A row computing exactly one token is a decode row; any other is a prefill row (a whole
    prompt, a chunk of one, or a recompute). For a row with ``c`` tokens already cached and ``q``
    new ones, attention reads ``c + q`` keys and forms ``q*c + q*(q+1)/2`` query-key pairs.
    """

    num_seqs: int = 0
    num_tokens: int = 0
    #: Rows that sample a token this step (their last known token is computed): logits rows.
    num_sampled: int = 0
    num_decode_seqs: int = 0
    #: Sum over decode rows of the keys they attend to (context including the new token).
    decode_context: int = 0
    num_prefill_seqs: int = 0
    prefill_tokens: int = 0
    #: Sum over prefill rows of the keys they read (cached plus new tokens).
    prefill_context: int = 0
    #: Sum over prefill rows of causal query-key pairs.
    prefill_pairs: int = 0
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    copy_blocks: int = 0

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput, sampling: list[Request] | None = None) -> BatchShape:
        """The shape of ``out``, read before the step runs (``num_computed_tokens`` not yet
        advanced). ``sampling``, when given, gets the requests that sample a token this step."""
        shape = cls(swap_in_blocks=len(out.blocks_to_swap_in), swap_out_blocks=len(out.blocks_to_swap_out),
                    copy_blocks=len(out.blocks_to_copy))
        counts = out.num_scheduled_tokens
        for req in out.scheduled:
            q = counts[req.request_id]
            c = req.num_computed_tokens
            samples = c + q >= len(req.token_ids)
            shape.add_row(c, q, samples)
            if samples and req.forks:  # v0: its forks sample from logits rows of their own
                shape.num_sampled += len(req.forks)
            if samples and sampling is not None:
                sampling.append(req)
        return shape

    def add_row(self, num_cached: int, num_new: int, samples: bool) -> None:
        self.num_seqs += 1
        self.num_tokens += num_new
        self.num_sampled += samples
        if num_new == 1:
            self.num_decode_seqs += 1
            self.decode_context += num_cached + 1
        else:
            self.num_prefill_seqs += 1
            self.prefill_tokens += num_new
            self.prefill_context += num_cached + num_new
            self.prefill_pairs += num_new * num_cached + num_new * (num_new + 1) // 2

    @property
    def is_pure_decode(self) -> bool:
        """At least one row, every row a sampling decode row, and no block traffic."""
        return (self.num_decode_seqs > 0 and self.num_prefill_seqs == 0 and self.num_sampled == self.num_seqs
                and not self.swap_in_blocks and not self.swap_out_blocks and not self.copy_blocks)

    def to_list(self) -> list[int]:
        return list(astuple(self))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_list(cls, values: list[int]) -> BatchShape:
        return cls(*values)


class CostModel(ABC):
    """Step durations in seconds for one replica: ``tensor_parallel_size`` devices of ``hardware`` running
    ``model`` in ``dtype`` (default: ``default_dtype(dtype_bytes)``), options from the ``cost_model`` config
    node as keyword arguments (unknown ones rejected). ``step_time`` is a pure function of the shape unless
    ``deterministic`` is False; ``decode_step_time(m, ctx)`` must equal, bit for bit, ``step_time`` of
    ``m`` decode rows attending to ``ctx`` keys in all (a subclass overriding only ``step_time`` is timed through it).
    """

    name: ClassVar[str] = ""
    #: Whether ``step_time`` is a pure function of the shape: a simulator may then plan steps it does
    #: not take; otherwise (a replay) it asks once per step taken.
    deterministic: ClassVar[bool] = True

    def __init__(self, model: ModelConfig, hardware: Hardware, dtype_bytes: int = 2,
                 tensor_parallel_size: int = 1, block_size: int = 16, *, dtype: str | None = None) -> None:
        tp, heads, kv = tensor_parallel_size, model.num_attention_heads, model.num_key_value_heads
        # is_int: a bool is no device count (True would pass as 1).
        if not (is_int(tp) and tp >= 1 and heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size!r} must be >= 1 and divide the model's "
                f"{model.num_attention_heads} attention heads (and its {model.num_key_value_heads} KV heads, "
                f"or be a multiple of them)")
        self.model = model
        self.hardware = hardware
        self.dtype_bytes = dtype_bytes
        self.dtype = check_dtype(dtype, dtype_bytes, hardware)
        self.tp = tensor_parallel_size
        self.block_size = block_size

    @abstractmethod
    def step_time(self, batch: BatchShape) -> float:
        """Seconds from one step's start to the next's, for a step computing ``batch``."""

    def decode_step_time(self, num_seqs: int, context: int) -> float:
        return self.step_time(BatchShape(num_seqs=num_seqs, num_tokens=num_seqs, num_sampled=num_seqs,
                                         num_decode_seqs=num_seqs, decode_context=context))

    def host_time(self, batch: BatchShape) -> float:
        """The part of ``step_time(batch)`` the host spends (scheduling, input preparation, sampling's
        bookkeeping), which async scheduling overlaps with the step before's device time. Default none: the
        whole step is device time, so async scheduling changes no step's length."""
        return 0.0

    @classmethod
    def calibrate(cls, samples: list[tuple[BatchShape, float]], model: ModelConfig, hardware: Hardware,
                  dtype_bytes: int, tensor_parallel_size: int = 1, block_size: int = 16, *,
                  dtype: str | None = None) -> dict[str, Any]:
        """Fit this model's parameters to measured ``(shape, seconds)`` samples; returns the
        keyword options that reproduce them. Cost models without parameters cannot be calibrated."""
        raise NotImplementedError(f"cost model {cls.name!r} has no parameters to calibrate")


def default_dtype(dtype_bytes: int, hardware: Hardware) -> str:
    """The dtype a cost model given only ``dtype_bytes`` runs in: the device's own (what
    ``dtype=auto`` means on it) when it has that width, else float32 for 4 bytes and bfloat16 for 2."""
    if DTYPE_BYTES.get(DTYPE_ALIASES.get(hardware.dtype, "")) == dtype_bytes:
        return DTYPE_ALIASES[hardware.dtype]
    widths = {4: "float32", 2: "bfloat16"}
    if dtype_bytes not in widths:
        raise ValueError(f"dtype_bytes must be 4 (float32) or 2 (bfloat16, float16), got {dtype_bytes!r}")
    return widths[dtype_bytes]


def check_dtype(dtype: str | None, dtype_bytes: int, hardware: Hardware) -> str:
    """``dtype``'s canonical name (``default_dtype`` when None); a ValueError when it is no dtype
    or not ``dtype_bytes`` wide (the weights' bytes and the peak FLOP/s would disagree)."""
    if dtype is None:
        return default_dtype(dtype_bytes, hardware)
    canonical = DTYPE_ALIASES.get(dtype) if isinstance(dtype, str) else None
    if canonical is None:
        raise ValueError(f"cost model dtype must be one of {sorted(DTYPE_ALIASES)}, got {dtype!r}")
    if DTYPE_BYTES[canonical] != dtype_bytes:
        raise ValueError(f"cost model dtype {canonical} is {DTYPE_BYTES[canonical]} bytes wide, but dtype_bytes "
                         f"is {dtype_bytes!r}")
    return canonical


#: The model's shape as far as step times go: what a calibration records of the model it measured.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim")


def model_shape(model: ModelConfig) -> dict[str, int]:
    """``model``'s ``SHAPE_KEYS``."""
    return {key: getattr(model, key) for key in SHAPE_KEYS}


COST_MODELS: Registry[CostModel] = Registry(
    "cost model", CostModel, entry_point_group="framework.cost_models", builtin="framework.sim.cost_models")
