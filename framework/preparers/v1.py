"""vLLM v1's flat persistent batch (seeds 000 and 001).

A token-id table ``(max_num_reqs, max_model_len)`` and a block table
``(max_num_reqs, ceil(max_model_len / block_size))`` keep one row per live request and are
updated incrementally: each step appends the tokens and blocks a request gained. The step's
inputs are then gathered from the tables with vectorised numpy and copied to the device once.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from itertools import chain, compress
from operator import attrgetter, itemgetter

import numpy as np
import torch

from framework.input_preparer import PREPARERS, InputPreparer, ModelInput
from framework.request import Request
from framework.scheduler import SchedulerOutput

_request_id = attrgetter("request_id")
_step_fields = attrgetter("request_id", "num_computed_tokens", "token_ids", "block_ids")
_token_ids = attrgetter("token_ids")
_block_ids = attrgetter("block_ids")
_sampling_params = attrgetter("sampling_params")
_last = itemgetter(-1)


@PREPARERS.register("v1")
class FlatBatchPreparer(InputPreparer):
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu") -> None:
        super().__init__(max_num_reqs, max_model_len, block_size, max_num_batched_tokens, device)
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        rows, width = max_num_reqs, self.max_blocks_per_req
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((rows, width), dtype=np.int64)
        self.row_num_tokens = np.zeros(rows, dtype=np.int64)
        self.row_num_blocks = np.zeros(rows, dtype=np.int64)
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.generators: list[torch.Generator | None] = [None] * rows
        self.has_generator = np.zeros(rows, dtype=bool)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows))  # a heap: the lowest free row is reused first
        self._arange = np.arange(max(max_num_batched_tokens, max_model_len) + 1, dtype=np.int64)

    # -- persistent rows -------------------------------------------------------------------------
    def _scatter(self, table: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 values: Iterable[int]) -> None:
        """``table[rows[i], starts[i]:starts[i] + counts[i]]`` = the next ``counts[i]`` values,
        for every ``i`` in one assignment."""
        total = int(counts.sum())
        if not total:
            return
        if len(rows) == 1:  # one request (a typical arrival): a plain slice
            start = int(starts[0])
            table[rows[0], start:start + total] = np.fromiter(values, dtype=np.int64, count=total)
            return
        arange = self._arange[:total] if total <= len(self._arange) else np.arange(total, dtype=np.int64)
        cols = np.repeat(starts - np.cumsum(counts) + counts, counts) + arange
        table[np.repeat(rows, counts), cols] = np.fromiter(values, dtype=np.int64, count=total)

    def _add_rows(self, reqs: list[Request]) -> None:
        if len(reqs) > len(self._free_rows):
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        rows = [heapq.heappop(self._free_rows) for _ in reqs]
        self.row_of.update(zip(map(_request_id, reqs), rows))
        rows_np = np.array(rows, dtype=np.int64)
        num_tokens = np.array(list(map(len, map(_token_ids, reqs))), dtype=np.int64)
        num_blocks = np.array(list(map(len, map(_block_ids, reqs))), dtype=np.int64)
        zeros = np.zeros(len(reqs), dtype=np.int64)
        self._scatter(self.token_ids, rows_np, zeros, num_tokens, chain.from_iterable(map(_token_ids, reqs)))
        self._scatter(self.block_table, rows_np, zeros, num_blocks, chain.from_iterable(map(_block_ids, reqs)))
        self.row_num_tokens[rows_np] = num_tokens
        self.row_num_blocks[rows_np] = num_blocks
        params = list(map(_sampling_params, reqs))
        self.temperature[rows_np] = [p.temperature for p in params]
        self.top_k[rows_np] = [p.top_k for p in params]
        self.top_p[rows_np] = [p.top_p for p in params]
        for row, req in zip(rows, reqs):
            self.generators[row] = req.generator
        self.has_generator[rows_np] = [req.generator is not None for req in reqs]

    def _remove_rows(self, request_ids: Iterable[str]) -> None:
        rows = [row for rid in request_ids if (row := self.row_of.pop(rid, None)) is not None]
        if not rows:
            return
        # A row's padding must read as the null block when it is reused; its other arrays are
        # rewritten by the next _add_rows.
        self.block_table[rows] = 0
        for row in rows:
            self.generators[row] = None
            heapq.heappush(self._free_rows, row)

    def _extend_rows(self, token_lists: Sequence[list[int]], block_lists: Sequence[list[int]], rows: np.ndarray,
                     num_tokens: np.ndarray, num_blocks: np.ndarray, replaced: bool) -> None:
        """Append to each row the tokens and blocks its request gained since the last step, one
        scatter per table for the whole batch. A block replaced in place (copy-on-write) always
        comes with a ``blocks_to_copy`` entry: only then (``replaced``) are the rows' last blocks
        compared with the requests'. A row whose blocks were replaced or dropped is rewritten."""
        old = self.row_num_tokens[rows]
        grow = num_tokens - old
        idx = np.flatnonzero(grow)
        if len(idx):
            if grow[idx].max() == 1:  # decodes: each gained its sampled token (all rows read at C speed)
                lasts = np.fromiter(map(_last, token_lists), dtype=np.int64, count=len(token_lists))
                self.token_ids[rows[idx], old[idx]] = lasts[idx]
            else:
                starts = old[idx]
                self._scatter(self.token_ids, rows[idx], starts, grow[idx], chain.from_iterable(
                    token_lists[i][n0:] for i, n0 in zip(idx.tolist(), starts.tolist())))
            self.row_num_tokens[rows[idx]] = num_tokens[idx]
        old_blocks = self.row_num_blocks[rows]
        stale = num_blocks < old_blocks
        if replaced:
            last = np.maximum(old_blocks - 1, 0)
            held = np.fromiter((b[k] if k < len(b) else -1 for b, k in zip(block_lists, last.tolist())),
                               dtype=np.int64, count=len(block_lists))
            stale |= (old_blocks > 0) & (self.block_table[rows, last] != held)
        if stale.any():
            for i in np.flatnonzero(stale).tolist():
                self.block_table[rows[i], : old_blocks[i]] = 0
                old_blocks[i] = 0
        gained = num_blocks - old_blocks
        idx = np.flatnonzero(gained)
        if len(idx):  # a few rows per step: read only theirs
            starts = old_blocks[idx]
            self._scatter(self.block_table, rows[idx], starts, gained[idx], chain.from_iterable(
                block_lists[i][nb0:] for i, nb0 in zip(idx.tolist(), starts.tolist())))
            self.row_num_blocks[rows[idx]] = num_blocks[idx]

    # -- one step --------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> ModelInput | None:
        rebuilt = list({r.request_id: r for r in out.new_requests + out.resumed_requests}.values())
        self._remove_rows(chain(out.finished_req_ids, map(_request_id, rebuilt)))
        if rebuilt:
            self._add_rows(rebuilt)
        reqs = out.scheduled
        if not reqs:
            return None
        # The only per-request Python: one C-level pass reads what each request holds (map and
        # attrgetter are the cheapest way CPython has), then everything is array work.
        n = len(reqs)
        ids, computed, token_lists, block_lists = zip(*map(_step_fields, reqs))
        rows = np.fromiter(map(self.row_of.__getitem__, ids), dtype=np.int64, count=n)
        num_sched = np.fromiter(map(out.num_scheduled_tokens.__getitem__, ids), dtype=np.int64, count=n)
        num_computed = np.array(computed, dtype=np.int64)
        num_tokens = np.fromiter(map(len, token_lists), dtype=np.int64, count=n)
        num_blocks = np.fromiter(map(len, block_lists), dtype=np.int64, count=n)
        # Rows just (re)built already match their requests; extending them is a no-op.
        self._extend_rows(token_lists, block_lists, rows, num_tokens, num_blocks, replaced=bool(out.blocks_to_copy))
        host = self.build(rows, num_sched, num_computed, num_tokens)
        return self._to_device(host, list(ids), rows)

    def build(self, rows: np.ndarray, num_sched: np.ndarray, num_computed: np.ndarray,
              num_tokens: np.ndarray) -> dict[str, np.ndarray]:
        """The step's host arrays for batch rows ``rows`` (all vectorised, no per-token loop)."""
        bs, width, max_len = self.block_size, self.max_blocks_per_req, self.max_model_len
        n = len(rows)
        cu_num_tokens = np.cumsum(num_sched)
        total = int(cu_num_tokens[-1])
        req_indices = np.repeat(np.arange(n, dtype=np.int64), num_sched)
        arange = self._arange[:total] - np.repeat(cu_num_tokens - num_sched, num_sched)
        positions = num_computed[req_indices] + arange
        token_rows = rows[req_indices]
        token_indices = token_rows * max_len + positions
        input_ids = self.token_ids.ravel()[token_indices]
        shift = bs.bit_length() - 1  # block sizes are powers of two: divide and modulo by bits
        block_table_indices = token_rows * width + (positions >> shift)
        block_numbers = self.block_table.ravel()[block_table_indices]
        block_offsets = positions & (bs - 1)
        slot_mapping = block_numbers * bs + block_offsets
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        query_start_loc[1:] = cu_num_tokens
        seq_lens = num_computed + num_sched
        do_sample = seq_lens == num_tokens
        logits_indices = cu_num_tokens[do_sample] - 1
        max_blocks = -(-int(seq_lens.max()) // bs)
        block_table = self.block_table[rows, :max_blocks]
        return {
            "req_indices": req_indices, "cu_num_tokens": cu_num_tokens, "arange": arange,
            "positions": positions, "token_indices": token_indices, "input_ids": input_ids,
            "block_table_indices": block_table_indices, "block_numbers": block_numbers,
            "block_offsets": block_offsets, "slot_mapping": slot_mapping,
            "query_start_loc": query_start_loc, "seq_lens": seq_lens, "num_computed_tokens": num_computed,
            "num_scheduled_tokens": num_sched, "do_sample": do_sample, "logits_indices": logits_indices,
            "block_table": block_table,
        }

    def _to_device(self, host: dict[str, np.ndarray], req_ids: list[str], rows: np.ndarray) -> ModelInput:
        n, total = len(req_ids), len(host["input_ids"])
        num_decodes = int((host["num_scheduled_tokens"] == 1).sum())
        do_sample = host["do_sample"]
        sample_rows = rows[do_sample]
        sample_req_ids = list(compress(req_ids, do_sample.tolist()))
        seeded = np.flatnonzero(self.has_generator[sample_rows]).tolist()
        generators = {i: self.generators[sample_rows[i]] for i in seeded}
        sampling = self.sampling_metadata(self.temperature[sample_rows], self.top_k[sample_rows],
                                          self.top_p[sample_rows], generators)
        return self.model_input(host, req_ids, sample_req_ids, sampling, num_prefills=n - num_decodes,
                                num_prefill_tokens=total - num_decodes, num_decode_tokens=num_decodes)
