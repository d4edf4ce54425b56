"""vLLM v1's flat persistent batch (seeds 000 and 001).

A token-id table ``(max_num_reqs, max_model_len)`` and a block table
``(max_num_reqs, ceil(max_model_len / block_size))`` keep one row per live request and are
updated incrementally: each step appends the tokens and blocks a request gained. The step's
inputs are then gathered from the tables with vectorised numpy and copied to the device once.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch

from framework.attention import AttentionMetadata
from framework.input_preparer import PREPARERS, InputPreparer, ModelInput, SamplingMetadata
from framework.request import Request
from framework.scheduler import SchedulerOutput


@PREPARERS.register("v1")
class FlatBatchPreparer(InputPreparer):
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu") -> None:
        super().__init__(max_num_reqs, max_model_len, block_size, max_num_batched_tokens, device)
        rows, width = max_num_reqs, self.max_blocks_per_req
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((rows, width), dtype=np.int64)
        self.row_num_tokens = np.zeros(rows, dtype=np.int64)
        self.row_num_blocks = np.zeros(rows, dtype=np.int64)
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.generators: list[torch.Generator | None] = [None] * rows
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows))  # a heap: the lowest free row is reused first
        self._arange = np.arange(max(max_num_batched_tokens, max_model_len) + 1, dtype=np.int64)
        self._pin = self.device.type == "cuda"

    # -- persistent rows -------------------------------------------------------------------------
    def _add_row(self, req: Request) -> None:
        if not self._free_rows:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        row = heapq.heappop(self._free_rows)
        self.row_of[req.request_id] = row
        n, nb = req.num_tokens, len(req.block_ids)
        self.token_ids[row, :n] = req.token_ids
        self.block_table[row, :nb] = req.block_ids
        self.row_num_tokens[row], self.row_num_blocks[row] = n, nb
        params = req.sampling_params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.generators[row] = req.generator

    def _remove_row(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self.block_table[row, : self.row_num_blocks[row]] = 0  # padding must read as the null block
        self.row_num_tokens[row] = self.row_num_blocks[row] = 0
        self.generators[row] = None
        heapq.heappush(self._free_rows, row)

    def _update_row(self, req: Request) -> None:
        row = self.row_of[req.request_id]
        n0, n = int(self.row_num_tokens[row]), req.num_tokens
        if n > n0:
            self.token_ids[row, n0:n] = req.token_ids[n0:]
            self.row_num_tokens[row] = n
        nb0, ids = int(self.row_num_blocks[row]), req.block_ids
        nb = len(ids)
        if nb0 and (nb < nb0 or self.block_table[row, nb0 - 1] != ids[nb0 - 1]):
            # Not an append (a copy-on-write replaced the last block): rewrite the row.
            self.block_table[row, :nb0] = 0
            nb0 = 0
        if nb > nb0:
            self.block_table[row, nb0:nb] = ids[nb0:]
        self.row_num_blocks[row] = nb

    # -- one step --------------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> ModelInput | None:
        for rid in out.finished_req_ids:
            self._remove_row(rid)
        for req in out.new_requests + out.resumed_requests:
            self._remove_row(req.request_id)
            self._add_row(req)
        reqs = out.scheduled
        if not reqs:
            return None
        rebuilt = {r.request_id for r in out.new_requests} | {r.request_id for r in out.resumed_requests}
        for req in reqs:
            if req.request_id not in rebuilt:
                self._update_row(req)
        n = len(reqs)
        rows = np.fromiter((self.row_of[r.request_id] for r in reqs), dtype=np.int64, count=n)
        num_sched = np.fromiter((out.num_scheduled_tokens[r.request_id] for r in reqs), dtype=np.int64, count=n)
        num_computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=n)
        num_tokens = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=n)
        host = self.build(rows, num_sched, num_computed, num_tokens)
        return self._to_device(host, reqs, rows)

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
        block_table_indices = token_rows * width + positions // bs
        block_numbers = self.block_table.ravel()[block_table_indices]
        block_offsets = positions % bs
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

    def _to_device(self, host: dict[str, np.ndarray], reqs: list[Request], rows: np.ndarray) -> ModelInput:
        n, total = len(reqs), len(host["input_ids"])
        block_table = host["block_table"]
        parts = [host["input_ids"], host["positions"], host["slot_mapping"], host["query_start_loc"],
                 host["seq_lens"], host["num_computed_tokens"], host["logits_indices"], block_table.ravel()]
        packed = torch.from_numpy(np.concatenate(parts))
        if self.device.type != "cpu":
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        views = torch.split(packed, [len(p) for p in parts])
        input_ids, positions, slot_mapping, qsl, seq_lens, computed, logits_indices, table = views
        num_decodes = int((host["num_scheduled_tokens"] == 1).sum())
        meta = AttentionMetadata(
            num_reqs=n, num_actual_tokens=total, max_query_len=int(host["num_scheduled_tokens"].max()),
            max_seq_len=int(host["seq_lens"].max()), block_size=self.block_size,
            query_start_loc=qsl, seq_lens=seq_lens, num_computed_tokens=computed,
            block_table=table.view(block_table.shape), slot_mapping=slot_mapping,
            query_start_loc_cpu=host["query_start_loc"], seq_lens_cpu=host["seq_lens"],
            num_computed_tokens_cpu=host["num_computed_tokens"], block_table_cpu=block_table,
            num_prefills=n - num_decodes, num_prefill_tokens=total - num_decodes, num_decode_tokens=num_decodes,
        )
        sample_rows = rows[host["do_sample"]]
        sample_req_ids = [r.request_id for r, s in zip(reqs, host["do_sample"]) if s]
        return ModelInput(
            input_ids=input_ids, positions=positions, attn_metadata=meta, logits_indices=logits_indices,
            sample_req_ids=sample_req_ids, sampling=self._sampling(sample_rows), host=host)

    def _sampling(self, rows: np.ndarray) -> SamplingMetadata:
        temperature = self.temperature[rows]
        top_k, top_p = self.top_k[rows], self.top_p[rows]
        dev = self.device
        return SamplingMetadata(
            temperature=torch.from_numpy(temperature).to(dev),
            top_k=torch.from_numpy(top_k).to(dev) if (top_k > 0).any() else None,
            top_p=torch.from_numpy(top_p).to(dev) if (top_p < 1.0).any() else None,
            generators={i: g for i, row in enumerate(rows) if (g := self.generators[row]) is not None},
            all_greedy=bool((temperature == 0).all()),
        )
