"""The model executor's process-wide settings."""
import re

import pytest
import torch

from framework import LLM, EngineConfig, LLMEngine, SamplingParams
from framework.execution.executors import model as model_executor
from models.llama import LlamaForCausalLM


@pytest.fixture
def threads():
    """torch's thread count, set to 3 (the caller's own choice) for the test and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def test_an_engine_without_num_threads_runs_on_the_process_count_after_one_with(threads):
    # The jobs of a sweep share a process: `engine.num_threads=1,null` ran its second job on 1 thread.
    LLMEngine(EngineConfig(num_threads=1, max_model_len=64, num_gpu_blocks_override=8))
    assert torch.get_num_threads() == 1
    LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    assert torch.get_num_threads() == 3


def test_a_count_the_caller_sets_after_an_engine_is_kept(threads):
    LLMEngine(EngineConfig(num_threads=1, max_model_len=64, num_gpu_blocks_override=8))
    torch.set_num_threads(2)
    LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    assert torch.get_num_threads() == 2


def test_engines_in_the_suite_run_on_the_cpu_in_float32_even_where_cuda_is_available(monkeypatch):
    # The references they are checked against run in float32 on the CPU (tests/conftest.py pins "auto").
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    assert engine.executor.device == "cpu" and engine.executor.dtype == torch.float32


@pytest.mark.parametrize("profiled_blocks", [3, 0])
def test_kv_sizing_on_a_gpu_leaves_the_profiled_step_and_at_least_the_backends_workspace_free(monkeypatch,
                                                                                           profiled_blocks):
    """The CUDA budget is utilization x total - used - what a step needs: the profiled peak of the dummy
    steps, or the attention backend's declared workspace (torch_paged: its gather buffer and masks) where
    that is larger. Shown on a CPU engine asked for its CUDA budget, the card's figures stubbed."""
    engine = LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=64,
                                    gpu_memory_utilization=0.5, backend="torch_paged",
                                    backend_options={"decode_kernel": "sdpa"}))
    executor, config = engine.executor, engine.executor.config
    workspace = executor.backend.workspace_bytes(config.max_num_seqs, config.max_model_len,
                                                 config.max_num_batched_tokens)
    model = executor.source.config
    assert workspace >= 2 * 8 * 256 * model.num_key_value_heads * model.head_dim * 4, "at least the gather buffer"
    per_block = executor.bytes_per_block
    profiled = workspace + profiled_blocks * per_block if profiled_blocks else workspace // 2
    total, used = 100 * per_block + 2 * workspace, 7 * per_block
    monkeypatch.setattr(executor, "_device", torch.device("cuda"))
    monkeypatch.setattr(executor, "profile_step_bytes", lambda: profiled)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used, total))
    monkeypatch.setattr(config, "num_gpu_blocks_override", None)
    step = max(profiled, workspace)
    assert executor.kv_block_counts()[0] == int((total * 0.5 - used - step) // per_block)


def bf16_engine(path, float32_matmul):
    from framework import LLM

    return LLM(model=str(path), dtype="bfloat16", max_model_len=64, block_size=8,
               executor_options={"float32_matmul": float32_matmul})


def test_float32_matmul_multiplies_bf16_activations_by_float32_weights_and_rounds_as_bf16(llama_ckpt):
    path, _ = llama_ckpt
    native, upcast = bf16_engine(path, False), bf16_engine(path, True)
    linear, reference = upcast.engine.executor.model.layers[0].mlp.gate_up_proj, native.engine.executor.model.layers[0].mlp.gate_up_proj
    assert linear.weight.dtype == torch.float32 and reference.weight.dtype == torch.bfloat16
    assert torch.equal(linear.weight, reference.weight.float()), "the float32 weights are the bf16 ones, exactly"
    x = torch.randn(5, linear.in_features).bfloat16()
    out = linear(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.linear(x.float(), reference.weight.float()).bfloat16())
    # torch's bf16 kernel also sums in float32: the two differ by at most a bf16 rounding step
    torch.testing.assert_close(out, reference(x), atol=2e-2, rtol=2e-2)
    model = upcast.engine.executor.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16, "only the linear layers change"


def test_float32_matmul_is_auto_true_or_false(llama_ckpt):
    with pytest.raises(ValueError, match="executor.float32_matmul must be auto, true or false, got 'always'"):
        bf16_engine(llama_ckpt[0], "always")


def product_rows(monkeypatch):
    """The row counts of every matrix product the model runs from here on (torch's ``F.linear``)."""
    rows = []
    linear = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        rows.append(x.shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    return rows


@pytest.mark.parametrize("dtype, float32_matmul, padded", [("bfloat16", False, True), ("bfloat16", True, False),
                                                           ("float32", "auto", False)])
def test_pad_matmul_rows_auto_pads_half_precision_products_on_a_cpu(llama_ckpt, monkeypatch, dtype, float32_matmul,
                                                                    padded):
    """A 70-token prompt's products run at 72 rows where oneDNN multiplies (bf16 on a CPU), at 70 where MKL does
    (float32, or bf16 through float32 weights); the step's logits row is the prompt's last either way. (Off AMX:
    its kernel takes up to 256 rows, so no padding is asked of it.)"""
    llm = LLM(model=str(llama_ckpt[0]), dtype=dtype, max_model_len=128, block_size=8,
              executor_options={"float32_matmul": float32_matmul, "amx_matmul": False})
    rows = product_rows(monkeypatch)
    out = llm.generate([{"prompt_token_ids": list(range(3, 73))}], SamplingParams(max_tokens=1, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 1
    layers = len(llm.engine.executor.model.layers)
    assert rows == [72 if padded else 70] * 4 * layers + [1]


def test_pad_matmul_rows_true_pads_float32_products_too_and_keeps_their_rows(llama_ckpt, monkeypatch):
    plain = LLM(model=str(llama_ckpt[0]), dtype="bfloat16", max_model_len=128,
                executor_options={"float32_matmul": True, "pad_matmul_rows": False})
    padded = LLM(model=str(llama_ckpt[0]), dtype="bfloat16", max_model_len=128,
                 executor_options={"float32_matmul": True, "pad_matmul_rows": True})
    rows = product_rows(monkeypatch)
    x = torch.randn(100, plain.engine.executor.model.config.hidden_size).bfloat16()
    linear = padded.engine.executor.model.layers[0].self_attn.qkv_proj
    out = linear(x)
    assert rows == [104], "100 rows pad to 104 (a step of 8 between 64 and 128)"
    assert out.shape == (100, linear.out_features) and out.dtype == torch.bfloat16
    # the same products, up to the order of a sum where MKL blocks 104 rows otherwise than 100
    torch.testing.assert_close(out, plain.engine.executor.model.layers[0].self_attn.qkv_proj(x), rtol=1e-2, atol=1e-2)


def test_pad_matmul_rows_is_auto_true_or_false(llama_ckpt):
    with pytest.raises(ValueError, match="executor.pad_matmul_rows must be auto, true or false, got 'yes'"):
        LLM(model=str(llama_ckpt[0]), max_model_len=64, executor_options={"pad_matmul_rows": "yes"})


def test_decode_matmul_is_torch_or_tuned_and_tuned_needs_cuda(llama_ckpt):
    common = dict(model=str(llama_ckpt[0]), max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="executor.decode_matmul must be torch or tuned, got 'fast'"):
        LLM(executor_options={"decode_matmul": "fast"}, **common)
    with pytest.raises(ValueError, match="executor.decode_matmul=tuned needs a CUDA device .* not cpu; use "
                                         "decode_matmul=torch"):
        LLM(executor_options={"decode_matmul": "tuned"}, **common)


@pytest.mark.parametrize("value, error", [
    (-1, "executor.weight_prefetch_mb must be a whole number of MiB >= 0 (0: off), got -1"),
    (1.5, "executor.weight_prefetch_mb must be a whole number of MiB >= 0 (0: off), got 1.5"),
    (True, "executor.weight_prefetch_mb must be a whole number of MiB >= 0 (0: off), got True"),
    (16, "executor.weight_prefetch_mb needs a CUDA device, not cpu; use weight_prefetch_mb=0")])
def test_weight_prefetch_is_whole_mib_and_needs_cuda(llama_ckpt, value, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        LLM(model=str(llama_ckpt[0]), max_model_len=64, num_gpu_blocks_override=16,
            executor_options={"weight_prefetch_mb": value})


def test_fuse_rotary_without_cuda_graphs_is_said_to_change_nothing(llama_ckpt, caplog):
    LLM(model=str(llama_ckpt[0]), backend="triton", dtype="bfloat16", max_model_len=64, num_gpu_blocks_override=16,
        backend_options={"fuse_rotary": True})
    assert "backend.fuse_rotary applies to decode steps replayed from CUDA graphs, and this engine captures none " \
           "(executor.cuda_graphs=auto on cpu): it changes nothing" in caplog.text


@pytest.mark.parametrize("capability, megabytes, error", [
    ((8, 0), 8, "needs a GPU of compute capability 9.0 or later (its bulk L2 prefetch); cuda:0 is 8.0"),
    ((9, 0), 51, "executor.weight_prefetch_mb=51 is more than cuda:0's L2 cache (50 MiB); use 1 to 50, or 0 (off)"),
    ((9, 0), 50, None)])
def test_weight_prefetch_needs_hopper_and_fits_in_l2(monkeypatch, capability, megabytes, error):
    """Checked from the device's properties (as a GPU reports them) before the model is built."""
    from types import SimpleNamespace

    from framework.execution.executors.model import _check_prefetch

    properties = SimpleNamespace(major=capability[0], minor=capability[1], L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    if error is None:
        _check_prefetch(torch.device("cuda:0"), True, megabytes)
        with pytest.raises(ValueError, match="needs executor.fused_ops=true"):
            _check_prefetch(torch.device("cuda:0"), False, megabytes)
    else:
        with pytest.raises(ValueError, match=re.escape(error)):
            _check_prefetch(torch.device("cuda:0"), True, megabytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a CUDA GPU of compute capability 9.0+")
def test_on_a_gpu_prefetching_weights_and_fusing_rotary_change_no_result(llama_ckpt):
    """The L2 prefetch is a hint, and the Triton backend's ``fuse_rotary`` rotates and stores as the RoPE pass
    does: eager prefill and graph-replayed decode steps give the same bits with either and both."""
    prompts = [[5, 9, 33, 2, 7, 120, 64] * 3, [300, 4, 17], list(range(3, 60))]
    outs = {}
    for mb, fuse in ((0, False), (1, False), (0, True), (1, True)):
        llm = LLM(model=str(llama_ckpt[0]), device="cuda", dtype="bfloat16", backend="triton", max_model_len=128,
                  num_gpu_blocks_override=64, max_num_seqs=8, executor_options={"weight_prefetch_mb": mb},
                  backend_options={"fuse_rotary": fuse})
        model = llm.engine.executor.model
        assert bool(model.layers[0].mlp.prefetch_args) == bool(mb)
        assert llm.engine.executor.runner.decode is not None and model.layers[0].self_attn.backend.fuse_rotary == fuse
        got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3))
        outs[mb, fuse] = [(o.outputs[0].token_ids,
                           [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in got]
    assert outs[0, False] == outs[1, False] == outs[0, True] == outs[1, True]
    with pytest.raises(ValueError, match="executor.weight_prefetch_mb needs executor.fused_ops=true"):
        LLM(model=str(llama_ckpt[0]), device="cuda", max_model_len=64, num_gpu_blocks_override=16,
            executor_options={"weight_prefetch_mb": 1, "fused_ops": False})
    with pytest.raises(ValueError, match="executor.weight_prefetch_mb prefetches the model's own weights, which "
                                         "float32_matmul=true replaces"):
        LLM(model=str(llama_ckpt[0]), device="cuda", dtype="bfloat16", max_model_len=64, num_gpu_blocks_override=16,
            executor_options={"weight_prefetch_mb": 1, "float32_matmul": True})
    l2_mb = torch.cuda.get_device_properties(0).L2_cache_size >> 20
    with pytest.raises(ValueError, match=re.escape(f"executor.weight_prefetch_mb={l2_mb + 1} is more than cuda's L2 "
                                                   f"cache ({l2_mb} MiB); use 1 to {l2_mb}, or 0 (off)")):
        LLM(model=str(llama_ckpt[0]), device="cuda", max_model_len=64, num_gpu_blocks_override=16,
            executor_options={"weight_prefetch_mb": l2_mb + 1})

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_tuned_decode_matmuls_sample_what_torchs_do(llama_ckpt):
    """``decode_matmul=tuned`` times every bias-free layer shape at start-up. In float32 (IEEE products) the greedy
    tokens are torch's; in bf16 (products summed in another order) each prompt's first token is torch's, or
    torch's near tie (0.05 in logprob)."""
    prompts = [[5, 9, 33, 2, 7, 120, 64] * 3, [300, 4, 17], list(range(3, 60))]
    for dtype in ("float32", "bfloat16"):
        outs = {}
        for matmul in ("torch", "tuned"):
            llm = LLM(model=str(llama_ckpt[0]), device="cuda", dtype=dtype, backend="triton", max_model_len=128,
                      num_gpu_blocks_override=64, max_num_seqs=8, executor_options={"decode_matmul": matmul})
            executor = llm.engine.executor
            assert hasattr(executor.model.layers[0].mlp.down_proj, "matmul_configs") == (matmul == "tuned")
            assert {c.bucket for c in executor.matmul_choices} == ({16} if matmul == "tuned" else set())
            got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2))
            outs[matmul] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
        for (ref, ref_logprobs), (tokens, _) in zip(outs["torch"], outs["tuned"]):
            assert len(tokens) == 12
            if dtype == "float32":
                assert tokens == ref, dtype
            elif tokens[0] != ref[0]:
                first = ref_logprobs[0]
                assert tokens[0] in first and first[ref[0]].logprob - first[tokens[0]].logprob < 0.05


def test_a_kv_cache_too_small_for_one_request_is_refused_before_the_weights_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the weights loaded")

    monkeypatch.setattr(LlamaForCausalLM, "init_random", load)
    with pytest.raises(ValueError, match=r"holds 0 blocks .*; raise cpu_kv_cache_gb"):
        LLMEngine(EngineConfig(max_model_len=64, cpu_kv_cache_gb=1e-6))


def test_amx_auto_leaves_a_model_multiplying_in_float32_to_torch_even_on_a_cpu_with_tiles(monkeypatch):
    asked = []
    monkeypatch.setattr(model_executor, "cpu_has_amx_bf16", lambda: True)
    monkeypatch.setattr(model_executor, "amx_linear", lambda: asked.append(1))
    engine = LLMEngine(EngineConfig(dtype="bfloat16", max_model_len=64, num_gpu_blocks_override=8,
                                    executor_options={"float32_matmul": True}))
    assert engine.executor.amx_linears == 0 and not asked


def test_the_engine_seed_draws_the_samples_of_requests_without_their_own():
    def sample(seed):
        llm = LLM(max_model_len=64, num_gpu_blocks_override=8, seed=seed)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8, temperature=1.0))
        return out[0].outputs[0].token_ids

    assert sample(1) == sample(1) != sample(2)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_profiled_step_counts_the_decode_peak_again_where_cuda_graphs_keep_its_pool(monkeypatch, graphs):
    engine = LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8))
    peaks = {"prefill": 5 << 20, "decode": 3 << 20}
    monkeypatch.setattr(model_executor, "peak_bytes", lambda run, device: peaks[run.args[0].name])
    monkeypatch.setattr(engine.executor, "cuda_graphs", graphs)
    assert engine.executor.profile_step_bytes() == peaks["prefill"] + (peaks["decode"] if graphs else 0)


def test_a_presets_random_weights_follow_the_model_seed():
    def weights(model_seed):
        engine = LLMEngine(EngineConfig(max_model_len=64, num_gpu_blocks_override=8, model_seed=model_seed))
        return engine.executor.model.embed_tokens.weight

    assert torch.equal(weights(4), weights(4)) and not torch.equal(weights(4), weights(5))


def test_on_cuda_graphs_true_with_a_backend_that_cannot_capture_is_refused_and_auto_runs_eagerly(monkeypatch):
    engine = LLMEngine(EngineConfig(backend="torch_paged", max_model_len=64, num_gpu_blocks_override=8))
    executor = engine.executor
    monkeypatch.setattr(executor, "_device", torch.device("cuda"))
    with pytest.raises(ValueError, match="attention backend 'torch_paged' cannot capture decode steps; use "
                                         "backend=.*triton"):
        executor._use_cuda_graphs(True)
    assert executor._use_cuda_graphs("auto") is False
