"""Decode steps replayed from CUDA graphs captured at padded batch sizes (as vLLM and nano-vllm).

A decode-only step of ``n`` requests runs at the smallest captured size ``>= n``: its inputs are copied
into persistent buffers, the padding rows are dummy decodes of one key in the null block (slot 0, which
no request owns), and the graph replays the whole forward pass, the LM head and each row's argmax (a greedy
step's sampling; any other sampling runs on the graph's logits outside it).
Each size has a graph per bound on the longest sequence the backend asks for
(``AttentionBackend.graph_max_seq_lens``: short contexts need no key splits); a step takes the smallest
bound at or above its own longest.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from framework.execution.attention import AttentionBackend, AttentionMetadata
from framework.execution.input_preparer import ModelInput

logger = logging.getLogger(__name__)


@dataclass
class DecodeOutput:
    """A decode step's hidden states ``[rows, hidden]``, float32 logits ``[rows, vocab]`` and each row's
    argmax (``greedy``, int64 ``[rows]``); buffers the next forward pass overwrites."""

    hidden: torch.Tensor
    logits: torch.Tensor
    greedy: torch.Tensor

    def rows(self, n: int) -> DecodeOutput:
        return DecodeOutput(self.hidden[:n], self.logits[:n], self.greedy[:n])


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, then multiples of 8, up to and including ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def is_graph_decode(inputs: ModelInput, max_size: int) -> bool:
    """Whether a step is decodes only (one new token per request), at most ``max_size`` of them."""
    meta = inputs.attn_metadata
    return meta.max_query_len == 1 and meta.num_actual_tokens == meta.num_reqs <= max_size


class PaddedDecode:
    """The persistent inputs of decode steps of up to ``max(sizes)`` requests, and the forward pass over
    them at a padded size. ``run`` computes eagerly; ``DecodeGraphs`` replays captured graphs instead."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_cache: torch.Tensor,
                 sizes: list[int], max_model_len: int, block_size: int) -> None:
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.sizes = sorted(sizes)
        self.bounds = {size: backend.graph_max_seq_lens(size, max_model_len) for size in self.sizes}
        self.max_model_len = max_model_len
        self.block_size = block_size
        n, dev = self.sizes[-1], kv_cache.device

        # ModelInput.token_rows' layout, so a step's rows arrive in one copy; every row a padding row.
        self.token_rows = torch.zeros(5, n, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.num_computed_tokens = self.token_rows
        self.seq_lens.fill_(1)
        #: A padding row's slot, length and computed tokens (its token, position and table may be any valid ones).
        self.padding = torch.tensor([[0], [1], [0]], dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(n, -(-max_model_len // block_size), dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=dev)
        # Every size's logits and argmax, made by the first (largest) forward pass: a graph's own outputs
        # would stay in the shared pool, a [size, vocab] float32 tensor per graph.
        self.logits: torch.Tensor | None = None
        self.greedy = torch.zeros(n, dtype=torch.int64, device=dev)

    def size_for(self, num_reqs: int) -> int:
        return next(s for s in self.sizes if s >= num_reqs)

    def key_for(self, num_reqs: int, max_seq_len: int) -> tuple[int, int]:
        """(padded size, bound on the longest sequence) of the forward pass a step of these runs at."""
        size = self.size_for(num_reqs)
        return size, next(b for b in self.bounds[size] if b >= max_seq_len)

    def keys(self) -> list[tuple[int, int]]:
        """Every (size, bound), largest first."""
        return sorted(((size, bound) for size, bounds in self.bounds.items() for bound in bounds), reverse=True)

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """The common metadata of a ``size``-row step over the persistent buffers, its sequences at most
        ``max_seq_len`` long. Its host arrays describe the padding (what the buffers hold before any
        step), not a step's values."""
        host_seq = np.ones(size, dtype=np.int64)
        return AttentionMetadata(
            num_reqs=size, num_actual_tokens=size, max_query_len=1, max_seq_len=max_seq_len,
            block_size=self.block_size, query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], num_computed_tokens=self.num_computed_tokens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=np.arange(size + 1, dtype=np.int64), seq_lens_cpu=host_seq,
            num_computed_tokens_cpu=host_seq - 1, block_table_cpu=np.zeros((size, 1), dtype=np.int64),
            num_decode_tokens=size)

    def fill(self, inputs: ModelInput, size: int) -> None:
        """Copy a step's inputs into the first rows, and make rows ``num_reqs .. size`` dummy decodes:
        one key at position 0 of the null block, written to its slot 0. Device work only: two or three
        copies where the step has ``token_rows``."""
        meta = inputs.attn_metadata
        n = meta.num_reqs
        if inputs.token_rows is not None:
            self.token_rows[:, :n].copy_(inputs.token_rows)
        else:
            sources = (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens, meta.num_computed_tokens)
            for row, source in zip(self.token_rows, sources):
                row[:n].copy_(source[:n])
        table = meta.block_table[:n]
        self.block_table[:n, : table.shape[1]].copy_(table)
        if size > n:
            self.token_rows[2:, n:size].copy_(self.padding.expand(3, size - n))

    def forward(self, size: int, max_seq_len: int) -> DecodeOutput:
        """The model's output for the buffers' first ``size`` rows."""
        meta = self.backend.build_graph_metadata(self.metadata(size, max_seq_len))
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        if self.logits is None:
            first = self.model.compute_logits(hidden[:1])
            self.logits = first.new_empty(self.sizes[-1], first.shape[1])
        logits = self.model.compute_logits(hidden, out=self.logits[:size])
        return DecodeOutput(hidden, logits, torch.argmax(logits, dim=-1, out=self.greedy[:size]))

    def run(self, inputs: ModelInput) -> DecodeOutput:
        """The output of a decode-only step (``is_graph_decode``), a row per request."""
        meta = inputs.attn_metadata
        key = self.key_for(meta.num_reqs, meta.max_seq_len)
        self.fill(inputs, key[0])
        return self.padded_forward(key).rows(meta.num_reqs)

    def padded_forward(self, key: tuple[int, int]) -> DecodeOutput:
        """The output of the filled buffers' first ``size`` rows, ``key`` = (size, bound) (here: computed
        eagerly)."""
        return self.forward(*key)


class DecodeGraphs(PaddedDecode):
    """``PaddedDecode`` whose forward passes are CUDA graphs, one per (size, bound), captured largest first
    in one memory pool; a step replays one. The graphs read and write ``kv_cache`` where it lies."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_cache: torch.Tensor,
                 sizes: list[int], max_model_len: int, block_size: int) -> None:
        super().__init__(model, backend, kv_cache, sizes, max_model_len, block_size)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeOutput]] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), torch.cuda.device(kv_cache.device):
            for key in self.keys():
                self.forward(*key)  # compiles the kernels and sets up cuBLAS outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self.forward(*key)
                self.graphs[key] = (graph, output)
        torch.cuda.synchronize(kv_cache.device)
        logger.info("captured %d CUDA graphs of decode steps at batch sizes %s", len(self.graphs), self.sizes)

    def padded_forward(self, key: tuple[int, int]) -> DecodeOutput:
        graph, output = self.graphs[key]
        graph.replay()
        return output
