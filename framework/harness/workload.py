"""The ``Workload`` interface: what requests an experiment sends, and when.

A workload turns its options (the Hydra ``workload`` group's keys) into a list of ``WorkloadRequest``,
deterministically: the same options and seed give the same requests. The serving loop
(``framework/harness/cluster.py``) sends each to the engine when its arrival time comes.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from framework.common.registry import BadOptionsError, Registry
from framework.common.sampling_params import SamplingParams


@dataclass(eq=False)
class WorkloadRequest:
    """One request to send. ``prompt_token_ids`` is a list of ints or a 1-D integer numpy array
    (the synthetic workload's: 4 bytes a token); ``arrival_time`` is seconds after the start of the
    run; ``priority`` follows vLLM (a lower value is more urgent); ``output_len`` is exact when
    ``ignore_eos`` (None: up to the engine's ``max_model_len``, as ``max_tokens=None``).
    ``sampling`` holds this request's own ``SAMPLING_KEYS`` (a trace's per-request values), which
    win over the workload's; None when it has none."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_len: int | None
    arrival_time: float = 0.0
    priority: int = 0
    prompt: str | None = None
    sampling: dict[str, Any] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def __eq__(self, other: object) -> bool:
        # The dataclass's own comparison would ask an array for one truth value.
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) if f.name == "prompt_token_ids"
                   else getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self))


@dataclass
class WorkloadContext:
    """What a workload may know about the model: its vocabulary (to draw random token ids), its
    tokenizer (None for presets) and the longest sequence the engine accepts."""

    vocab_size: int
    tokenizer: Any | None = None
    max_model_len: int | None = None
    #: Lowest token id random prompts use; ids below it are special tokens in the tiny and small
    #: presets.
    first_token_id: int = 3


class Workload(ABC):
    """Contract: ``generate`` returns requests sorted by arrival time (ties keep their order),
    with unique ids, every prompt non-empty and every token id in ``[0, vocab_size)``. It draws
    randomness only from its own seed. Bad options raise ValueError naming the option."""

    name: ClassVar[str] = ""

    @abstractmethod
    def generate(self, ctx: WorkloadContext) -> list[WorkloadRequest]: ...

    def check_lengths(self, max_model_len: int) -> int | None:
        """Before anything is generated: ValueError, naming the option and the limit, for a length the options state
        that an engine of ``max_model_len`` tokens can never take. Returns the longest prompt within it that will be
        sent, or None where only generating tells (text to tokenize; the default: no check)."""
        return None


WORKLOADS: Registry[Workload] = Registry(
    "workload", Workload, entry_point_group="framework.workloads", builtin="framework.harness.workloads")


#: Workload keys that shape sampling rather than the requests; every workload accepts them.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "ignore_eos")
#: A workload's requests are greedy and run to their output length unless its config says otherwise.
SAMPLING_DEFAULTS = {"temperature": 0.0, "ignore_eos": True}


def sampling_params(request: WorkloadRequest, sampling: dict[str, Any]) -> SamplingParams:
    """Sampling for one request: exactly ``output_len`` tokens unless ``ignore_eos`` is false. The
    request's own keys win over the workload's ``sampling``, as a vLLM request's own sampling
    parameters win over the server's defaults."""
    return SamplingParams(max_tokens=request.output_len,
                          **{**SAMPLING_DEFAULTS, **sampling, **(request.sampling or {})})


def non_default_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """The ``SAMPLING_KEYS`` of ``sampling`` that differ from a workload's defaults, normalised as
    ``SamplingParams`` does (top_k -1 is 0): what a saved trace must hold to replay them. A bad
    value raises SamplingParams' ValueError."""
    params = SamplingParams(**{**SAMPLING_DEFAULTS, **sampling})
    return {k: getattr(params, k) for k in SAMPLING_KEYS if getattr(params, k) != getattr(_DEFAULT_PARAMS, k)}


_DEFAULT_PARAMS = SamplingParams(**SAMPLING_DEFAULTS)


def create_workload(options: dict[str, Any]) -> tuple[Workload, dict[str, Any]]:
    """The workload a Hydra ``workload`` node describes (``{name: ..., **options}``) and the
    sampling options (``SAMPLING_KEYS``) split off from it."""
    options = dict(options)
    sampling = {k: options.pop(k) for k in SAMPLING_KEYS if k in options}
    try:  # here, not at the first request: a bad value is a configuration error, found before serving
        SamplingParams(**{**SAMPLING_DEFAULTS, **sampling})
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc).replace("SamplingParams.", "workload.", 1)) from None
    try:
        return WORKLOADS.create_from(options), sampling
    except BadOptionsError as exc:
        # The options it lists lack the sampling keys split off above: a misspelt
        # repetition_penalty would get a list without it.
        raise BadOptionsError(f"{exc}; and every workload's sampling keys: {', '.join(SAMPLING_KEYS)}") from None
