"""The ``InputPreparer`` interface (a ``SchedulerOutput`` in, one forward pass's tensors out) and its outputs."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from framework.execution.attention import AttentionMetadata
from framework.execution.host_memory import to_device
from framework.common.registry import Registry
from framework.common.request import Request
from framework.scheduling.output import SchedulerOutput


@dataclass
class Penalties:
    """Penalties of the sampled rows that use any (``rows``, indices into the step's sampled rows), one
    tensor row per entry of ``rows``: ``token_ids`` is prompt then output so far, padded with -1; presence
    and frequency penalties are 0 when off, the repetition penalty 1 (vLLM's names)."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    num_prompt_tokens: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor


@dataclass
class SamplingMetadata:
    """Per sampled row: temperature (0 = greedy; None when every row is, ``all_greedy``), top-k (0 = off),
    top-p (1 = off), min-p (0 = off) and the request's generator where it has a seed; a filter or
    ``penalties`` is None when no row uses it.
    ``logprob_rows`` (device), ``logprob_rows_cpu``: the rows asking for logprobs, ``num_logprobs`` how
    many top tokens each asks for; all three None when no row asks."""

    temperature: torch.Tensor | None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    all_greedy: bool = True
    min_p: torch.Tensor | None = None
    penalties: Penalties | None = None
    logprob_rows: torch.Tensor | None = None
    logprob_rows_cpu: np.ndarray | None = None
    num_logprobs: list[int] | None = None

    @property
    def argmax_only(self) -> bool:
        """Whether every row's token is its logits' argmax, with nothing else asked: greedy, no penalties,
        no logprobs."""
        return self.all_greedy and self.penalties is None and self.logprob_rows is None


@dataclass
class PromptLogprobsMetadata:
    """The step's prompt positions whose logprobs are asked for: ``indices`` into the flat hidden states
    and ``token_ids``, the prompt token each predicts (both on the device); request ``req_ids[i]`` owns
    the next ``counts[i]`` of them and asks for ``num_logprobs[i]`` top tokens."""

    indices: torch.Tensor
    token_ids: torch.Tensor
    req_ids: list[str]
    counts: list[int]
    num_logprobs: list[int]


@dataclass
class ModelInput:
    """One forward pass: flat ``input_ids``/``positions``, the attention metadata, the hidden states to
    sample (``logits_indices``) for ``sample_req_ids``; ``req_ids[i]`` owns attention row ``i``; ``host``
    keeps the preparer's CPU arrays; ``prompt_logprobs`` is None when no scheduled request needs any.
    ``deferred_tokens``: see the field."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_req_ids: list[str]
    sampling: SamplingMetadata
    host: dict[str, np.ndarray] = field(default_factory=dict)
    req_ids: list[str] = field(default_factory=list)
    prompt_logprobs: PromptLogprobsMetadata | None = None
    #: int64 ``[2, n]`` on the device: flat token indices, and indices into the previous step's sampled tokens,
    #: of the input tokens that step samples and the runner has not recorded (``InputPreparer.defer_sampled``);
    #: or None.
    deferred_tokens: torch.Tensor | None = None
    #: Off the CPU, for a step of one token per request: int64 ``[5, n]`` whose rows are ``input_ids``,
    #: ``positions``, ``slot_mapping``, ``seq_lens`` and ``num_computed_tokens`` (those tensors are its rows), so
    #: one copy moves all five; else None.
    token_rows: torch.Tensor | None = None


#: The constructor arguments the framework gives every preparer (``ModelExecutor``): not user options.
PREPARER_ARGUMENTS = ("max_num_reqs", "max_model_len", "block_size", "max_num_batched_tokens", "device", "check")


class InputPreparer(ABC):
    """Builds model inputs from scheduler outputs, keeping any per-request state between steps.

    ``prepare`` returns None for an empty step; otherwise each scheduled request's new tokens lie back
    to back at positions ``num_computed_tokens .. num_computed_tokens + num_scheduled_tokens - 1``, in
    an order the preparer chooses (``v1``: scheduled order; ``v0``: prefills, then decodes) and the
    attention metadata follows. A request samples only when the step reaches its last known token,
    ``sample_req_ids[i]`` from the hidden state at ``logits_indices[i]``. It may not modify the
    scheduler output or the requests. With ``forks_parallel_samples`` (vLLM v0), a request with
    ``forks`` samples once for itself and once per fork from the same row when its prompt completes.
    ``check=True`` (set from ``check_invariants``) compares kept state with the requests every step and
    raises AssertionError where they differ.
    """

    name: ClassVar[str] = ""
    forks_parallel_samples: ClassVar[bool] = False
    #: Whether it implements ``defer_sampled``, which async scheduling needs.
    defers_sampled: ClassVar[bool] = False

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu", check: bool = False) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        self.check = check

    @abstractmethod
    def prepare(self, out: SchedulerOutput) -> ModelInput | None: ...

    def record_sampled(self, model_input: ModelInput, sampled: np.ndarray) -> None:
        """``sampled[i]`` (int64, host) is the token sampled for ``model_input.sample_req_ids[i]`` in the
        step just prepared, about to be appended to that request; a preparer may store it now rather than
        read it back from the request later (as vLLM v1's runner does). Default: nothing."""

    def defer_sampled(self, model_input: ModelInput) -> None:
        """Async scheduling: the step just prepared samples tokens the host learns only later (then through
        ``record_sampled``); the next step's ``ModelInput.deferred_tokens`` says which of its inputs they are."""
        raise NotImplementedError(f"preparer {self.name!r} cannot defer sampled tokens (async scheduling)")

    def cancel_deferred(self) -> None:
        """Forget the deferred steps (they failed: their requests' rows are rebuilt)."""

    def needs_known_tokens(self) -> bool:
        """Whether the next step needs every earlier sampled token recorded first (none deferred)."""
        return False

    # -- shared by the implementations -----------------------------------------------------------
    def model_input(self, host: dict[str, np.ndarray], req_ids: list[str], sample_req_ids: list[str],
                    sampling: SamplingMetadata, num_prefills: int, num_prefill_tokens: int,
                    num_decode_tokens: int, max_query_len: int | None = None,
                    max_seq_len: int | None = None, deferred_tokens: np.ndarray | None = None) -> ModelInput:
        """Wrap the step's int64 host arrays as device tensors (on the CPU without a copy, elsewhere in
        one pinned transfer): ``input_ids``, ``positions``, ``slot_mapping``, ``query_start_loc``,
        ``seq_lens``, ``num_computed_tokens``, ``num_scheduled_tokens``, ``logits_indices`` and the 2-D
        ``block_table`` (null-padded, C-contiguous), and ``deferred_tokens`` if given. ``max_query_len``,
        ``max_seq_len``: the maxima of ``num_scheduled_tokens`` and ``seq_lens``, when the caller has them."""
        block_table = host["block_table"]
        # The first five back to back, so that for one token per request they are the rows of ``token_rows``.
        parts = [host["input_ids"], host["positions"], host["slot_mapping"], host["seq_lens"],
                 host["num_computed_tokens"], host["query_start_loc"], host["logits_indices"], block_table]
        if deferred_tokens is not None:
            parts.append(deferred_tokens)
        token_rows = None
        if self.on_cpu:
            tensors = [torch.from_numpy(p) for p in parts]
        else:
            flat = [p.ravel() for p in parts]
            packed = torch.from_numpy(np.concatenate(flat)).pin_memory().to(self.device, non_blocking=True)
            tensors = [t.view(p.shape) for t, p in zip(torch.split(packed, [len(p) for p in flat]), parts)]
            n = len(host["input_ids"])
            if n == len(host["seq_lens"]):
                token_rows = packed[: 5 * n].view(5, n)
        input_ids, positions, slot_mapping, seq_lens, computed, qsl, logits_indices, table = tensors[:8]
        meta = AttentionMetadata(
            num_reqs=len(host["seq_lens"]), num_actual_tokens=len(host["input_ids"]),
            max_query_len=int(host["num_scheduled_tokens"].max()) if max_query_len is None else max_query_len,
            max_seq_len=int(host["seq_lens"].max()) if max_seq_len is None else max_seq_len,
            block_size=self.block_size, query_start_loc=qsl, seq_lens=seq_lens, num_computed_tokens=computed,
            block_table=table, slot_mapping=slot_mapping,
            query_start_loc_cpu=host["query_start_loc"], seq_lens_cpu=host["seq_lens"],
            num_computed_tokens_cpu=host["num_computed_tokens"], block_table_cpu=block_table,
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens, num_decode_tokens=num_decode_tokens)
        return ModelInput(input_ids=input_ids, positions=positions, attn_metadata=meta,
                          logits_indices=logits_indices, sample_req_ids=sample_req_ids, sampling=sampling, host=host,
                          req_ids=req_ids, deferred_tokens=tensors[8] if deferred_tokens is not None else None,
                          token_rows=token_rows)

    def sampling_metadata(self, temperature: np.ndarray, top_k: np.ndarray | None = None,
                          top_p: np.ndarray | None = None,
                          generators: dict[int, torch.Generator] | None = None, min_p: np.ndarray | None = None,
                          penalties: Penalties | None = None,
                          num_logprobs: np.ndarray | None = None) -> SamplingMetadata:
        """Per sampled row parameters on the device: float32 temperature, top-p and min-p, int64 top-k and
        ``num_logprobs`` (-1: None); an optional one may be None when no row uses it. A filter or the
        logprob rows come out None when no row uses them, ``all_greedy`` (and temperature None) when every
        temperature is 0."""
        all_greedy = not np.count_nonzero(temperature)
        meta = SamplingMetadata(
            temperature=None if all_greedy else self._tensor(temperature),
            top_k=self._tensor(top_k) if top_k is not None and np.count_nonzero(top_k) else None,
            top_p=self._tensor(top_p) if top_p is not None and np.count_nonzero(top_p < 1) else None,
            generators=generators or {}, all_greedy=all_greedy,
            min_p=self._tensor(min_p) if min_p is not None and np.count_nonzero(min_p) else None,
            penalties=penalties)
        if num_logprobs is not None:
            rows = np.flatnonzero(num_logprobs >= 0)
            if len(rows):
                meta.logprob_rows, meta.logprob_rows_cpu = self._tensor(rows), rows
                meta.num_logprobs = num_logprobs[rows].tolist()
        return meta

    def prompt_logprobs_metadata(self, reqs: list[Request], first_index: np.ndarray, computed: np.ndarray,
                                 seq_lens: np.ndarray) -> PromptLogprobsMetadata | None:
        """The prompt positions of ``reqs`` (requests asking for prompt logprobs) this step computes and whose
        logprobs they lack (position ``p`` predicts prompt token ``p + 1``): request ``i`` computes
        ``computed[i] .. seq_lens[i] - 1``, the first at flat index ``first_index[i]``. None if there are none."""
        req_ids: list[str] = []
        counts: list[int] = []
        num_logprobs: list[int] = []
        indices: list[np.ndarray] = []
        targets: list[int] = []
        for req, first, ctx, end in zip(reqs, first_index.tolist(), computed.tolist(), seq_lens.tolist()):
            assert req.prompt_logprobs is not None
            start = max(ctx, len(req.prompt_logprobs) - 1)
            end = min(end, len(req.prompt_token_ids) - 1)
            if start >= end:
                continue
            req_ids.append(req.request_id)
            counts.append(end - start)
            num_logprobs.append(req.sampling_params.prompt_logprobs)
            indices.append(np.arange(first + start - ctx, first + end - ctx, dtype=np.int64))
            targets += req.prompt_token_ids[start + 1:end + 1]
        if not req_ids:
            return None
        return PromptLogprobsMetadata(self._tensor(np.concatenate(indices)),
                                      self._tensor(np.array(targets, dtype=np.int64)), req_ids, counts, num_logprobs)

    def penalties(self, rows: np.ndarray, token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
                  presence: np.ndarray, frequency: np.ndarray, repetition: np.ndarray) -> Penalties | None:
        """The ``Penalties`` of sampled rows ``rows`` (int64; None when empty): their int64
        ``token_ids`` (prompt then output, padded with -1), prompt lengths and float32 penalties."""
        if not len(rows):
            return None
        return Penalties(*map(self._tensor, (rows, token_ids, num_prompt_tokens, presence, frequency, repetition)))

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

PREPARERS: Registry[InputPreparer] = Registry(
    "preparer", InputPreparer, entry_point_group="framework.preparers", builtin="framework.execution.preparers")
