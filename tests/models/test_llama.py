"""Greedy outputs equal transformers' for Llama-family configurations the default checkpoints
of test_parity.py do not exercise."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from framework import BACKENDS, LLM, EngineConfig, LLMEngine, SamplingParams
from framework.testing.parity import hf_greedy, make_hf_checkpoint
from models import ModelConfig
from models.llama import LlamaForCausalLM, RMSNorm
from models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 33, 2, 7, 120, 64], [300, 4, 17]]


def assert_greedy_matches(path, hf_model, **kwargs) -> None:
    llm = LLM(model=str(path), max_model_len=64, block_size=8, **kwargs)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 10) for p in PROMPTS]


def randomise_biases(model) -> None:
    """transformers zero-initialises biases; random ones make a dropped bias change the outputs."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_llama_biases_match_transformers(tmp_path, bias):
    hf = make_hf_checkpoint(tmp_path / "init", "llama", seed=5, **{bias: True})
    randomise_biases(hf)
    hf.save_pretrained(tmp_path / "ckpt")
    assert_greedy_matches(tmp_path / "ckpt", hf)


def test_mistral_ignores_bias_switches_as_transformers_does(tmp_path):
    # transformers' Mistral builds no biases whatever its config says; reading the switches as
    # Llama's would look for bias tensors the checkpoint does not have.
    hf = make_hf_checkpoint(tmp_path / "ckpt", "mistral", seed=6, attention_bias=True, mlp_bias=True)
    assert not any(name.endswith(".bias") for name, _ in hf.named_parameters())
    assert_greedy_matches(tmp_path / "ckpt", hf)


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}),
                                             ("llama", {"tie_word_embeddings": True}), ("qwen2", {}),
                                             ("mistral", {"attention_bias": True})])
def test_num_params_counts_what_transformers_builds(tmp_path, arch, overrides):
    # The simulator sizes the weights (and so the KV budget) from num_params.
    from models.loader import resolve_model

    hf = make_hf_checkpoint(tmp_path / "ckpt", arch, **overrides)
    config = resolve_model(str(tmp_path / "ckpt")).config
    assert config.num_params() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_allocates_the_model_on_its_device_in_its_dtype_with_no_default_init(llama_ckpt, monkeypatch, dtype):
    initialised = []
    kaiming = torch.nn.init.kaiming_uniform_

    def spy(tensor, *args, **kwargs):
        initialised.append(tensor.device.type)
        return kaiming(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    llm = LLM(model=str(llama_ckpt[0]), max_model_len=64, dtype=str(dtype).removeprefix("torch."),
              executor_options={"float32_matmul": False})
    model = llm.engine.executor.model
    assert initialised and set(initialised) == {"meta"}, "nn.Linear's random init ran on real memory"
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.rotary.cos.dtype == dtype and not model.rotary.cos.is_meta


def test_packed_weights_lie_in_one_buffer_in_the_order_a_step_reads_them(llama_ckpt):
    """``empty_on(pack_weights=True)`` puts q/k/v, o, gate/up and down of every layer in one buffer, in that
    order, each at an aligned offset, nothing shared; loaded from the checkpoint it computes the unpacked
    model's bits. An engine packs only for ``weight_prefetch_mb`` (one buffer keeps every matrix alive)."""
    from framework import BACKENDS
    from models.llama import PACK_ALIGN, LlamaForCausalLM
    from models.loader import iter_checkpoint

    llm = LLM(model=str(llama_ckpt[0]), max_model_len=64)
    plain = llm.engine.executor.model
    assert getattr(plain, "packed_weights", None) is None
    cfg = plain.config
    backend = BACKENDS.create("naive", num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, scale=cfg.head_dim ** -0.5, block_size=16, dtype=torch.float32,
                              device="cpu")
    models = []
    for pack in (True, False):
        model = LlamaForCausalLM.empty_on(torch.device("cpu"), cfg, backend, 64, torch.float32, pack_weights=pack)
        model.load_weights(iter_checkpoint(llama_ckpt[0]))
        models.append(model)
    packed, linears = models[0].packed_weights, models[0].read_order()
    assert len(linears) == 4 * len(models[0].layers)
    assert linears[:2] == [models[0].layers[0].self_attn.qkv_proj, models[0].layers[0].self_attn.o_proj]
    offsets = [lin.weight.data_ptr() - packed.data_ptr() for lin in linears]
    sizes = [lin.weight.nbytes for lin in linears]
    assert offsets[0] == 0 and all(o % PACK_ALIGN == 0 for o in offsets)
    assert all(a + size <= b < a + size + PACK_ALIGN for a, b, size in zip(offsets, offsets[1:], sizes))
    assert offsets[-1] + sizes[-1] <= packed.nbytes < offsets[-1] + sizes[-1] + PACK_ALIGN
    assert all(lin.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr() for lin in linears)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), name
    x = torch.randn(3, max(cfg.hidden_size, cfg.intermediate_size), generator=torch.Generator().manual_seed(0))
    for lin, ref in zip(linears, models[1].read_order()):
        assert torch.equal(lin(x[:, :lin.in_features]), ref(x[:, :ref.in_features]))


def test_tied_embeddings_stay_one_tensor_and_match_transformers(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "ckpt", "llama", seed=7, tie_word_embeddings=True)
    assert_greedy_matches(tmp_path / "ckpt", hf)
    llm = LLM(model=str(tmp_path / "ckpt"), max_model_len=64)
    model = llm.engine.executor.model
    assert model.lm_head.weight is model.embed_tokens.weight


def test_starting_an_engine_does_not_import_torchs_compiler_stack():
    # On the meta device nn.Embedding's random init imports torch._dynamo (2.5 s) and Module.to_empty
    # torch's symbolic shapes (0.7 s): an engine start needs neither. A fresh interpreter, as this
    # suite imports both elsewhere.
    code = ("import sys\n"
            "from framework import LLM, SamplingParams\n"
            "llm = LLM(model='tiny-llama', max_model_len=64)\n"
            "llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=2))\n"
            "for name in ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes'):\n"
            "    assert name not in sys.modules, f'the engine imported {name}'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_padded_rows_add_at_most_an_eighth_and_come_in_few_counts():
    from models.llama import padded_rows

    counts = [padded_rows(rows) for rows in range(1, 8193)]
    assert counts[:64] == list(range(1, 65)), "a decode batch of up to 64 multiplies as it is"
    assert all(rows <= padded <= rows * 9 / 8 for rows, padded in enumerate(counts, start=1))
    assert counts == sorted(counts) and all(padded_rows(c) == c for c in counts), "a padded count pads to itself"
    assert len(set(counts[:2048])) == 64 + 8 * 5, "8 counts an octave above 64"


def test_padded_linear_layers_keep_every_input_shape_and_its_rows():
    from models.llama import pad_linear_rows

    gen = torch.Generator().manual_seed(0)
    plain = torch.nn.Linear(100, 8)
    padded = torch.nn.Linear(100, 8)
    padded.load_state_dict(plain.state_dict())
    pad_linear_rows(padded)
    for shape in [(0, 100), (1, 100), (65, 100), (129, 100), (100,), (70, 3, 100), (3, 70, 100)]:
        x = torch.randn(*shape, generator=gen)
        out = padded(x)
        assert out.shape == plain(x).shape, shape
        torch.testing.assert_close(out, plain(x), rtol=1e-6, atol=1e-6)  # a product's rows may block differently


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torchs_rms_norm_equals_transformers_in_each_dtype(dtype):
    gen = torch.Generator().manual_seed(0)
    ours, theirs = RMSNorm(64, 1e-5, None).to(dtype), LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64, generator=gen))
        theirs.weight.copy_(ours.weight)
    x, residual = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    assert torch.equal(ours(x), theirs(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))


def resaved(path, hf, change):
    """``path``'s checkpoint saved again as ``change`` leaves its state dict (one model.safetensors)."""
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    change(state)
    save_file(state, str(path / "model.safetensors"))


def test_a_tied_checkpoint_that_also_stores_its_lm_head_loads(tmp_path):
    hf = make_hf_checkpoint(tmp_path, "llama", seed=7, tie_word_embeddings=True)
    resaved(tmp_path, hf, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    assert_greedy_matches(tmp_path, hf)


def test_rotary_tables_saved_in_old_checkpoints_are_skipped(tmp_path):
    hf = make_hf_checkpoint(tmp_path, "llama", seed=7)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)
    tables = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone()
              for i in range(hf.config.num_hidden_layers)}
    resaved(tmp_path, hf, lambda s: s.update(tables))
    assert_greedy_matches(tmp_path, hf)


def test_a_transposed_weight_is_named_with_both_shapes(tmp_path):
    hf = make_hf_checkpoint(tmp_path, "llama", seed=7)
    name = "model.layers.1.mlp.down_proj.weight"
    resaved(tmp_path, hf, lambda s: s.update({name: s[name].t().contiguous()}))
    with pytest.raises(ValueError, match=r"checkpoint tensor layers.1.mlp.down_proj.weight has shape \(256, 128\), "
                                         r"expected \(128, 256\)"):
        LLM(model=str(tmp_path), max_model_len=64)


def test_a_presets_random_weights_have_unit_norms_and_random_matrices():
    model = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, num_gpu_blocks_override=8)).executor.model
    params = dict(model.named_parameters())
    norms = [name for name in params if name.endswith("norm.weight")]
    assert "norm.weight" in norms and len(norms) == 2 * len(model.layers) + 1
    assert all(torch.all(params[name] == 1) for name in norms)
    assert all(params[name].std() > 0 for name in params if name not in norms)


def test_logits_are_float32_in_a_half_precision_model():
    cfg = ModelConfig.from_hf(PRESETS["tiny-llama"])
    backend = BACKENDS.create("naive", num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, scale=cfg.head_dim ** -0.5, block_size=8, dtype=torch.bfloat16,
                              device="cpu")
    model = LlamaForCausalLM.empty_on(torch.device("cpu"), cfg, backend, 64, torch.bfloat16)
    model.init_random(0, cfg.initializer_range)
    hidden = torch.randn(3, cfg.hidden_size).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and torch.equal(logits, model.lm_head(hidden).float())
