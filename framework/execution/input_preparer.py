"""The ``InputPreparer`` interface: turns a ``SchedulerOutput`` into the tensors of one forward
pass. The model runner calls it once per step."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from framework.execution.attention import AttentionMetadata
from framework.common.registry import Registry
from framework.common.request import Request
from framework.scheduling.output import SchedulerOutput


@dataclass
class Penalties:
    """The penalties of the sampled rows that use any (``rows``, indices into the step's sampled
    rows); each tensor has one row per entry of ``rows``. ``token_ids`` holds each row's prompt
    then output tokens so far, padded with -1; its first ``num_prompt_tokens`` are the prompt.
    Presence and frequency penalties are 0 when off, the repetition penalty 1 (vLLM's names)."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    num_prompt_tokens: torch.Tensor
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor


@dataclass
class SamplingMetadata:
    """Per sampled row: temperature (0 = greedy), top-k (0 = off), top-p (1 = off), min-p (0 =
    off), and the request's own generator where it has a seed; ``penalties`` for the rows that use
    any. A filter or ``penalties`` is None when no row uses it. ``logprob_rows`` (device) and
    ``logprob_rows_cpu`` are the sampled rows that ask for logprobs, ``num_logprobs`` how many
    top tokens each asks for; all three None when no row asks."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    all_greedy: bool = True
    min_p: torch.Tensor | None = None
    penalties: Penalties | None = None
    logprob_rows: torch.Tensor | None = None
    logprob_rows_cpu: np.ndarray | None = None
    num_logprobs: list[int] | None = None


@dataclass
class PromptLogprobsMetadata:
    """The step's prompt positions whose logprobs requests asked for (``SamplingParams.
    prompt_logprobs``): ``indices`` into the step's flat hidden states and the prompt token each
    position predicts (``token_ids``, the next one), both on the device; request ``req_ids[i]``
    owns the next ``counts[i]`` of them and asks for ``num_logprobs[i]`` top tokens."""

    indices: torch.Tensor
    token_ids: torch.Tensor
    req_ids: list[str]
    counts: list[int]
    num_logprobs: list[int]


@dataclass
class ModelInput:
    """One forward pass: flat ``input_ids``/``positions`` of all scheduled tokens, the attention
    metadata, and which hidden states to sample from (``logits_indices``), for which requests.
    ``req_ids[i]`` is the request of the attention metadata's row ``i``. ``host`` keeps the CPU
    arrays the preparer computed (for tests, debugging and simulators). ``prompt_logprobs`` names
    the prompt positions to compute logprobs of, None when no scheduled request needs any."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_req_ids: list[str]
    sampling: SamplingMetadata
    host: dict[str, np.ndarray] = field(default_factory=dict)
    req_ids: list[str] = field(default_factory=list)
    prompt_logprobs: PromptLogprobsMetadata | None = None


class InputPreparer(ABC):
    """Builds model inputs from scheduler outputs, keeping whatever per-request state it likes
    between steps. Contract: ``prepare`` returns None for an empty step; otherwise each scheduled
    request's new tokens lie back to back, at positions ``num_computed_tokens ..
    num_computed_tokens + num_scheduled_tokens - 1``, in an order the preparer chooses (``v1``:
    ``SchedulerOutput.scheduled`` order; ``v0``: prefills first, then decodes) and reflected in
    the attention metadata. A request samples only when this step reaches its last known token (a
    chunk mid-prompt does not); ``sample_req_ids[i]`` is sampled from the hidden state at
    ``logits_indices[i]``. It may not modify the scheduler output or the requests.

    With ``forks_parallel_samples`` (vLLM v0's parallel sampling), a request whose ``forks`` list
    is not empty samples once for itself and once for each fork from the same logits row when its
    prompt completes; the engine then forks those requests from it (``Scheduler.fork``).
    Otherwise the engine runs the ``n`` samples of a request as ``n`` independent requests.

    ``check=True`` asks a preparer that keeps per-request state to compare it with the requests
    every step and raise AssertionError where they differ (slow; the engine sets it from
    ``check_invariants``).
    """

    name: ClassVar[str] = ""
    forks_parallel_samples: ClassVar[bool] = False

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
        """The model runner's report of the step just prepared: ``sampled[i]`` (int64, host) is
        the token sampled for ``model_input.sample_req_ids[i]``, which the scheduler is about to
        append to that request. A preparer that keeps token ids between steps may store them now
        instead of reading them back from the requests (as vLLM v1's runner does). Default: nothing."""

    # -- shared by the implementations -----------------------------------------------------------
    def model_input(self, host: dict[str, np.ndarray], req_ids: list[str], sample_req_ids: list[str],
                    sampling: SamplingMetadata, num_prefills: int, num_prefill_tokens: int,
                    num_decode_tokens: int, max_query_len: int | None = None,
                    max_seq_len: int | None = None) -> ModelInput:
        """Wrap the step's int64 host arrays as device tensors: on the CPU without a copy (the
        arrays are the step's own), elsewhere in one transfer from pinned memory. ``host`` holds
        ``input_ids``, ``positions``, ``slot_mapping``, ``query_start_loc``, ``seq_lens``,
        ``num_computed_tokens``, ``num_scheduled_tokens``, ``logits_indices`` and the 2-D
        ``block_table`` (null-padded, C-contiguous). ``max_query_len`` and ``max_seq_len`` are the
        maxima of ``num_scheduled_tokens`` and ``seq_lens``, when the caller has them."""
        block_table = host["block_table"]
        parts = [host["input_ids"], host["positions"], host["slot_mapping"], host["query_start_loc"],
                 host["seq_lens"], host["num_computed_tokens"], host["logits_indices"], block_table]
        if self.on_cpu:
            tensors = [torch.from_numpy(p) for p in parts]
        else:
            flat = parts[:-1] + [block_table.ravel()]
            packed = torch.from_numpy(np.concatenate(flat)).pin_memory().to(self.device, non_blocking=True)
            tensors = list(torch.split(packed, [len(p) for p in flat]))
            tensors[-1] = tensors[-1].view(block_table.shape)
        input_ids, positions, slot_mapping, qsl, seq_lens, computed, logits_indices, table = tensors
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
                          req_ids=req_ids)

    def sampling_metadata(self, temperature: np.ndarray, top_k: np.ndarray | None = None,
                          top_p: np.ndarray | None = None,
                          generators: dict[int, torch.Generator] | None = None, min_p: np.ndarray | None = None,
                          penalties: Penalties | None = None,
                          num_logprobs: np.ndarray | None = None) -> SamplingMetadata:
        """Per sampled row parameters (float32 temperature, top-p and min-p, int64 top-k, int64
        ``SamplingParams.logprobs`` with -1 for None) on the device. ``top_k`` / ``top_p`` /
        ``min_p`` / ``num_logprobs`` may be None when the caller knows no row uses them; each
        filter comes out None when no row uses it, the logprob rows when no row asks for logprobs,
        and ``all_greedy`` when every temperature is 0 (the float32 the sampler sees).
        ``penalties`` come from ``penalties``."""
        meta = SamplingMetadata(
            temperature=self._tensor(temperature),
            top_k=self._tensor(top_k) if top_k is not None and np.count_nonzero(top_k) else None,
            top_p=self._tensor(top_p) if top_p is not None and np.count_nonzero(top_p < 1) else None,
            generators=generators or {}, all_greedy=not np.count_nonzero(temperature),
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
        """The prompt positions of ``reqs`` (requests asking for prompt logprobs) this step
        computes and whose logprobs they still lack: request ``i`` computes positions
        ``computed[i] .. seq_lens[i] - 1``, its first at flat index ``first_index[i]``. Position
        ``p`` predicts prompt token ``p + 1``, so the last prompt position (which samples) is not
        one; positions before ``len(req.prompt_logprobs) - 1`` were done before (a request
        recomputed after preemption) and are skipped. None when no position is left."""
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
        tensor = torch.from_numpy(array)
        return tensor if self.on_cpu else tensor.to(self.device)

PREPARERS: Registry[InputPreparer] = Registry(
    "preparer", InputPreparer, entry_point_group="framework.preparers", builtin="framework.execution.preparers")
