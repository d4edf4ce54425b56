"""Rotary position embedding with the config's theta and scaling (default, linear, llama3, yarn),
computed as Hugging Face transformers does so greedy outputs match it."""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale factor."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK equals the default inside the trained context; the engine caps
        # max_model_len there.
        return inv_freq, 1.0
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    assert scaling is not None
    factor = scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    old_len = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for positions ``[0, max_positions)``; ``forward`` returns q and k of a flat
    token batch (``[T, heads, head_dim]``) rotated, in transformers' "rotate half" convention."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int, dtype: torch.dtype) -> None:
        super().__init__()
        self._args = (head_dim, max_positions, theta, scaling, max_position_embeddings)
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2, dtype=dtype), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """Computes cos and sin (float32 on the CPU, as transformers does) into the buffers, wherever
        and in whatever dtype they are now: after ``Module.to_empty``, their contents are undefined."""
        if self.cos.is_meta:
            return
        head_dim, max_positions, theta, scaling, max_position_embeddings = self._args
        inv_freq, attn_scale = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.cos.copy_(freqs.cos() * attn_scale)
        self.sin.copy_(freqs.sin() * attn_scale)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
