"""Compile the Triton backend's kernels for an NVIDIA GPU (sm_90 by default) with the ptxas that
ships in Triton's wheel; no GPU needed. Run in a process where Triton is not interpreting:

    python -m tests.backends.gpu_compile [ARCH]

Each configuration is compiled as ``tile_sizes`` tiles it on a GPU for a decode step and for a
prefill step (the first also with key splits and their combine kernel, and as a graph-captured decode
reading its lengths on the device), with the K/V store, the model's fused operators (``models.cuda_ops``) and
the split-K matrix product (``models.cuda_matmul``).
Prints one line per kernel and exits non-zero on the first that fails to compile.
"""
from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import backends.triton_kernels as tk
import models.cuda_matmul as mm
import models.cuda_ops as ops

# (dtype, head_dim, query heads per K/V head)
# The last is TinyLlama's (the GPU check's 1.1B model), whose decode tiles are twice as long.
CONFIGS = [("bf16", 128, 4), ("fp16", 80, 1), ("fp32", 64, 8), ("bf16", 256, 2), ("bf16", 64, 8)]
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def signature(fn, pointer_types: dict[str, str], scalars: dict[str, str], constexprs: dict) -> ASTSource:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointer_types.get(name, "*i64")
        else:
            sig[name] = scalars.get(name, "i64")
    return ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})


def attention(dtype: str, head_dim: int, group: int, block_q: int, block_n: int, splits: int,
              decode: bool = False, rotary: bool = False) -> ASTSource:
    out = f"*{dtype}" if splits == 1 else "*fp32"
    pointers = {"out_ptr": out, "lse_ptr": "*fp32", "q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}",
                "v_cache_ptr": f"*{dtype}", "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}"}
    constexprs = dict(NUM_KV_HEADS=8, GROUP=group, GROUP_PAD=tk._pow2(group), KV_HEADS=1, HEAD_DIM=head_dim,
                      HEAD_DIM_PAD=tk._pow2(head_dim, 16), BLOCK_SIZE=16, BLOCK_Q=block_q, BLOCK_N=block_n,
                      NUM_SPLITS=splits, DOT_PRECISION=tk.dot_precision(TORCH_DTYPES[dtype]), DOT_FP32=False,
                      DECODE=decode, ROTARY=rotary)
    return signature(tk._paged_attention_kernel, pointers, {"scale_log2e": "fp32"}, constexprs)


def store(dtype: str, head_dim: int) -> ASTSource:
    pointers = {name: f"*{dtype}" for name in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    head_dim_pad = tk._pow2(head_dim, 16)
    constexprs = dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=16,
                      BLOCK_T=tk.store_block_t(4096, 8, head_dim_pad))
    return signature(tk._store_kv_kernel, pointers, {}, constexprs)


def combine(dtype: str, head_dim: int, splits: int) -> ASTSource:
    constexprs = dict(NUM_SPLITS=splits, SPLITS_PAD=tk._pow2(splits), HEADS_PAD=32, HEAD_DIM=head_dim,
                      HEAD_DIM_PAD=tk._pow2(head_dim, 16))
    return signature(tk._combine_splits_kernel, {"out_ptr": f"*{dtype}", "part_ptr": "*fp32", "lse_ptr": "*fp32"},
                     {}, constexprs)


def model_ops(dtype: str, head_dim: int, group: int, prefetch: bool) -> dict[str, ASTSource]:
    """``models.cuda_ops``' kernels for a model of this head shape (hidden 2048, intermediate 5632), with or
    without their L2 prefetch."""
    ptr = f"*{dtype}"
    norm = {name: ptr for name in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "pf_ptr")}
    warps = dict(PREFETCH=prefetch, THREADS=128)
    return {
        "add_rms_norm": signature(ops._rms_norm_kernel, norm, {"eps": "fp32"},
                                  dict(ADD=True, BLOCK=2048, PREFETCH=prefetch, THREADS=256)),
        "silu_and_mul": signature(ops._silu_and_mul_kernel, {"x_ptr": ptr, "out_ptr": ptr, "pf_ptr": ptr}, {},
                                  dict(BLOCK=1024, **warps)),
        **{name: signature(ops._qkv_rotary_kernel,
                           {name: ptr for name in ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr",
                                                   "pf_ptr")},
                           {}, dict(HEADS=8 * group, KV_HEADS=8, HEAD_DIM=head_dim,
                                    HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_SIZE=block_size,
                                    SLOTS=slots, **warps))
           for name, block_size, slots in (("qkv_rotary", 1, False), ("qkv_rotary_into_cache", 16, True))},
    }


def matmuls(dtype: str) -> dict[str, ASTSource]:
    """``models.cuda_matmul``'s split-K kernel for every candidate tile at 32 rows (summed by the last program,
    and one also by the second kernel and one with SiLU-and-multiply on its input), every other row tile at one
    split (stored directly), both operand orders, and the partials' sum."""
    tiles = {(c.block_n, c.block_k, c.swap) for c in mm.CANDIDATES}
    shapes = [(32, n, k, swap, False, True, False) for n, k, swap in sorted(tiles)]
    shapes += [(32, 64, 256, False, False, False, False), (32, 64, 256, True, False, True, True)]
    shapes += [(rows, 64, 256, swap, True, False, False) for rows in (16, 64, 128) for swap in (False, True)]
    sources = {}
    for rows, n, k, swap, direct, serial, glu in shapes:
        pointers = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "part_ptr": "*fp32",
                    "lock_ptr": "*i32"}
        sources[f"splitk rows={rows} n={n} k={k} swap={swap} direct={direct} serial={serial} glu={glu}"] = signature(
            mm._splitk_kernel, pointers, {}, dict(BLOCK_M=rows, BLOCK_N=n, BLOCK_K=k, DIRECT=direct, SERIAL=serial,
                                                     SWAP=swap, GLU=glu, PRECISION="tf32", DOT_FP32=False))
    sources["sum_splits"] = signature(mm._sum_splits_kernel, {"part_ptr": "*fp32", "out_ptr": f"*{dtype}"}, {},
                                      dict(SPLITS=4, BLOCK=1024))
    return sources


def main(arch: int = 90) -> None:
    import numpy as np

    if tk.INTERPRETED:
        sys.exit("TRITON_INTERPRET is set: unset it to compile for a GPU")
    target = GPUTarget("cuda", arch, 32)
    for i, (dtype, head_dim, group) in enumerate(CONFIGS):
        group_pad = tk._pow2(group)
        graphs = i in (0, len(CONFIGS) - 1)
        kinds = (("decode", 1), ("prefill", 512)) + ((("graph decode", 1),) if graphs else ())
        for kind, q_len in kinds:
            q_lens = np.full(4, q_len, dtype=np.int64)
            block_q, block_n = tk.tile_sizes(group_pad, 1, head_dim, q_lens, q_lens + 1024)
            if kind == "graph decode":
                _, block_q, block_n = tk._decode_tiles(group, 1, head_dim, 2048)
            for splits in (1, 4) if graphs and kind != "prefill" else (1,):
                # backend.fuse_rotary: graph decodes in 16-bit dtypes may rotate and store K/V in the launch
                for rotary in (False, True) if kind == "graph decode" and dtype != "fp32" else (False,):
                    source = attention(dtype, head_dim, group, block_q, block_n, splits, decode=kind == "graph decode",
                                       rotary=rotary)
                    kernel = triton.compile(source, target=target)
                    print(f"attention {dtype} head_dim={head_dim} group={group} {kind} BLOCK_Q={block_q} "
                          f"BLOCK_N={block_n} splits={splits}{' rotary' if rotary else ''}: "
                          f"{kernel.metadata.shared} B shared", flush=True)
        triton.compile(store(dtype, head_dim), target=target)
        if i == 0:
            triton.compile(combine(dtype, head_dim, 4), target=target)
        print(f"store_kv {dtype} head_dim={head_dim}: ok", flush=True)
        for prefetch in (False, True):
            for name, source in model_ops(dtype, head_dim, group, prefetch).items():
                kernel = triton.compile(source, target=target,
                                        options={**ops._EXACT, "num_warps": 8 if "norm" in name else 4})
                issued = kernel.asm["ptx"].count("cp.async.bulk.prefetch.L2")
                if issued != prefetch:  # one a thread per chunk, in the loop; none without
                    sys.exit(f"{name} prefetch={prefetch}: {issued} bulk prefetches in its PTX")
            print(f"model ops {dtype} head_dim={head_dim} prefetch={prefetch}: ok", flush=True)
    for name, source in matmuls("bf16").items():
        kernel = triton.compile(source, target=target, options={"num_warps": 4, "num_stages": 4, **ops._EXACT})
        print(f"matmul bf16 {name}: {kernel.metadata.shared} B shared", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
