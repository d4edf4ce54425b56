"""Reference attention: per request, gather its K/V through the block table and run SDPA.

Slow (a Python loop over requests) and simple: the paged backends are checked against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from framework.execution.attention import BACKENDS, AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's K/V at its slot (``kv_cache`` is ``[2, blocks, block_size, H, D]``)."""
    n = slot_mapping.shape[0]
    kv_cache[0].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k[:n])
    kv_cache[1].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v[:n])


@BACKENDS.register("naive")
class NaiveBackend(AttentionBackend):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        bs, group = self.block_size, self.num_heads // self.num_kv_heads
        qsl, seq_lens, tables = meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_table_cpu
        for i in range(meta.num_reqs):
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q_len = end - start
            blocks = torch.from_numpy(tables[i, : -(-seq_len // bs)]).to(kv_cache.device)
            keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
            values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
            qi = q[start:end].transpose(0, 1)
            ki = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            vi = values.transpose(0, 1).repeat_interleave(group, dim=0)
            if q_len == 1:
                o = F.scaled_dot_product_attention(qi, ki, vi, scale=self.scale)
            elif q_len == seq_len:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale)
            else:
                # Query j sits at position (seq_len - q_len + j) and sees keys up to it.
                rows = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale)
            out[start:end] = o.transpose(0, 1)
        return out
