import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from framework import LLM, SamplingParams
from models import ModelConfig, iter_checkpoint, resolve_model
from models.loader import ModelSource, load_tokenizer
from framework.testing.parity import hf_greedy, make_hf_checkpoint


def test_sharded_safetensors_and_bin_checkpoints_load_identically(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "single", "llama", seed=3)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    # Sharded: two files and an index, as save_pretrained writes for large models.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    keys = sorted(state)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(sharded / name))
        weight_map.update({k: name for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    binary = tmp_path / "bin"
    binary.mkdir()
    torch.save(state, binary / "pytorch_model.bin")
    (binary / "config.json").write_text((tmp_path / "single" / "config.json").read_text())

    prompt = [5, 9, 33, 2, 7, 120, 64]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = hf_greedy(hf, prompt, 10)
    for path in (tmp_path / "single", sharded, binary):
        out = LLM(model=str(path), max_model_len=64).generate({"prompt_token_ids": prompt}, params)[0]
        assert out.outputs[0].token_ids == expected, path.name


def test_other_safetensors_files_beside_model_safetensors_are_ignored(tmp_path):
    """A directory with model.safetensors and another *.safetensors file (Mistral's own-format
    consolidated.safetensors, a PEFT adapter) loads model.safetensors alone, as transformers
    does; reading every *.safetensors file failed with 'no place for: tok_embeddings.weight'."""
    hf = make_hf_checkpoint(tmp_path, "llama", seed=3)
    embed = hf.state_dict()["model.embed_tokens.weight"].contiguous()
    save_file({"tok_embeddings.weight": embed}, str(tmp_path / "consolidated.safetensors"))
    prompt = [5, 9, 33, 2, 7]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = LLM(model=str(tmp_path), max_model_len=64).generate({"prompt_token_ids": prompt}, params)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


def test_missing_tensor_is_named(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "ok", "llama", seed=4)
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj"):
        LLM(model=str(bad), max_model_len=64)


def test_a_checkpoint_without_its_weights_is_a_one_line_configuration_error(tmp_path):
    """A directory with config.json but no weights, or without a shard its index lists, was a
    FileNotFoundError, which the command line shows as a traceback (the missing shard only
    after reading the ones before it); both are now ValueErrors naming what is missing."""
    hf = make_hf_checkpoint(tmp_path / "ok", "llama", seed=4)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    with pytest.raises(ValueError, match="has a config.json but no weights"):
        LLM(model=str(bare), max_model_len=64)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[-1].unlink()
    with pytest.raises(ValueError, match=f"lacks {shards[-1].name}"):
        LLM(model=str(tmp_path / "sharded"), max_model_len=64)


def test_unknown_model_names_presets(tmp_path):
    with pytest.raises(ValueError, match="tiny-llama"):
        resolve_model(str(tmp_path / "nowhere"))


def test_unsupported_architecture_is_rejected():
    with pytest.raises(ValueError, match="supported: llama, qwen2, mistral"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_architecture_without_an_lm_head_is_rejected(tmp_path):
    """A supported model type with another head used to load as far as its weights and fail
    on a tensor name ('no place for: score.weight'); the config now names the architecture."""
    import transformers

    from framework.testing.parity import TINY_HF

    transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**TINY_HF)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="LlamaForSequenceClassification; supported: LlamaForCausalLM"):
        resolve_model(str(tmp_path))


def test_config_parses_old_and_new_rope_formats():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}).rope_scaling is None


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}, "rope_theta": 7e4,
     "rope_scaling": {"type": "dynamic", "factor": 3.0}},
    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}, "rope_scaling": None},
    {"rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}},
    # 0 asks for the default (common in real YaRN configs): a number >= 0, not a positive one.
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0,
                         "mscale_all_dim": 0, "beta_fast": 0, "beta_slow": 0}},
    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default", "partial_rotary_factor": 1.0}},
], ids=["scaling-beside-parameters", "scaling-with-top-level-theta", "null-scaling", "yarn-without-factor",
        "yarn-zeros", "default-with-more-keys"])
def test_rope_settings_read_as_transformers_reads_them(rope):
    """A transformers-5 config (rope_parameters) given a legacy rope_scaling, as guides for transformers 4 say:
    transformers takes the rope_scaling whole, and so must the engine, or its outputs differ."""
    import transformers

    shape = {**SHAPE, "max_position_embeddings": 256}
    theirs = dict(transformers.LlamaConfig(**{k: v for k, v in shape.items() if k != "model_type"}, **rope)
                  .rope_parameters)
    ours = ModelConfig.from_hf({**shape, **rope})
    assert ours.rope_theta == theirs.pop("rope_theta")
    theirs.setdefault("rope_type", theirs.pop("type", "default"))
    if theirs["rope_type"] == "yarn":
        assert ours.max_context() == (256, "YaRN-scaled context (original_max_position_embeddings 64 x factor 4)")
        theirs["factor"] = 256 / 64  # None, which their yarn derives as this
    assert ours.rope_scaling == theirs


SHAPE = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
             num_attention_heads=4)


@pytest.mark.parametrize("config, message", [
    ({k: v for k, v in SHAPE.items() if k != "hidden_size"}, "model config lacks hidden_size"),  # was KeyError
    ({**SHAPE, "hidden_size": "8"}, "hidden_size must be a positive integer, got '8'"),       # was TypeError
    ({**SHAPE, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({**SHAPE, "num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ({**SHAPE, "head_dim": 2.5}, "head_dim must be a positive integer or null, got 2.5"),
    ({**SHAPE, "num_key_value_heads": 3}, "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),  # was taken
    ([1, 2], "must be a mapping of Hugging Face config keys, got list"),                      # was AttributeError
    # Rotary embeddings need an even head_dim (transformers refuses the config): was a RuntimeError
    # at the first forward pass.
    ({**SHAPE, "head_dim": 3}, "head_dim=3 must be even"),
    ({**SHAPE, "hidden_size": 12}, "head_dim=3 must be even"),
    # Scaling without the keys its rope type needs (transformers refuses them): was a KeyError
    # when the model executor built the rotary embedding, and accepted by executor=sim.
    ({**SHAPE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_type 'llama3' scaling lacks low_freq_factor, high_freq_factor"),
    ({**SHAPE, "rope_scaling": {"type": "linear"}}, "rope_type 'linear' scaling lacks factor"),
    ({**SHAPE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn' scaling lacks factor"),
    # Refused with the key named, not a TypeError from the fused norm at the first step.
    ({**SHAPE, "rms_norm_eps": None}, "rms_norm_eps must be a positive number, got None"),
    ({**SHAPE, "rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, got '1e-6'"),
    ({**SHAPE, "rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope scaling's factor must be a positive "
                                                                          "number, got '2'"),
    ({**SHAPE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": True, "high_freq_factor": 4}},
     "rope scaling's low_freq_factor must be a positive number, got True"),
    ({**SHAPE, "rope_scaling": {"rope_type": "yarn", "factor": 0}}, "rope scaling's factor must be a positive number, "
                                                                     "got 0"),
    ({**SHAPE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": -1}},
     "rope scaling's mscale_all_dim must be a number >= 0, got -1"),
    # A string is no switch: bool("false") is True, a tied LM head in place of the checkpoint's own.
    ({**SHAPE, "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({**SHAPE, "attention_bias": 0}, "attention_bias must be true or false, got 0"),
    ({**SHAPE, "model_type": "qwen2", "use_sliding_window": "yes"}, "use_sliding_window must be true or false"),
    # A window is a positive token count; 0 is not "no window" (transformers applies it).
    ({**SHAPE, "model_type": "mistral", "sliding_window": "32"}, "sliding_window must be a positive integer or null, "
                                                                 "got '32'"),
    ({**SHAPE, "model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive integer or null"),
    ({**SHAPE, "sliding_window": -1}, "sliding_window must be a positive integer or null, got -1"),
    ({**SHAPE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 0},
     "sliding_window must be a positive integer or null, got 0"),
    ({**SHAPE, "rope_scaling": 2.0}, "rope_scaling must be a mapping of RoPE parameters or null, got 2.0"),
    ({**SHAPE, "rope_parameters": "linear"}, "rope_parameters must be a mapping of RoPE parameters or null"),
    ({**SHAPE, "rope_scaling": {"rope_type": ["linear"], "factor": 2.0}}, r"rope_type must be a string, got \['linear'\]"),
    # 0 is not the default 10000 (transformers uses the 0); a negative theta makes NaN frequencies.
    ({**SHAPE, "rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    ({**SHAPE, "rope_theta": -10000.0}, "rope_theta must be a positive number, got -10000.0"),
    ({**SHAPE, "rope_parameters": {"rope_type": "default", "rope_theta": 0}, "rope_theta": 1e4},
     "rope_theta must be a positive number, got 0"),
])
def test_bad_configs_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


def test_a_bad_config_json_is_named_with_its_path(tmp_path):
    (tmp_path / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: .*not valid JSON|{tmp_path / 'config.json'}: Expecting"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in SHAPE.items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: model config lacks vocab_size"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("arch, extra", [("mistral", {}), ("mistral", {"sliding_window": None}),
                                         ("mistral", {"sliding_window": 64}), ("qwen2", {"use_sliding_window": True}),
                                         ("qwen2", {"use_sliding_window": True, "max_window_layers": 0}),
                                         ("qwen2", {"use_sliding_window": True, "sliding_window": 64,
                                                    "layer_types": ["sliding_attention"]}),
                                         ("qwen2", {"sliding_window": 64}), ("qwen2", {"sliding_window": 0})])
def test_sliding_window_reads_as_transformers(arch, extra):
    """A Mistral config.json without sliding_window has transformers' default window of 4096 (the
    engine caps max_model_len there, not implementing the window); it used to read as none, so
    longer sequences attended further back than transformers. A Qwen2 window counts only where
    transformers gives some layer a sliding window."""
    import transformers

    hf_class = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[arch]
    d = {**SHAPE, "model_type": arch, **extra}
    hf = hf_class(**{k: v for k, v in d.items() if k != "model_type"})
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    expected = hf.sliding_window if "sliding_attention" in layer_types else None
    assert ModelConfig.from_hf(d).sliding_window == expected


@pytest.mark.parametrize("window, context", [(64, 64), (256, 256), (1024, 256)])
def test_the_served_context_is_capped_by_a_shorter_sliding_window(window, context):
    cfg = ModelConfig.from_hf({**SHAPE, "model_type": "mistral", "max_position_embeddings": 256, "sliding_window": window})
    assert cfg.max_context()[0] == context


def test_qwen2_window_that_no_layer_uses_leaves_max_model_len_alone(tmp_path):
    """A Qwen2 config.json with use_sliding_window whose layers all come before max_window_layers
    (28 by default) slides in no layer, so transformers attends over the whole sequence; the
    engine used to refuse any max_model_len past the window."""
    hf = make_hf_checkpoint(tmp_path, "qwen2", seed=7, use_sliding_window=True, sliding_window=16)
    assert "sliding_attention" not in hf.config.layer_types
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = LLM(model=str(tmp_path), max_model_len=64).generate({"prompt_token_ids": prompt}, params)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}])
def test_linear_and_yarn_scaled_models_serve_past_their_trained_length_as_transformers(tmp_path, scaling):
    """As vLLM derives it, linear RoPE scaling serves max_position_embeddings x factor tokens and
    YaRN original_max_position_embeddings x factor (transformers computes both at any position);
    the engine used to refuse any max_model_len past max_position_embeddings."""
    hf = make_hf_checkpoint(tmp_path, seed=3, max_position_embeddings=32, rope_parameters={"rope_theta": 1e4, **scaling})
    prompt = list(range(3, 53))  # 50 tokens: past the trained 32
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tmp_path), max_model_len=64)
    assert llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 10)
    with pytest.raises(ValueError, match=r"max_model_len=65 exceeds the model's (linear-RoPE|YaRN)-scaled context "
                                         r"\(.* 32 x factor 2\) of 64"):
        LLM(model=str(tmp_path), max_model_len=65)


def test_a_swish_activation_runs_as_transformers_runs_it(tmp_path):
    """transformers' ACT2FN takes "swish" for SiLU, and so does the engine."""
    hf = make_hf_checkpoint(tmp_path, seed=5, hidden_act="swish")
    prompt = list(range(3, 20))
    assert _greedy(tmp_path, prompt).token_ids == hf_greedy(hf, prompt, 6)


def _greedy(path, prompt, n=6, **params):
    params = {"ignore_eos": True, **params}
    out = LLM(model=str(path), max_model_len=64).generate({"prompt_token_ids": prompt},
                                                          SamplingParams(max_tokens=n, temperature=0.0, **params))[0]
    return out.outputs[0]


def _from_pretrained_greedy(path, prompt, n=6):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    return hf_greedy(hf, prompt, n)


@pytest.mark.parametrize("first, then", [("single", "sharded"), ("sharded", "single")])
def test_a_stale_checkpoint_beside_a_new_save_is_ignored_as_transformers_ignores_it(tmp_path, first, then):
    """Saved once as one file and once sharded into the same folder (save_pretrained leaves the other's files),
    the folder loads what transformers' from_pretrained loads: model.safetensors before the index's shards."""
    import transformers

    a = make_hf_checkpoint(tmp_path, "llama", seed=1)
    torch.manual_seed(2)
    b = transformers.LlamaForCausalLM(a.config).eval()
    shard = {"single": {}, "sharded": {"max_shard_size": "300KB"}}
    a.save_pretrained(tmp_path, **shard[first])
    b.save_pretrained(tmp_path, **shard[then])
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "model.safetensors.index.json").is_file()
    prompt = [5, 9, 33, 2, 7]
    expected = _from_pretrained_greedy(tmp_path, prompt)
    assert expected != hf_greedy(a if then == "single" else b, prompt, 6), "the two saves should differ"
    assert _greedy(tmp_path, prompt).token_ids == expected


def test_pytorch_model_bin_is_read_before_other_safetensors_and_bin_shards(tmp_path):
    """pytorch_model.bin beside an adapter's safetensors and stale .bin shards: the single file is the model, as
    transformers reads it (not the adapter's tensors, which have no place in it)."""
    hf = make_hf_checkpoint(tmp_path / "src", "llama", seed=3)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    torch.save(state, path / "pytorch_model.bin")
    torch.save({k: torch.zeros_like(v) for k, v in state.items()}, path / "pytorch_model-00001-of-00001.bin")
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, str(path / "adapter_model.safetensors"))
    prompt = [5, 9, 33, 2, 7]
    assert _greedy(path, prompt).token_ids == hf_greedy(hf, prompt, 6)


def bin_folder(tmp_path):
    """A folder with a checkpoint's config.json and no weights yet, and that checkpoint's state dict."""
    hf = make_hf_checkpoint(tmp_path / "src", "llama", seed=3)
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    return path, {k: v.contiguous() for k, v in hf.state_dict().items()}


def assert_reads(path, state):
    read = dict(iter_checkpoint(path))
    assert read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state)


def test_bin_shards_without_an_index_load_beside_training_args_bin(tmp_path):
    """A Trainer's output folder: the model's .bin shards and training_args.bin, a pickled object, not weights."""
    path, state = bin_folder(tmp_path)
    keys = sorted(state)
    torch.save({k: state[k] for k in keys[::2]}, path / "pytorch_model-00001-of-00002.bin")
    torch.save({k: state[k] for k in keys[1::2]}, path / "pytorch_model-00002-of-00002.bin")
    (path / "training_args.bin").write_bytes(b"\x80\x04K\x01.")
    assert_reads(path, state)


def test_a_bin_in_the_legacy_pickle_format_loads(tmp_path):
    path, state = bin_folder(tmp_path)
    torch.save(state, path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert_reads(path, state)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", None])
def test_the_tokenizer_loads_from_any_of_its_files(tmp_path, monkeypatch, name):
    if name is not None:
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: ("tokenizer of", path))
    source = ModelSource(str(tmp_path), ModelConfig.from_hf(SHAPE), tmp_path)
    assert load_tokenizer(source) == (None if name is None else ("tokenizer of", str(tmp_path)))


def test_an_index_naming_a_missing_shard_is_refused_with_the_index_named(tmp_path):
    hf = make_hf_checkpoint(tmp_path / "src", "llama", seed=3)
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    weight_map = dict.fromkeys(hf.state_dict(), "pytorch_model-00001-of-00002.bin")
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"lacks pytorch_model-00001-of-00002.bin \(listed in "
                                         r"pytorch_model.bin.index.json\)"):
        _greedy(path, [5, 9])


def test_a_generation_config_without_eos_stops_on_none_as_transformers_does(tmp_path):
    """config.json names an EOS but generation_config.json none: transformers' generate stops on none, and so
    does the engine (not on config.json's)."""
    import transformers

    hf = make_hf_checkpoint(tmp_path, "llama", seed=1)
    prompt = [5, 9, 33, 2, 7]
    greedy = hf_greedy(hf, prompt, 8)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = greedy[2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    expected = reloaded.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    out = _greedy(tmp_path, prompt, 8, ignore_eos=False)
    assert out.token_ids == expected == greedy and out.finish_reason == "length"


@pytest.mark.parametrize("eos, ids", [(0, [0]), ([0, 2], [0, 2]), (None, [])])
def test_token_id_zero_is_an_eos_token_like_any_other(eos, ids):
    assert ModelConfig.from_hf({**SHAPE, "eos_token_id": eos}).eos_token_ids == ids
