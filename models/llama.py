"""Llama-family decoder (Llama, Qwen2, Mistral) over a flat token batch, no padding.

Attention goes through the selected ``AttentionBackend``; q/k/v and gate/up projections are
fused into one matrix each (fewer, larger matrix multiplies). Given ``fused_ops`` (``models.cpu_ops``
or ``models.cuda_ops``), the residual add and norm, SiLU-and-multiply and the q/k/v split with RoPE
each run as one pass (C++ or a Triton launch) instead of several torch operators; the last also stores
the keys and values in the cache where both the operators and the backend (``kv_slots``) allow. With CUDA's
operators each can also prefetch the next matrix product's weights into L2 (``prefetch_weights``).
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from types import MethodType, ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.execution.attention import AttentionBackend
from models.config import ModelConfig
from models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """``forward(x)`` is the norm of ``x``; ``forward(x, residual)`` adds ``x`` to the residual stream
    first and returns ``(norm, residual)`` (the fused operator does both in place)."""

    def __init__(self, size: int, eps: float, ops: ModuleType | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops
        self.prefetch_args: dict[str, torch.Tensor] = {}  # the fused operator's ``prefetch``, if any

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self.ops is not None:
            if residual is None:
                out = torch.empty_like(x)
                self.ops.rms_norm(x, self.weight, out, self.eps, **self.prefetch_args)
                return out
            self.ops.add_rms_norm(x, residual, self.weight, self.eps, **self.prefetch_args)
            return x, residual
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Embedding(nn.Module):
    """``forward(ids [T])`` returns their rows ``[T, hidden]``. The weight starts uninitialised: ``nn.Embedding``
    draws a normal one, which on the meta device imports ``torch._dynamo`` (2.5 s of every engine start)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 ops: ModuleType | None) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.backend = backend
        self.rotary = rotary
        # The fused operator that also stores K/V in the cache, where the backend lets the model store them.
        self.into_cache = getattr(ops, "qkv_rotary_into_cache", None)
        self.prefetch_args: dict[str, torch.Tensor] = {}  # the rotary operator's ``prefetch``, if any
        # Looked up once: most backends never apply RoPE themselves.
        self.backend_rotary = backend.forward_rotary if backend.fuse_rotary else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.backend_rotary is not None:
            o = self.backend_rotary(qkv, positions, self.rotary.cos, self.rotary.sin, kv_cache, meta)
            if o is not None:
                return self.o_proj(o.reshape(-1, self.q_size))
        slots = None if self.into_cache is None else self.backend.kv_slots(meta)
        if slots is not None:
            q = qkv.new_empty(qkv.shape[0], self.num_heads, self.head_dim)
            self.into_cache(qkv, positions, self.rotary.cos, self.rotary.sin, q, kv_cache[0], kv_cache[1], slots,
                            **self.prefetch_args)
            k = v = None
        elif self.ops is not None:
            q = qkv.new_empty(qkv.shape[0], self.num_heads, self.head_dim)
            k = qkv.new_empty(qkv.shape[0], self.num_kv_heads, self.head_dim)
            v = torch.empty_like(k)
            self.ops.qkv_rotary(qkv, positions, self.rotary.cos, self.rotary.sin, q, k, v, **self.prefetch_args)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, q, k)
            v = v.reshape(-1, self.num_kv_heads, self.head_dim).contiguous()
        o = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType | None) -> None:
        super().__init__()
        self.ops = ops
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: silu")
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        # This projection of silu_and_mul(gate_up) in one pass, where models.cuda_matmul.tune sets one (it may
        # return None, then the operator runs); an attribute read per forward, not a failed lookup.
        self.down_proj.silu_and_mul_forward = None
        self.prefetch_args: dict[str, torch.Tensor] = {}  # SiLU-and-multiply's ``prefetch``, if any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            # decode_matmul=tuned: the down projection applies the operator as it loads its input, where that
            # was timed faster (one launch and one [T, intermediate] round trip less)
            fused = self.down_proj.silu_and_mul_forward
            out = None if fused is None else fused(gate_up)
            if out is not None:
                return out
            act = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
            self.ops.silu_and_mul(gate_up, act, **self.prefetch_args)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    """``forward(positions, x, residual, ...)`` returns ``(x, residual)``: the residual stream is
    ``residual + x`` (``residual`` None: ``x`` alone), added in the next norm, as in vLLM."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 ops: ModuleType | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, backend, rotary, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _float32_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def compute_linears_in_float32(model: nn.Module) -> None:
    """Gives every ``nn.Linear`` float32 weights and a forward that multiplies in float32 and rounds
    its output to the input's dtype (tied weights get their own copy): on CPUs without bf16/fp16
    matrix instructions torch's half-precision matmul runs 5-10x slower than float32's."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dtype != torch.float32:
            module.weight = nn.Parameter(module.weight.detach().float(), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().float(), requires_grad=False)
            module.forward = MethodType(_float32_linear, module)


def padded_rows(rows: int) -> int:
    """``rows`` itself up to 64; above, rounded up to one of 8 sizes an octave (at most 1/8 more rows)."""
    if rows <= 64:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _row_padded(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    padded = padded_rows(rows) if x.dim() == 2 else rows
    if padded == rows:
        return forward(x)
    return forward(F.pad(x, (0, 0, 0, padded - rows)))[:rows]


def pad_linear_rows(model: nn.Module) -> None:
    """Has every ``nn.Linear`` run its forward on a 2-D input with zero rows added up to ``padded_rows`` and return
    the input's rows only (other inputs as they are): oneDNN compiles a half-precision product per row count
    (about 1 ms each on a CPU) and keeps 1,024, so a server's token counts, new in most steps, compiled in most."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_row_padded, module.forward)


#: Rows up to which ``use_amx_linears``' kernel runs a product. Above, oneDNN's blocking beats the kernel's (0.7x at
#: 2,048 rows) and its per-call cost is a small share; at 50 rows the kernel ran 2.6-6x faster.
AMX_MAX_ROWS = 256


def _amx_forward(ops: ModuleType, module: nn.Linear, fallback: Callable[[torch.Tensor], torch.Tensor],
                 x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[0] > AMX_MAX_ROWS or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        return fallback(x)
    out = x.new_empty(x.shape[0], module.out_features)
    ops.amx_linear(x, module.amx_weight, module.bias, out)
    return out


def use_amx_linears(model: nn.Module, ops: ModuleType) -> int:
    """Has every bf16 ``nn.Linear`` whose shape the tiles take (out_features a multiple of 16, in_features of 32)
    run its 2-D inputs of up to ``AMX_MAX_ROWS`` rows through ``ops`` (``models.cpu_ops.amx_linear()``) on a packed
    copy of its weight, others through its forward as it was; returns how many. The copy doubles their memory."""
    count = 0
    for module in model.modules():
        if (isinstance(module, nn.Linear) and module.weight.dtype == torch.bfloat16 and module.out_features % 16 == 0
                and module.in_features % 32 == 0 and (module.bias is None or module.bias.dtype == torch.bfloat16)):
            module.register_buffer("amx_weight", ops.pack_weight(module.weight.detach()), persistent=False)
            module.forward = functools.partial(_amx_forward, ops, module, module.forward)
            count += 1
    return count


#: Alignment in bytes of each weight ``empty_on`` packs (cuBLAS and the bulk prefetch want aligned rows).
PACK_ALIGN = 256


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_cache [2, L, blocks, bs, kv_heads, head_dim],
    meta)`` returns the last hidden states ``[T, hidden]``; ``compute_logits`` maps the rows to
    sample from to float32 logits. ``fused_ops``: ``models.cpu_ops.fused_ops()`` on a CPU,
    ``models.cuda_ops`` on CUDA, or None (torch's operators)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                 fused_ops: ModuleType | None = None) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.max_position_embeddings, dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, rotary, fused_ops) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, kv_cache[:, i], meta)
        return self.norm(x, residual)[0]

    @classmethod
    def empty_on(cls, device: torch.device, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 dtype: torch.dtype, fused_ops: ModuleType | None = None,
                 pack_weights: bool = False) -> LlamaForCausalLM:
        """The model with its parameters allocated straight on ``device`` in ``dtype``, their contents
        undefined until ``load_weights`` or ``init_random`` (no CPU copy, no default initialisation); with
        ``pack_weights``, the layers' matrices in one buffer, ``packed_weights``, in ``read_order``."""
        with torch.device("meta"):
            model = cls(cfg, backend, max_positions, dtype, fused_ops)
        model.to(dtype=dtype)
        if pack_weights:
            # In the order a forward pass reads them, so that "the next n bytes of weights" is one range
            # (``prefetch_weights``). Only then: one buffer keeps every matrix alive until the last is freed.
            linears = model.read_order()
            align = PACK_ALIGN // dtype.itemsize
            sizes = [-(-lin.weight.numel() // align) * align for lin in linears]
            model.packed_weights = torch.empty(sum(sizes), dtype=dtype, device=device)
            for lin, start in zip(linears, itertools.accumulate(sizes, initial=0)):
                lin.weight = nn.Parameter(
                    model.packed_weights[start:start + lin.weight.numel()].view(lin.weight.shape),
                    requires_grad=lin.weight.requires_grad)
        # torch.empty per tensor, not Module.to_empty: its empty_like of a meta tensor imports torch's
        # symbolic-shape machinery (0.7 s of every engine start).
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.is_meta:
                    continue
                setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                   requires_grad=param.requires_grad))
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
        if cfg.tie_word_embeddings:  # each module got its own tensor
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary.reset_tables()
        return model

    def read_order(self) -> list[nn.Linear]:
        """The decoder layers' matrix products in the order a forward pass reads their weights."""
        return [lin for layer in self.layers
                for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    def prefetch_weights(self, max_bytes: int) -> None:
        """Has each fused CUDA operator ask L2 for the next ``max_bytes`` of the layers' packed weights from
        the product it precedes (0: none): the norms from q/k/v's and gate/up's, RoPE from o's, SiLU from
        down's (on into the next layer's q/k/v); the last norm for the LM head's (RoPE's goes unasked where the
        backend applies RoPE itself, ``forward_rotary``). Needs ``empty_on(pack_weights=True)``."""
        packed = getattr(self, "packed_weights", None)
        linears = self.read_order()
        if packed is None or any(not 0 <= lin.weight.data_ptr() - packed.data_ptr() < packed.nbytes for lin in linears):
            raise ValueError("prefetch_weights needs the layers' weights packed by "
                             "LlamaForCausalLM.empty_on(pack_weights=True)")
        count = max_bytes // packed.element_size()

        def window(weight: torch.Tensor) -> dict[str, torch.Tensor]:
            start = (weight.data_ptr() - packed.data_ptr()) // packed.element_size()
            return {"prefetch": packed[start:start + count]} if count else {}

        for layer in self.layers:
            layer.input_layernorm.prefetch_args = window(layer.self_attn.qkv_proj.weight)
            layer.self_attn.prefetch_args = window(layer.self_attn.o_proj.weight)
            layer.post_attention_layernorm.prefetch_args = window(layer.mlp.gate_up_proj.weight)
            layer.mlp.prefetch_args = window(layer.mlp.down_proj.weight)
        self.norm.prefetch_args = {"prefetch": self.lm_head.weight.detach().view(-1)[:count]} if count else {}

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of ``hidden``; written into ``out`` when given (a CUDA graph's
        buffer: the conversion to float32 is the copy)."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up. Raises ValueError naming any
        parameter left unloaded, any checkpoint tensor this model has no place for, and two tensors for one."""
        params = dict(self.named_parameters())
        loaded: dict[str, str] = {}  # parameter (or fused part) -> the checkpoint name loaded into it
        cfg = self.config
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        shards = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
                  "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
        unexpected = []
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            given = name
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, offset, size = name, None, None
            if len(parts) >= 2 and parts[-2] in shards:
                fused, offset, size = shards[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            key = target if offset is None else f"{target}[{offset}]"
            if key in loaded:  # e.g. one name with and one without "model.": the second would silently win
                raise ValueError(f"checkpoint tensors {loaded[key]} and {given} are both the weight {name}")
            with torch.no_grad():
                dst = param if offset is None else param.narrow(0, offset, size)
                if dst.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(tensor)
            loaded[key] = given
        if unexpected:
            raise ValueError(f"checkpoint has tensors this {cfg.model_type} model has no place for: {unexpected[:8]}")
        missing = []
        for pname, param in params.items():
            if pname in loaded:
                continue
            fused = [key for key in loaded if key.startswith(pname + "[")]
            expected = 3 if "qkv_proj" in pname else 2 if "gate_up_proj" in pname else 1
            if len(fused) < expected:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}")

    @torch.no_grad()
    def init_random(self, seed: int, std: float) -> None:
        """Deterministic random weights (presets): normal(0, std) matrices, unit norms."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
