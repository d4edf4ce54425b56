"""torch_paged: how its step planner groups the requests (SDPA's prefill groups, the C++ kernel's rows),
and both ways for decodes and prefills (the numerics of its default path are checked against the
float64 reference in test_agreement.py)."""
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from backends.cpu_kernels import paged_decode
from backends.torch_paged import prefill_groups
from framework import BACKENDS
from framework.testing.attention import (TOLERANCE, check_result, random_batch, reference_attention, relative_error,
                                        run_named)


def padded_and_real(groups, q, n):
    padded = sum(len(g) * q[g].max() * n[g].max() for g in groups)
    return padded, int((q * n).sum())


@pytest.mark.parametrize("seed", range(3))
def test_groups_partition_the_requests_and_trade_padding_for_calls(seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(2, 300, size=40)
    n = q + rng.integers(0, 300, size=40)
    one = prefill_groups(q, n, group_cost=10**12)
    assert len(one) == 1 and sorted(one[0]) == list(range(40))
    exact = prefill_groups(q, n, group_cost=0)
    assert sorted(np.concatenate(exact)) == list(range(40))
    assert padded_and_real(exact, q, n)[0] == padded_and_real(exact, q, n)[1], "free calls: no padding at all"
    middle = prefill_groups(q, n, group_cost=16384)
    padded, real = padded_and_real(middle, q, n)
    assert sorted(np.concatenate(middle)) == list(range(40))
    assert 1 < len(middle) < 40 and real <= padded < padded_and_real(one, q, n)[0]
    # The planner's choice is optimal for its cost model, so no worse than either extreme.
    cost = padded + 16384 * len(middle)
    assert cost <= padded_and_real(one, q, n)[0] + 16384 and cost <= real + 16384 * len(exact)


def test_decodes_run_as_one_group_whatever_their_number():
    specs = [(int(c), 1) for c in np.random.default_rng(0).integers(0, 200, size=50)] + [(0, 30), (64, 20)]
    batch = random_batch(specs, 4, 2, 16, 16, torch.float32, seed=0)
    backend = BACKENDS.create("torch_paged", num_heads=4, num_kv_heads=2, head_dim=16, scale=batch.scale,
                              block_size=16, dtype=torch.float32, device="cpu", prefill_kernel="sdpa")
    groups = backend.build_metadata(batch.meta).groups
    assert [g.num_reqs for g in groups][0] == 50 and groups[0].q_len == 1
    assert sum(g.num_reqs for g in groups) == 52


def test_a_lone_full_prefill_runs_causal_without_a_mask():
    batch = random_batch([(0, 37)], 4, 2, 16, 16, torch.float32, seed=0)
    backend = BACKENDS.create("torch_paged", num_heads=4, num_kv_heads=2, head_dim=16, scale=batch.scale,
                              block_size=16, dtype=torch.float32, device="cpu", prefill_kernel="sdpa")
    (group,) = backend.build_metadata(batch.meta).groups
    assert group.mask is None
    before = batch.kv_cache.clone()
    check_result(run_named("torch_paged", batch, 4, 2, 16, 16, torch.float32, "cpu"), batch, before, torch.float32)


def test_a_backend_used_under_inference_mode_still_runs_outside_it():
    """The engine runs under torch.inference_mode; the gather workspace it leaves behind must not
    make a later call outside that mode (a script, a benchmark under no_grad) fail."""
    backend = BACKENDS.create("torch_paged", num_heads=4, num_kv_heads=2, head_dim=16, scale=16 ** -0.5,
                              block_size=16, dtype=torch.float32, device="cpu")
    for seed, mode in enumerate([torch.inference_mode, torch.no_grad, torch.inference_mode]):
        batch = random_batch([(20, 1), (0, 5), (40, 7)], 4, 2, 16, 16, torch.float32, seed=seed)
        before = batch.kv_cache.clone()
        with mode():
            out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(batch.meta))
        check_result(out, batch, before, torch.float32)


def make(decode_kernel: str, dtype: torch.dtype = torch.float32, device: str = "cpu", num_heads: int = 4,
         num_kv_heads: int = 2, head_dim: int = 16, block_size: int = 16, prefill_kernel: str | None = None):
    """A torch_paged backend; ``prefill_kernel`` defaults to ``decode_kernel``'s value."""
    return BACKENDS.create("torch_paged", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           scale=head_dim ** -0.5, block_size=block_size, dtype=dtype, device=device,
                           decode_kernel=decode_kernel, prefill_kernel=prefill_kernel or decode_kernel)


@pytest.mark.parametrize("decode_kernel", ["cpp", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (8, 8, 32), (6, 1, 64), (4, 1, 128),
                                                             (8, 1, 32), (8, 2, 64)])  # value sums of 8 and 4 heads
def test_both_decode_kernels_match_the_float64_reference(decode_kernel, dtype, num_heads, num_kv_heads, head_dim):
    # Decodes of every context length around block edges (empty, one token, a full block, ...),
    # beside prefills, at heads the C++ kernel meets as groups of query heads per K/V head.
    rng = np.random.default_rng(num_heads * head_dim)
    specs = [(c, 1) for c in (0, 1, 15, 16, 17, 31, 32, 33, 100)] + [(int(c), 1) for c in rng.integers(0, 300, 20)]
    specs += [(0, 9), (32, 5)]
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim)
    backend = make(decode_kernel, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    meta = backend.build_metadata(batch.meta)
    decode_group = next(g for g in meta.groups if g.q_len == 1)
    assert (decode_group.seq_lens is not None) == (decode_kernel == "cpp"), "the kernel asked for runs the decodes"
    before = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta)
    check_result(out, batch, before, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 5, 8, 32, 48])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 2, 32), (4, 1, 128)])
def test_the_kernel_reads_keys_16_at_a_time_across_any_block_size(dtype, block_size, num_heads, num_kv_heads,
                                                                  head_dim):
    # The kernel scores 16 keys at a time, walking the block table: blocks smaller than 16 tokens, a size
    # 16 does not divide, and contexts ending inside a 16 or a block.
    specs = [(c, 1) for c in (0, 1, 4, 15, 16, 17, 47, 48, 49, 95, 161)] + [(3, 20), (40, 9)]
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=block_size)
    backend = make("cpp", dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size)
    before = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(batch.meta))
    check_result(out, batch, before, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("length, first, second", [(17, 0, 9), (18, 16, 17), (40, 5, 20), (40, 33, 38)])
def test_the_kernel_softmax_takes_the_largest_score_wherever_it_lies(dtype, length, first, second):
    # Two scores of about a thousand, two apart, both in the row's first 32 keys (the kernel takes their maximum 16
    # wide) or both in its tail, the others about a hundred: measured from less than the row's largest, both exps
    # would overflow and weigh the same.
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    gen = torch.Generator().manual_seed(length * 100 + first)
    q = torch.randn(1, heads, head_dim, generator=gen, dtype=torch.float64) * 30
    keys = torch.randn(length, kv_heads, head_dim, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(length, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    keys[first] = q[0].view(kv_heads, heads // kv_heads, head_dim).sum(1) / 5
    keys[second] = keys[first] * 0.998
    q, keys, values = (t.to(dtype) for t in (q, keys, values))
    scale = head_dim ** -0.5
    expected = reference_attention(q, keys, values, scale, heads // kv_heads)
    blocks = -(-length // block_size)
    cache = torch.zeros(2, blocks * block_size, kv_heads, head_dim, dtype=dtype)
    cache[0, :length], cache[1, :length] = keys, values
    cache = cache.view(2, blocks, block_size, kv_heads, head_dim)
    out = torch.empty(1, heads, head_dim, dtype=dtype)
    paged_decode()(q, cache[0], cache[1], torch.arange(blocks).view(1, -1), torch.zeros(1, dtype=torch.long),
                   torch.tensor([length]), scale, out)
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("decode_kernel, prefill_kernel", [("cpp", "sdpa"), ("sdpa", "cpp")])
def test_the_kernel_takes_rows_spread_through_the_batch(decode_kernel, prefill_kernel):
    # Decodes between prefills, one kind in the kernel: its rows are not consecutive, so they are
    # gathered and put back.
    specs = [(40, 1), (0, 12), (7, 1), (16, 4), (99, 1), (3, 2)]
    batch = random_batch(specs, 4, 2, 16, 16, torch.float32, seed=5)
    backend = make(decode_kernel, prefill_kernel=prefill_kernel)
    meta = backend.build_metadata(batch.meta)
    kernel = [g for g in meta.groups if g.seq_lens is not None]
    assert len(kernel) == 1 and kernel[0].out_start is None
    assert kernel[0].num_reqs == (3 if decode_kernel == "cpp" else 18), "a row per decode, or per prefill token"
    before = batch.kv_cache.clone()
    check_result(backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta), batch, before, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (8, 8, 32), (6, 1, 64), (4, 1, 128)])
def test_the_kernel_runs_prefills_as_a_row_per_token_of_its_causal_length(dtype, num_heads, num_kv_heads, head_dim):
    # Full prefills, chunked prefills and prefix hits (context before the new tokens), across block
    # edges, beside decodes: one kernel call, nothing masked or gathered, equal to the float64 reference.
    specs = [(0, 40), (17, 30), (32, 1), (5, 64), (100, 3), (0, 2), (63, 1), (16, 16), (0, 1)]
    batch = random_batch(specs, num_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim + 1)
    backend = make("cpp", dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    meta = backend.build_metadata(batch.meta)
    assert len(meta.groups) == 1 and meta.groups[0].num_reqs == sum(n for _, n in specs)
    assert meta.groups[0].out_start == 0 and meta.groups[0].mask is None
    assert meta.groups[0].seq_lens.tolist()[:42] == list(range(1, 41)) + [18, 19]
    assert meta.groups[0].table_rows.tolist()[:42] == [0] * 40 + [1, 1], "a token points at its request's blocks"
    before = batch.kv_cache.clone()
    check_result(backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta), batch, before, dtype)
    assert backend._workspace is None, "nothing gathered"


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_the_kernel_cuts_rows_of_uneven_work_into_runs_that_cover_each_row_once(threads):
    # Short decodes first, then a long prefill's rows (the long ones together): every row must land in
    # exactly one thread's run, whatever the thread count against the row count.
    specs = [(3, 1)] * 5 + [(0, 90), (200, 1), (0, 2)]
    batch = random_batch(specs, 4, 2, 16, 16, torch.float32, seed=threads)
    backend = make("cpp")
    before = batch.kv_cache.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(batch.meta))
    finally:
        torch.set_num_threads(previous)
    check_result(out, batch, before, torch.float32)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_auto_prefills_go_to_sdpa_in_a_half_precision_the_cpu_multiplies_natively(monkeypatch, dtype, native):
    """Decodes stay with the C++ kernel; ``prefill_kernel=cpp`` keeps prefills there too."""
    import backends.torch_paged as torch_paged

    monkeypatch.setattr(torch_paged, "cpu_has_matmul_instructions", lambda d: native and d != torch.float32)
    auto, cpp = make("auto", dtype), make("auto", dtype, prefill_kernel="cpp")
    assert auto.kernel_decodes and cpp.kernel_decodes and cpp.kernel_prefills
    assert auto.kernel_prefills == (dtype == torch.float32 or not native)
    batch = random_batch([(20, 1), (0, 9), (32, 5)], 4, 2, 16, 16, dtype, seed=2)
    meta = auto.build_metadata(batch.meta)
    assert [g.seq_lens is not None for g in meta.groups] == [True] + [auto.kernel_prefills] * (len(meta.groups) - 1)
    before = batch.kv_cache.clone()
    check_result(auto.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta), batch, before, dtype)


@pytest.mark.parametrize("decode_kernel, prefill_kernel, device, match", [
    ("fast", "auto", "cpu", "backend.decode_kernel must be one of auto, cpp, sdpa, got 'fast'"),
    ("auto", "fast", "cpu", "backend.prefill_kernel must be one of auto, cpp, sdpa, got 'fast'"),
    ("cpp", "auto", "cuda", "backend.decode_kernel=cpp runs on a CPU, not cuda; use auto or sdpa"),
    ("sdpa", "cpp", "cuda", "backend.prefill_kernel=cpp runs on a CPU, not cuda; use auto or sdpa"),
])
def test_a_bad_kernel_is_a_one_line_error(decode_kernel, prefill_kernel, device, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make(decode_kernel, device=device, prefill_kernel=prefill_kernel)


def test_without_a_built_kernel_auto_falls_back_to_sdpa_and_cpp_says_why(monkeypatch, caplog):
    import backends.cpu_kernels as cpu_kernels
    from framework import UnavailableError

    def no_compiler():
        raise UnavailableError("the C++ decode kernel for CPUs could not be built (no compiler)")

    monkeypatch.setattr(cpu_kernels, "paged_decode", no_compiler)
    with pytest.raises(UnavailableError, match="no compiler"):
        make("cpp")
    backend = make("auto")
    assert "attention uses SDPA" in caplog.text
    batch = random_batch([(20, 1), (3, 1), (0, 6)], 4, 2, 16, 16, torch.float32, seed=1)
    meta = backend.build_metadata(batch.meta)
    assert all(g.seq_lens is None for g in meta.groups)
    before = batch.kv_cache.clone()
    check_result(backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta), batch, before, torch.float32)


FUSED_ONLY = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


@pytest.mark.parametrize("device, dtype, fold", [
    ("cpu", torch.float32, True),
    ("cpu", torch.float32, False),
    pytest.param("cuda", torch.bfloat16, None, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 2), (8, 1), (4, 4)])
def test_masked_gqa_groups_run_on_a_fused_sdpa_kernel(monkeypatch, device, dtype, fold, num_heads, num_kv_heads):
    """With a mask and GQA, CUDA's SDPA has no fused kernel (it would materialise the scores), so there
    a masked group's query heads go in as rows of their K/V head: SDPA sees equal head counts, no
    enable_gqa. A CPU's flash kernel takes both, so a CPU keeps enable_gqa (``fold=False``, its
    default); ``fold=True`` runs the CUDA layout on a CPU. SDPA's math kernel is off throughout."""
    import backends.torch_paged as module

    calls = []

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[1], k.shape[1], attn_mask is not None, kwargs.get("enable_gqa", False)))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(module, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    specs = [(0, 9), (0, 30), (32, 5), (17, 6), (40, 1), (3, 1), (0, 1)]
    batch = random_batch(specs, num_heads, num_kv_heads, 32, 16, dtype, seed=num_heads * 10 + num_kv_heads,
                         device=device)
    backend = make("sdpa", dtype, device, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32)
    assert backend.fold_masked_gqa == (device == "cuda")
    if fold is not None:
        monkeypatch.setattr(backend, "fold_masked_gqa", fold)
    before = batch.kv_cache.clone()
    with sdpa_kernel(FUSED_ONLY):
        out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(batch.meta))
    check_result(out, batch, before, dtype)
    masked = [c for c in calls if c[2]]
    assert len(masked) >= 2, "the batch plans a decode group and a masked prefill group"
    if backend.fold_masked_gqa:
        assert all(q_heads == kv_heads == num_kv_heads and not gqa for q_heads, kv_heads, _, gqa in masked), calls


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("decode_kernel", ["cpp", "sdpa"])
@pytest.mark.parametrize("kind", ["decodes", "prefills"])
def test_the_declared_workspace_covers_what_a_step_holds(monkeypatch, decode_kernel, kind, fold):
    """``workspace_bytes`` (what KV sizing leaves free) bounds the gather buffer plus the step's masks
    at the limits: every request as long as max_model_len, the token budget spent."""
    max_num_seqs, max_model_len, block_size = 6, 70, 16
    if kind == "decodes":
        specs = [(max_model_len - 1, 1)] * max_num_seqs
    else:
        specs = [(0, 9), (max_model_len - 12, 12), (max_model_len - 2, 2), (0, max_model_len)]
    tokens = sum(n for _, n in specs)
    batch = random_batch(specs, 8, 2, 16, block_size, torch.float32, seed=3)
    backend = make(decode_kernel, num_heads=8, num_kv_heads=2, head_dim=16, block_size=block_size)
    monkeypatch.setattr(backend, "fold_masked_gqa", fold)
    meta = backend.build_metadata(batch.meta)
    before = batch.kv_cache.clone()
    check_result(backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta), batch, before, torch.float32)
    held = sum(g.mask.nbytes for g in meta.groups if g.mask is not None)
    if backend._workspace is not None:
        held += backend._workspace.nbytes
    assert held <= backend.workspace_bytes(max_num_seqs, max_model_len, tokens)
    assert held > 0 or decode_kernel == "cpp", "the C++ kernel reads K/V in place"


@pytest.mark.parametrize("specs", [[(32, 7)], [(40, 20)], [(16, 16)]], ids=["chunk", "chunk-across-blocks", "block-hit"])
def test_a_lone_prefill_after_cached_context_sees_that_context(specs):
    """A chunked prefill or a prefix-cache hit alone in its step: its queries sit after the context."""
    batch = random_batch(specs, 4, 2, 16, 16, torch.float32, seed=1)
    before = batch.kv_cache.clone()
    check_result(run_named("torch_paged", batch, 4, 2, 16, 16, torch.float32, "cpu", prefill_kernel="sdpa"), batch,
                 before, torch.float32)


def test_the_sdpa_path_used_under_inference_mode_still_runs_outside_it():
    backend = make("sdpa")
    for seed, mode in enumerate([torch.inference_mode, torch.no_grad]):
        batch = random_batch([(20, 1), (0, 5), (40, 7)], 4, 2, 16, 16, torch.float32, seed=seed)
        before = batch.kv_cache.clone()
        with mode():
            out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(batch.meta))
        check_result(out, batch, before, torch.float32)


def test_the_declared_workspace_covers_short_prefills_on_long_contexts_with_many_kv_heads():
    max_num_seqs, max_model_len = 6, 80
    specs = [(max_model_len - 2, 2)] * 4
    batch = random_batch(specs, 8, 8, 128, 16, torch.float32, seed=2)
    backend = make("cpp", num_heads=8, num_kv_heads=8, head_dim=128, prefill_kernel="sdpa")
    meta = backend.build_metadata(batch.meta)
    before = batch.kv_cache.clone()
    check_result(backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta), batch, before, torch.float32)
    held = backend._workspace.nbytes + sum(g.mask.nbytes for g in meta.groups if g.mask is not None)
    assert held <= backend.workspace_bytes(max_num_seqs, max_model_len, sum(n for _, n in specs))
