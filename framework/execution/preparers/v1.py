"""vLLM v1's flat persistent batch (seeds 000 and 001).

As vLLM v1's model runner, the preparer keeps one row per live request: its tokens in a token table
``(max_num_reqs, max_model_len rounded up to whole blocks)``, its blocks in a block table
``(max_num_reqs, ceil(max_model_len / block_size))``, its computed and known token counts. A row is
built from its request when it enters the batch (new, resumed, forked), then follows the scheduled
counts and ``record_sampled``; only blocks it newly needs, or tokens nobody recorded, are read from the
request. The requests stay the source of truth: ``check=True`` compares each scheduled row with its own.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import compress
from operator import attrgetter, itemgetter

import numpy as np
import torch

from framework.execution.input_preparer import (PREPARERS, InputPreparer, ModelInput, Penalties, PromptLogprobsMetadata,
                                      SamplingMetadata)
from framework.common.request import PLACEHOLDER, Request
from framework.scheduling.output import SchedulerOutput

_request_id = attrgetter("request_id")

# Which sampler features a row needs; the preparer counts the live rows of each combination.
_RANDOM, _TOP_K, _TOP_P, _SEEDED, _MIN_P, _PENALIZED, _LOGPROBS, _PROMPT_LOGPROBS = 1, 2, 4, 8, 16, 32, 64, 128
# Compared as the float32 the sampler sees: below 2**-150 a temperature rounds to 0 (greedy), and
# from 1 - 2**-25 a top-p rounds to 1 (off).
_MIN_TEMPERATURE, _MAX_TOP_P = 2.0 ** -150, 1.0 - 2.0 ** -25


def _flags(req: Request) -> int:
    p = req.sampling_params
    return ((_RANDOM if p.temperature > _MIN_TEMPERATURE else 0) | (_TOP_K if p.top_k > 0 else 0)
            | (_TOP_P if p.top_p < _MAX_TOP_P else 0) | (_SEEDED if req.generator is not None else 0)
            | (_MIN_P if p.min_p > 0 else 0) | (_PENALIZED if p.penalized else 0)
            | (_LOGPROBS if p.logprobs is not None else 0) | (_PROMPT_LOGPROBS if p.prompt_logprobs is not None else 0))


class _HostArrays(dict):
    """The step's host arrays. ``req_indices`` (each token's batch row) and ``arange`` (each token's index
    in its request's chunk), vLLM intermediates the step never needs, are computed when first read.
    As in seed 001, ``token_indices`` is ``req_indices * token table width + positions`` and
    ``block_table_indices`` is ``req_indices * max_blocks_per_req + positions // block_size``."""

    def __missing__(self, key: str) -> np.ndarray:
        num_sched = self["num_scheduled_tokens"]
        if key == "req_indices":
            # The persistent batch's rows, not the step's order: rows are reused as requests come
            # and go, and the token and block table indices are taken in those rows.
            value = self["rows"].repeat(num_sched)
        elif key == "arange":
            value = self["positions"] - self["num_computed_tokens"].repeat(num_sched)
        else:
            raise KeyError(key)
        self[key] = value
        return value


def _same_tokens(row: list[int], request: list[int]) -> bool:
    """Whether a row's tokens are its request's, where a request's placeholder matches any token."""
    return row == request or len(row) == len(request) and all(
        a == b or b == PLACEHOLDER for a, b in zip(row, request))


@PREPARERS.register("v1")
class FlatBatchPreparer(InputPreparer):
    defers_sampled = True

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu", check: bool = False) -> None:
        super().__init__(max_num_reqs, max_model_len, block_size, max_num_batched_tokens, device, check)
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        rows, width = max_num_reqs, self.max_blocks_per_req
        # Rows are whole blocks wide, so a token's block-table index is its token-table index
        # shifted right.
        self.token_ids = np.zeros((rows, width * block_size), dtype=np.int64)
        self.block_table = np.zeros((rows, width), dtype=np.int64)
        self._token_ids_flat, self._block_table_flat = self.token_ids.ravel(), self.block_table.ravel()
        # A row's numbers side by side, so a step reads them in one gather and a new row writes them
        # in one assignment: tokens known, tokens computed, tokens its blocks hold, top-k, (fixed)
        # where the row starts in the flattened token table, and its prompt's length.
        self._row_ints = np.zeros((rows, 6), dtype=np.int64)
        (self.row_num_tokens, self.row_num_computed, self.row_capacity, self.top_k, _,
         self.row_num_prompt_tokens) = self._row_ints.T
        # temperature, top-p, min-p, presence, frequency and repetition penalties
        self._row_floats = np.ones((rows, 6), dtype=np.float32)
        (self.temperature, self.top_p, self.min_p, self.presence_penalty, self.frequency_penalty,
         self.repetition_penalty) = self._row_floats.T
        self.generators: list[torch.Generator | None] = [None] * rows
        # SamplingParams.logprobs per row (-1: None), and whether it asks for prompt logprobs.
        self.num_logprobs = np.full(rows, -1, dtype=np.int64)
        self.asks_prompt_logprobs = np.zeros(rows, dtype=bool)
        self._row_flags = [0] * rows
        self._num_live = [0] * 256  # live rows with each combination of flags
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows))  # a heap: the lowest free row is reused first
        self._arange = np.arange(max(max_num_batched_tokens, max_model_len) + 1, dtype=np.int64)
        self._shift = block_size.bit_length() - 1  # block sizes are powers of two: divide by bits
        # The last prepared step, until the runner records its sampled tokens: the model input,
        # where each sampled token goes in the token table, the sampled rows, and which of them
        # have room for it (None: all).
        self._pending: tuple[ModelInput, np.ndarray, np.ndarray, np.ndarray | None] | None = None
        # Whether a step's sampled tokens went unrecorded, so rows may lack tokens their requests have.
        self._rows_may_lag = False
        # Steps whose sampled tokens stay on the device for now (defer_sampled), by id of their input: the
        # token table slots, rows, their generations (bumped when a row is reused) and sampled indices.
        self._deferred: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._row_gen = np.zeros(rows, dtype=np.int64)
        # Of the last step deferred: each row's index in its sampled tokens (-1: none), and that token's position.
        self._deferred_src = np.full(rows, -1, dtype=np.int64)
        self._deferred_pos = np.zeros(rows, dtype=np.int64)
        self._deferred_last: int | None = None

    # -- rows enter and leave --------------------------------------------------------------------
    def _add_rows(self, reqs: list[Request]) -> None:
        """Build the rows of requests entering the batch from the requests themselves."""
        if len(reqs) > len(self._free_rows):
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        rows = [heapq.heappop(self._free_rows) for _ in reqs]
        self.row_of.update(zip(map(_request_id, reqs), rows))
        self._row_gen[rows] += 1
        tokens, blocks, row_ints, row_floats = self.token_ids, self.block_table, self._row_ints, self._row_floats
        shift, width = self._shift, tokens.shape[1]
        for row, req in zip(rows, reqs):  # a few requests per step; their prompts are converted once
            num_tokens, num_blocks = len(req.token_ids), len(req.block_ids)
            tokens[row, :num_tokens] = req.token_ids
            blocks[row, :num_blocks] = req.block_ids
            params = req.sampling_params
            row_ints[row] = (num_tokens, req.num_computed_tokens, num_blocks << shift, params.top_k, row * width,
                             len(req.prompt_token_ids))
            row_floats[row] = (params.temperature, params.top_p, params.min_p, params.presence_penalty,
                               params.frequency_penalty, params.repetition_penalty)
            self.generators[row] = req.generator
            self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
            self.asks_prompt_logprobs[row] = params.prompt_logprobs is not None
            self._row_flags[row] = flags = _flags(req)
            self._num_live[flags] += 1

    def _remove_rows(self, request_ids: Iterable[str]) -> None:
        freed = []
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self.generators[row] = None
                self._num_live[self._row_flags[row]] -= 1
                heapq.heappush(self._free_rows, row)
                freed.append(row)
        if freed:
            # A reused row must read as the null block past its new request's blocks; its other
            # arrays are rewritten by _add_rows.
            self.block_table[freed] = 0
            self._deferred_src[freed] = -1

    def _follow_requests(self, out: SchedulerOutput) -> None:
        new, resumed = out.new_requests, out.resumed_requests
        rebuilt = list({r.request_id: r for r in new + resumed}.values()) if resumed else new
        if out.finished_req_ids or rebuilt:
            self._remove_rows([*out.finished_req_ids, *map(_request_id, rebuilt)])
        if rebuilt:
            self._add_rows(rebuilt)
        elif not self.row_of:
            self._rows_may_lag = False  # no rows, none lagging

    # -- rows catch up with their requests -------------------------------------------------------
    @staticmethod
    def _requests(reqs: list[Request], ids: list[str], idx: list[int]) -> list[Request]:
        """``reqs[i]`` for each ``i`` in ``idx``, checked against ``ids[i]``."""
        picked = [reqs[i] for i in idx]
        if [r.request_id for r in picked] != [ids[i] for i in idx]:
            raise ValueError("SchedulerOutput.num_scheduled_tokens must list the scheduled requests in "
                             "scheduled order")
        return picked

    def _read_tokens(self, reqs: list[Request], ids: list[str], idx: np.ndarray, rows: np.ndarray,
                     num_tokens: np.ndarray) -> None:
        """Rows whose step goes past their known tokens: their requests gained tokens that the
        runner did not record (a caller that prepares steps without ``record_sampled``)."""
        idx_list = idx.tolist()
        for i, req in zip(idx_list, self._requests(reqs, ids, idx_list)):
            row, known = int(rows[i]), int(num_tokens[i])
            tail = req.token_ids[known:]
            self.token_ids[row, known: known + len(tail)] = tail
            num_tokens[i] = self.row_num_tokens[row] = known + len(tail)

    def _read_blocks(self, reqs: list[Request], ids: list[str], idx: np.ndarray, rows: np.ndarray,
                     capacity: np.ndarray, seq_lens: np.ndarray) -> None:
        """Rows whose step reaches past their blocks: read the new ones off their requests."""
        rows, first = rows.take(idx), capacity.take(idx) >> self._shift
        end = (seq_lens.take(idx) + (self.block_size - 1)) >> self._shift
        width, table = self.max_blocks_per_req, self.block_table
        where: list[int] = []
        new_blocks: list[int] = []
        for req, row, a, b in zip(self._requests(reqs, ids, idx.tolist()), rows.tolist(), first.tolist(), end.tolist()):
            if b - a == 1:  # typically a decode crossing into a new block: gathered for one assignment
                where.append(row * width + a)
                new_blocks.append(req.block_ids[a])
            else:
                table[row, a:b] = req.block_ids[a:b]
        if where:
            self._block_table_flat[np.array(where, dtype=np.int64)] = new_blocks
        self.row_capacity[rows] = end << self._shift

    def _read_copies(self, out: SchedulerOutput, ids: list[str], rows: np.ndarray, computed: np.ndarray) -> None:
        """Copy-on-write gave a request a private copy of the shared block it writes into first
        (the one holding its next position, when that is mid-block): re-read that block for the
        rows that held a copied block there."""
        index = np.minimum(computed >> self._shift, self.max_blocks_per_req - 1)
        held = self.block_table[rows, index]
        mid_block = (computed & (self.block_size - 1)) != 0
        sources = np.fromiter((src for src, _ in out.blocks_to_copy), dtype=np.int64)
        idx = (mid_block & np.isin(held, sources)).nonzero()[0].tolist()
        for i, req in zip(idx, self._requests(out.scheduled, ids, idx)):
            k = int(index[i])
            self.block_table[rows[i], k] = req.block_ids[k]

    def _check_rows(self, reqs: list[Request], ids: list[str], rows: np.ndarray) -> None:
        """Every scheduled row equals its request (the ``check`` option)."""
        if [r.request_id for r in reqs] != ids:
            raise AssertionError("SchedulerOutput.num_scheduled_tokens does not list the scheduled requests "
                                 "in scheduled order")
        for req, row in zip(reqs, rows.tolist()):
            num_tokens, num_blocks = int(self.row_num_tokens[row]), int(self.row_capacity[row]) >> self._shift
            diverged = [
                name for name, ok in (
                    ("computed tokens", self.row_num_computed[row] == req.num_computed_tokens),
                    ("token ids", _same_tokens(self.token_ids[row, :num_tokens].tolist(), req.token_ids)),
                    ("block ids", self.block_table[row, :num_blocks].tolist() == req.block_ids[:num_blocks]),
                ) if not ok]
            if diverged:
                raise AssertionError(
                    f"v1 row {row} of {req.request_id} diverged from its request ({', '.join(diverged)}): row has "
                    f"{self.row_num_computed[row]} of {num_tokens} tokens computed and {num_blocks} blocks, request "
                    f"{req.num_computed_tokens} of {req.num_tokens} and {len(req.block_ids)}")

    # -- one step --------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> ModelInput | None:
        if self._pending is not None and len(self._pending[2]):
            self._rows_may_lag = True
        self._pending = None
        self._follow_requests(out)
        counts = out.num_scheduled_tokens
        n = len(counts)
        if not n:
            return None
        reqs = out.scheduled
        if len(reqs) != n:
            raise ValueError(f"{len(reqs)} requests scheduled but {n} scheduled token counts")
        ids = list(counts)
        rows = np.fromiter(itemgetter(*ids)(self.row_of) if n > 1 else (self.row_of[ids[0]],), dtype=np.int64, count=n)
        num_sched = np.fromiter(counts.values(), dtype=np.int64, count=n)
        state = self._row_ints.take(rows, axis=0)
        num_tokens, computed, capacity = state[:, 0], state[:, 1].copy(), state[:, 2]
        seq_lens = computed + num_sched
        if self._rows_may_lag:
            behind = (seq_lens > num_tokens).nonzero()[0]
            if len(behind):
                num_tokens = num_tokens.copy()
                self._read_tokens(reqs, ids, behind, rows, num_tokens)
        short = (seq_lens > capacity).nonzero()[0]
        if len(short):
            self._read_blocks(reqs, ids, short, rows, capacity, seq_lens)
        if out.blocks_to_copy:
            self._read_copies(out, ids, rows, computed)
        if self.check:
            self._check_rows(reqs, ids, rows)
        self.row_num_computed[rows] = seq_lens
        model_input = self.build(ids, rows, num_sched, computed, seq_lens, num_tokens, state[:, 4])
        if self._live_flags() & _PROMPT_LOGPROBS:
            model_input.prompt_logprobs = self._prompt_logprobs(reqs, ids, rows, computed, seq_lens,
                                                                model_input.host["query_start_loc"])
        return model_input

    def _reads_deferred(self, rows: np.ndarray, computed: np.ndarray, seq_lens: np.ndarray,
                        query_start_loc: np.ndarray) -> np.ndarray | None:
        """Rows (flat token indices, indices into the last deferred step's sampled tokens) of the step's tokens
        that step samples, or None if it reads none."""
        src, pos = self._deferred_src.take(rows), self._deferred_pos.take(rows)
        reads = ((src >= 0) & (pos >= computed) & (pos < seq_lens)).nonzero()[0]
        if not len(reads):
            return None
        return np.stack([query_start_loc.take(reads) + pos.take(reads) - computed.take(reads), src.take(reads)])

    def _prompt_logprobs(self, reqs: list[Request], ids: list[str], rows: np.ndarray, computed: np.ndarray,
                         seq_lens: np.ndarray, query_start_loc: np.ndarray) -> PromptLogprobsMetadata | None:
        """The prompt positions of the scheduled rows that ask for prompt logprobs and are still
        in their prompt (``InputPreparer.prompt_logprobs_metadata``)."""
        idx = (self.asks_prompt_logprobs[rows] & (computed < self.row_num_prompt_tokens[rows] - 1)).nonzero()[0]
        if not len(idx):
            return None
        return self.prompt_logprobs_metadata(self._requests(reqs, ids, idx.tolist()), query_start_loc.take(idx),
                                             computed.take(idx), seq_lens.take(idx))

    def build(self, req_ids: list[str], rows: np.ndarray, num_sched: np.ndarray, computed: np.ndarray,
              seq_lens: np.ndarray, num_tokens: np.ndarray, row_start: np.ndarray) -> ModelInput:
        """The step of batch rows ``rows``: request ``i`` computes its tokens ``computed[i] ..
        seq_lens[i] - 1`` of ``num_tokens[i]`` known ones (all vectorised, no per-token loop);
        ``row_start`` is where each row starts in the flattened token table."""
        bs, shift, n = self.block_size, self._shift, len(req_ids)
        # The rows' block tables first: the per-token block lookups below then find them in cache.
        max_seq_len = int(seq_lens[seq_lens.argmax()])  # argmax: no ufunc reduction machinery
        block_table = self.block_table[rows, : -(-max_seq_len // bs)]
        query_start_loc = np.empty(n + 1, dtype=np.int64)
        query_start_loc[0] = 0
        cu_num_tokens = np.add.accumulate(num_sched, out=query_start_loc[1:])
        total = int(query_start_loc[n])
        arange = self._arange[:total]
        # Token t of request i sits at position computed[i] + (t - first token of i).
        offset = computed - query_start_loc[:n]
        positions = offset.repeat(num_sched)
        positions += arange
        token_indices = (row_start + offset).repeat(num_sched)
        token_indices += arange
        input_ids = self._token_ids_flat.take(token_indices)
        block_table_indices = token_indices >> shift
        block_numbers = self._block_table_flat.take(block_table_indices)
        block_offsets = positions & (bs - 1)
        slot_mapping = block_numbers << shift
        slot_mapping |= block_offsets
        do_sample = seq_lens == num_tokens
        sampled = do_sample.nonzero()[0]
        logits_indices = cu_num_tokens.take(sampled)
        logits_indices -= 1
        host = _HostArrays(
            cu_num_tokens=cu_num_tokens, positions=positions, token_indices=token_indices, input_ids=input_ids,
            block_table_indices=block_table_indices, block_numbers=block_numbers, block_offsets=block_offsets,
            slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
            num_computed_tokens=computed, num_scheduled_tokens=num_sched, do_sample=do_sample,
            logits_indices=logits_indices, block_table=block_table, rows=rows)
        sample_rows = rows.take(sampled)
        if 2 * len(sampled) > n:  # most rows sample: drop the others
            sample_req_ids = req_ids.copy()
            for i in reversed((~do_sample).nonzero()[0].tolist()):
                del sample_req_ids[i]
        else:
            sample_req_ids = list(map(req_ids.__getitem__, sampled.tolist()))
        num_decodes = np.count_nonzero(num_sched == 1)
        sampling = self._sampling(sample_rows)
        deferred = None
        if self._deferred_last is not None:
            deferred = self._reads_deferred(rows, computed, seq_lens, query_start_loc)
        model_input = self.model_input(
            host, req_ids, sample_req_ids, sampling, num_prefills=n - num_decodes,
            num_prefill_tokens=total - num_decodes, num_decode_tokens=num_decodes,
            max_query_len=int(num_sched[num_sched.argmax()]), max_seq_len=max_seq_len, deferred_tokens=deferred)
        # Each sampled token goes right after its row's last token, unless the row is full (the
        # request then ends with it).
        slots = token_indices.take(logits_indices)
        slots += 1
        room = None
        if max_seq_len >= self.token_ids.shape[1]:
            room = seq_lens.take(sampled) < self.token_ids.shape[1]
            slots = slots[room]
        self._pending = (model_input, slots, sample_rows, room)
        return model_input

    def _sampling(self, sample_rows: np.ndarray) -> SamplingMetadata:
        """The sampled rows' parameters; a filter, penalty or logprobs no live row uses is not looked at."""
        live = self._live_flags()
        generators = {}
        if live & _SEEDED:
            gens = self.generators
            generators = {i: gens[row] for i, row in enumerate(sample_rows.tolist()) if gens[row] is not None}
        return self.sampling_metadata(self.temperature[sample_rows],
                                      self.top_k[sample_rows] if live & _TOP_K else None,
                                      self.top_p[sample_rows] if live & _TOP_P else None, generators,
                                      self.min_p[sample_rows] if live & _MIN_P else None,
                                      self._penalties(sample_rows) if live & _PENALIZED else None,
                                      self.num_logprobs[sample_rows] if live & _LOGPROBS else None)

    def _live_flags(self) -> int:
        """The sampler features (``_flags``) some live row needs."""
        live = 0
        for flags in compress(range(256), self._num_live):
            live |= flags
        return live

    def _penalties(self, sample_rows: np.ndarray) -> Penalties | None:
        """The penalised sampled rows' tokens, gathered from the token table (their rows hold every
        known token: a row samples when it reaches its last one)."""
        floats = self._row_floats[sample_rows, 3:]
        idx = ((floats[:, 0] != 0) | (floats[:, 1] != 0) | (floats[:, 2] != 1)).nonzero()[0]
        rows = sample_rows.take(idx)
        num_tokens = self.row_num_tokens.take(rows)
        width = int(num_tokens.max()) if len(rows) else 0
        token_ids = self.token_ids[rows, :width]
        token_ids[self._arange[:width] >= num_tokens[:, None]] = -1
        floats = floats.take(idx, axis=0).T
        return self.penalties(idx.astype(np.int64), token_ids, self.row_num_prompt_tokens.take(rows),
                              *map(np.ascontiguousarray, floats))

    def needs_known_tokens(self) -> bool:
        """Whether a step must see every earlier step's sampled tokens on the host (a penalised row reads
        its whole history): then no step's tokens may still be deferred when it is prepared."""
        return bool(self._live_flags() & _PENALIZED)

    def cancel_deferred(self) -> None:
        self._deferred.clear()
        self._deferred_last = None
        self._deferred_src.fill(-1)

    def defer_sampled(self, model_input: ModelInput) -> None:
        """The step just prepared samples tokens that stay on the device for now (async scheduling): its rows
        count them at once, the next step reads them from the device (``ModelInput.deferred_tokens``), and
        ``record_sampled`` writes them into the token table once they are known."""
        pending = self._pending
        if pending is None or pending[0] is not model_input:
            raise ValueError("defer_sampled takes the model input of the step prepared last, once")
        self._pending = None
        _, slots, rows, room = pending
        index = np.arange(len(rows), dtype=np.int64)
        if room is not None:
            rows, index = rows[room], index[room]
        self._token_ids_flat[slots] = PLACEHOLDER
        self.row_num_tokens[rows] += 1
        self._deferred[id(model_input)] = (slots, rows, self._row_gen.take(rows), index)
        self._deferred_src.fill(-1)
        self._deferred_src[rows] = index
        self._deferred_pos[rows] = slots - rows * self.token_ids.shape[1]
        self._deferred_last = id(model_input)

    def record_sampled(self, model_input: ModelInput, sampled: np.ndarray) -> None:
        """Append each sampled token to its row, as the request will append it: the next step
        then finds the row up to date without reading the request. For a deferred step: write
        them into the rows still holding its requests."""
        deferred = self._deferred.pop(id(model_input), None)
        if deferred is not None:
            slots, rows, gens, index = deferred
            if self._deferred_last == id(model_input):
                self._deferred_last = None
                self._deferred_src.fill(-1)
            same = self._row_gen.take(rows) == gens
            self._token_ids_flat[slots[same]] = sampled[index[same]]
            return
        pending = self._pending
        if pending is None or pending[0] is not model_input:
            raise ValueError("record_sampled takes the model input of the step prepared last, once")
        _, slots, rows, room = pending
        if len(sampled) != len(rows):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(rows)} sampled rows")
        self._pending = None
        if room is not None:
            rows, sampled = rows[room], sampled[room]
        self._token_ids_flat[slots] = sampled
        self.row_num_tokens[rows] += 1
