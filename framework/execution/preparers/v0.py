"""vLLM v0's input preparation, sequence group by sequence group (seeds 002 and 004).

Two stages, as in v0: ``to_metadata`` (v0's scheduler after scheduling) keeps a ``SequenceGroup`` per
live request group, one ``Sequence`` per request, and describes the step as ``SequenceGroupMetadata``,
prompt groups first, then one entry per decoding group; ``build`` (v0's model runner) walks that list
sequence by sequence in Python. Parallel sampling is v0's too: a request with ``forks`` prefills once
and its logits row is sampled for it and each fork (``forks_parallel_samples``).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq

import numpy as np
import torch

from framework.execution.input_preparer import PREPARERS, InputPreparer, ModelInput, Penalties
from framework.execution.preparers.sequence import (SequenceData, Sequence, SequenceGroup, SequenceGroupMetadata,
                                          SequenceStage, SequenceStatus)
from framework.common.request import Request
from framework.common.sampling_params import SamplingParams
from framework.scheduling.output import SchedulerOutput

_PREFILL = SequenceStage.PREFILL


@PREPARERS.register("v0")
class SequenceGroupPreparer(InputPreparer):
    forks_parallel_samples = True

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu", check: bool = False) -> None:
        super().__init__(max_num_reqs, max_model_len, block_size, max_num_batched_tokens, device, check)
        self.groups: dict[str, SequenceGroup] = {}
        self.seqs: dict[str, Sequence] = {}          # by request id: each request is one sequence
        self._request_of: dict[int, Request] = {}   # by sequence id
        self._group_of: dict[int, SequenceGroup] = {}
        self._seq_ids = itertools.count()

    # -- sequences follow the requests -----------------------------------------------------------
    def _drop(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        seq.status = self._request_of.pop(seq.seq_id).status
        group = self._group_of.pop(seq.seq_id)
        group.remove(seq.seq_id)
        if not group.seqs_dict:
            del self.groups[group.request_id]

    def _admit(self, req: Request) -> None:
        """(Re)build the sequence of a request that runs for the first time or comes back."""
        self._drop(req.request_id)
        seq = Sequence(next(self._seq_ids), req.prompt_token_ids, self.block_size, data=_data_of(req))
        seq.status = SequenceStatus.RUNNING
        group_id = req.parent_id or req.request_id
        group = self.groups.get(group_id)
        if group is None:
            params = req.sampling_params
            if req.forks:
                params = dataclasses.replace(params, n=1 + len(req.forks))
            group = self.groups[group_id] = SequenceGroup(group_id, [seq], params, req.arrival_time)
        else:
            group.add(seq)
        self.seqs[req.request_id] = seq
        self._request_of[seq.seq_id] = req
        self._group_of[seq.seq_id] = group

    # -- v0's scheduler: the step as sequence group metadata -------------------------------------
    def to_metadata(self, out: SchedulerOutput) -> list[SequenceGroupMetadata]:
        """Bring the sequences up to date with the requests and describe the step, prompt groups
        first (in scheduled order), then one entry per group with decoding sequences."""
        for rid in out.finished_req_ids:
            self._drop(rid)
        rebuilt = set()
        for req in out.new_requests + out.resumed_requests:
            self._admit(req)
            rebuilt.add(req.request_id)
        bs, num_sched = self.block_size, out.num_scheduled_tokens
        prompts: list[SequenceGroupMetadata] = []
        decodes: dict[str, SequenceGroupMetadata] = {}
        for req in out.scheduled:
            rid = req.request_id
            seq = self.seqs[rid]
            data = seq.data
            if rid not in rebuilt:
                # v0 counts a step's tokens as computed before appending the sampled token, so a
                # chunk that reached the last known token leaves the sequence in DECODE.
                delta = req.num_computed_tokens - data.get_num_computed_tokens()
                if delta:
                    data.update_num_computed_tokens(delta)
                n_old = data.get_len()
                if req.num_tokens > n_old:
                    data.extend_token_ids(req.token_ids[n_old:])
            if self.check and (data.get_token_ids() != req.token_ids
                               or data.get_num_computed_tokens() != req.num_computed_tokens):
                raise AssertionError(
                    f"v0 sequence of {rid} diverged from its request: {data.get_num_computed_tokens()} of "
                    f"{data.get_len()} tokens computed, request {req.num_computed_tokens} of {req.num_tokens}"
                    f"{'' if data.get_token_ids()[:req.num_tokens] == req.token_ids else ', other token ids'}")
            sid, group, n = seq.seq_id, self._group_of[seq.seq_id], num_sched[rid]
            if data.stage is _PREFILL:
                computed = data.get_num_computed_tokens()
                prompts.append(SequenceGroupMetadata(
                    group.request_id, True, {sid: data}, group.sampling_params, {sid: req.block_ids},
                    do_sample=computed + n == data.get_len(), token_chunk_size=n,
                    computed_block_nums=req.block_ids[: computed // bs]))
                continue
            if n != 1:
                raise ValueError(f"{rid} is decoding but {n} tokens are scheduled for it")
            meta = decodes.get(group.request_id)
            if meta is None:
                decodes[group.request_id] = SequenceGroupMetadata(
                    group.request_id, False, {sid: data}, group.sampling_params, {sid: req.block_ids},
                    do_sample=True, token_chunk_size=1)
            else:
                meta.seq_data[sid] = data
                meta.block_tables[sid] = req.block_ids
        return prompts + list(decodes.values())

    # -- v0's model runner: the model input, sequence by sequence --------------------------------
    def build(self, metas: list[SequenceGroupMetadata]) -> ModelInput:
        """The model input of ``metas`` (prompt entries before decode entries), sequence by
        sequence."""
        bs, request_of = self.block_size, self._request_of
        input_tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        req_ids: list[str] = []
        logits_indices: list[int] = []
        sample_reqs: list[Request] = []
        sample_data: list[SequenceData] = []  # the tokens each sample has seen (a fork's: its leader's)
        num_prefills = num_prefill_tokens = 0
        total = 0
        # Prompt chunks of requests asking for prompt logprobs: request, first flat index, span.
        prompt_logprob_chunks: list[tuple[Request, int, int, int]] = []
        for meta in metas:
            block_tables = meta.block_tables
            if meta.is_prompt:
                for sid, data in meta.seq_data.items():
                    ctx = data.get_num_computed_tokens()
                    seq_len = min(data.get_len(), ctx + meta.token_chunk_size)
                    input_tokens += data.get_token_ids()[ctx:seq_len]
                    positions += range(ctx, seq_len)
                    table = block_tables[sid]
                    pos = ctx
                    while pos < seq_len:  # one range of slots per block the chunk touches
                        off = pos % bs
                        end = min(seq_len, pos - off + bs)
                        first = table[pos // bs] * bs + off
                        slots += range(first, first + end - pos)
                        pos = end
                    q = seq_len - ctx
                    seq_lens.append(seq_len)
                    context_lens.append(ctx)
                    query_lens.append(q)
                    tables.append(table)
                    req = request_of[sid]
                    req_ids.append(req.request_id)
                    if req.prompt_logprobs is not None and ctx < req.num_prompt_tokens - 1:
                        prompt_logprob_chunks.append((req, total, ctx, seq_len))
                    num_prefills += 1
                    num_prefill_tokens += q
                    total += q
                    if meta.do_sample:
                        # v0 samples a prompt once per sequence its group will run (its forks).
                        for r in (req, *req.forks):
                            logits_indices.append(total - 1)
                            sample_reqs.append(r)
                            sample_data.append(data)
            else:
                for sid, data in meta.seq_data.items():
                    ctx = data.get_num_computed_tokens()
                    input_tokens.append(data.get_last_token_id())
                    positions.append(ctx)
                    table = block_tables[sid]
                    slots.append(table[ctx // bs] * bs + ctx % bs)
                    seq_lens.append(ctx + 1)
                    context_lens.append(ctx)
                    query_lens.append(1)
                    tables.append(table)
                    req = request_of[sid]
                    req_ids.append(req.request_id)
                    logits_indices.append(total)
                    sample_reqs.append(req)
                    sample_data.append(data)
                    total += 1
        num_seqs = len(seq_lens)
        width = max(map(len, tables))
        block_table = np.zeros((num_seqs, width), dtype=np.int64)  # 0 is the null block
        for i, table in enumerate(tables):
            block_table[i, : len(table)] = table
        query_lens_np = np.array(query_lens, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=query_start_loc[1:])
        host = {
            "input_ids": np.array(input_tokens, dtype=np.int64),
            "positions": np.array(positions, dtype=np.int64),
            "slot_mapping": np.array(slots, dtype=np.int64),
            "query_start_loc": query_start_loc,
            "seq_lens": np.array(seq_lens, dtype=np.int64),
            "num_computed_tokens": np.array(context_lens, dtype=np.int64),
            "num_scheduled_tokens": query_lens_np,
            "logits_indices": np.array(logits_indices, dtype=np.int64),
            "block_table": block_table,
        }
        params = [r.sampling_params for r in sample_reqs]
        sampling = self.sampling_metadata(
            np.array([p.temperature for p in params], dtype=np.float32),
            np.array([p.top_k for p in params], dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float32),
            {i: r.generator for i, r in enumerate(sample_reqs) if r.generator is not None},
            np.array([p.min_p for p in params], dtype=np.float32),
            self._penalties(params, sample_data),
            np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int64))
        model_input = self.model_input(host, req_ids, [r.request_id for r in sample_reqs], sampling,
                                       num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
                                       num_decode_tokens=total - num_prefill_tokens)
        if prompt_logprob_chunks:
            reqs, first, ctx, end = zip(*prompt_logprob_chunks)
            model_input.prompt_logprobs = self.prompt_logprobs_metadata(
                list(reqs), *(np.array(x, dtype=np.int64) for x in (first, ctx, end)))
        return model_input

    def _penalties(self, params: list[SamplingParams], data: list[SequenceData]) -> Penalties | None:
        """The penalised samples' tokens (prompt then output, padded with -1) and penalties, as
        v0's sampling tensors: one flat array of their tokens, scattered into the padded table."""
        idx = [i for i, p in enumerate(params) if p.penalized]
        if not idx:
            return None
        tokens: list[Seq[int]] = [data[i].get_token_ids() for i in idx]
        lens = np.fromiter(map(len, tokens), dtype=np.int64, count=len(idx))
        token_ids = np.full((len(idx), int(lens.max())), -1, dtype=np.int64)
        token_ids[np.arange(token_ids.shape[1]) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tokens), dtype=np.int64, count=int(lens.sum()))
        picked = [params[i] for i in idx]
        return self.penalties(
            np.array(idx, dtype=np.int64), token_ids,
            np.array([len(data[i].prompt_token_ids) for i in idx], dtype=np.int64),
            *(np.array([getattr(p, name) for p in picked], dtype=np.float32)
              for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")))

    def prepare(self, out: SchedulerOutput) -> ModelInput | None:
        metas = self.to_metadata(out)
        return self.build(metas) if metas else None


def _data_of(req: Request) -> SequenceData:
    """A request's sequence data. A request whose only uncomputed token is a sampled one (back
    from swap, or just forked) is decoding: count the rest computed, then append that token."""
    prompt, outputs = req.prompt_token_ids, req.output_token_ids
    computed = req.num_computed_tokens
    if outputs and computed == req.num_tokens - 1:
        data = SequenceData(prompt, outputs[:-1])
        data.update_num_computed_tokens(computed)
        data.append_token_id(outputs[-1])
    else:
        data = SequenceData(prompt, outputs)
        data.update_num_computed_tokens(computed)
    return data
