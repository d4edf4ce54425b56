"""Roofline step times against hand computations from the published shape of Llama-3-8B and the
A100-80GB datasheet, and the properties the simulator relies on."""
import math
import re

import pytest

from framework.sim.cost_model import COST_MODELS, BatchShape
from framework.sim.cost_models.roofline import PARAMS, RooflineCostModel
from framework.sim.hardware import load_hardware
from models.config import ModelConfig
from models.presets import PRESETS

LLAMA3_8B = ModelConfig.from_hf(PRESETS["llama-3-8b"])
# Datasheet A100-80GB without launch costs, so the roofline terms are what is checked.
A100 = load_hardware({**load_hardware("a100-80gb").to_dict(), "launch_overhead_us": 0.0})
IDEAL = dict(matmul_efficiency=1.0, memory_efficiency=1.0, attention_efficiency=1.0, kv_efficiency=1.0,
             step_overhead_us=0.0, seq_overhead_us=0.0, token_overhead_us=0.0)
PEAK, BW = 312e12, 2039e9
# Llama-3-8B: 32 layers, hidden 4096, 32 query heads and 8 KV heads of 128, MLP 14336, vocab 128256.
LINEAR_PARAMS = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)  # qkv, o, gate/up/down
HEAD_PARAMS = 4096 * 128256
KV_BYTES_PER_TOKEN = 2 * 32 * 1024 * 2  # K and V, 32 layers, 8 x 128 dims, bf16


def model(tp=1, hardware=A100, **params):
    return RooflineCostModel(LLAMA3_8B, hardware, 2, tp, 16, **{**IDEAL, **params})


def decode(m, context):
    return BatchShape(num_seqs=m, num_tokens=m, num_sampled=m, num_decode_seqs=m, decode_context=context)


def prefill(q):
    return BatchShape(num_seqs=1, num_tokens=q, num_sampled=1, num_prefill_seqs=1, prefill_tokens=q,
                      prefill_context=q, prefill_pairs=q * (q + 1) // 2)


def test_single_decode_is_reading_the_weights_and_the_kv_cache():
    # Batch 1 at 1024 tokens of context: every weight and every cached K/V byte is read once.
    expected = (2 * (LINEAR_PARAMS + HEAD_PARAMS) + 1024 * KV_BYTES_PER_TOKEN) / BW
    got = model().step_time(decode(1, 1024))
    assert got == pytest.approx(expected, rel=3e-3)  # the rest is activations: a few MB
    assert 6.5e-3 < got < 8e-3


def test_long_prefill_is_compute_bound():
    # 2048 prompt tokens: 2 FLOPs per weight per token, plus causal attention's 4 * d * H FLOPs per
    # query-key pair in each layer; one logits row.
    q = 2048
    linear = 2 * q * LINEAR_PARAMS / PEAK
    attention = 4 * 32 * 4096 * (q * (q + 1) // 2) / PEAK
    head = 2 * HEAD_PARAMS / BW  # one row: reading the head dominates
    got = model().step_time(prefill(q))
    assert got == pytest.approx(linear + attention + head, rel=0.08)  # + norms/activations traffic
    assert got > linear + attention + head
    assert model(matmul_efficiency=0.5).step_time(prefill(q)) == pytest.approx(got + linear, rel=1e-9)


def test_a_float32_prefill_runs_at_the_float32_peak():
    # PyTorch runs float32 GEMMs on the CUDA cores (allow_tf32 is off by default): the A100's FP32
    # peak is 19.5 TFLOP/s against 312 for BF16, so a compute-bound prefill takes 16x as long in
    # its GEMMs and attention; the weights, the head and the activations are twice the bytes.
    q, pairs = 2048, 2048 * 2049 // 2
    fp32 = RooflineCostModel(LLAMA3_8B, A100, 4, 1, 16, dtype="float32", **IDEAL)
    bf16 = RooflineCostModel(LLAMA3_8B, A100, 2, 1, 16, dtype="bfloat16", **IDEAL)
    compute = {}
    for m, peak, b in ((fp32, 19.5e12, 4), (bf16, 312e12, 2)):
        linear = 2 * q * LINEAR_PARAMS / peak
        attention = 4 * 32 * 4096 * pairs / peak
        head = HEAD_PARAMS * b / BW  # one logits row: reading the head dominates
        got = m.step_time(prefill(q))
        assert linear + attention + head < got < 1.08 * (linear + attention + head)  # + activation traffic
        # Halving an efficiency doubles exactly its compute leg: both are compute bound.
        gemms = RooflineCostModel(LLAMA3_8B, A100, b, 1, 16, dtype=m.dtype, **{**IDEAL, "matmul_efficiency": 0.5}
                                  ).step_time(prefill(q)) - got
        attn = RooflineCostModel(LLAMA3_8B, A100, b, 1, 16, dtype=m.dtype, **{**IDEAL, "attention_efficiency": 0.5}
                                 ).step_time(prefill(q)) - got
        assert (gemms, attn) == (pytest.approx(linear, rel=1e-9), pytest.approx(attention, rel=1e-9))
        compute[m.dtype] = gemms + attn
    assert compute["float32"] / compute["bfloat16"] == pytest.approx(312 / 19.5, rel=1e-9)
    # The whole step a little less: its memory traffic (a few % of the bf16 step) only doubles.
    assert 0.9 * 16 < fp32.step_time(prefill(q)) / bf16.step_time(prefill(q)) < 16
    # Without a dtype, 4-byte weights are float32 and 2-byte ones the device's own (bfloat16).
    assert RooflineCostModel(LLAMA3_8B, A100, 4, 1, 16, **IDEAL).step_time(prefill(q)) == fp32.step_time(prefill(q))
    assert RooflineCostModel(LLAMA3_8B, A100, 2, 1, 16, **IDEAL).step_time(prefill(q)) == bf16.step_time(prefill(q))


def test_the_dtype_picks_its_own_peak_among_16_bit_dtypes():
    # float16 and bfloat16 are both 2 bytes: only the dtype's name tells their peaks apart.
    hw = load_hardware({**A100.to_dict(), "peak_tflops": {"bfloat16": 300, "float16": 150}})
    q = 2048
    fp16 = RooflineCostModel(LLAMA3_8B, hw, 2, 1, 16, dtype="fp16", **IDEAL)
    bf16 = RooflineCostModel(LLAMA3_8B, hw, 2, 1, 16, dtype="bfloat16", **IDEAL)
    assert fp16.dtype == "float16"
    # Without a dtype, 2-byte weights on a float16 device are float16, as dtype=auto means there.
    assert RooflineCostModel(LLAMA3_8B, load_hardware({**hw.to_dict(), "dtype": "float16"}), 2, 1, 16).dtype == "float16"
    slower = fp16.step_time(prefill(q)) - bf16.step_time(prefill(q))
    assert slower == pytest.approx(2 * q * LINEAR_PARAMS / 300e12 + 4 * 32 * 4096 * (q * (q + 1) // 2) / 300e12,
                                   rel=1e-9)
    with pytest.raises(ValueError, match=r"^hardware 'a100-80gb' gives no peak_tflops for float32; it lists "
                                         r"bfloat16, float16 \(add a float32 figure to its description\)$"):
        RooflineCostModel(LLAMA3_8B, hw, 4, 1, 16)
    with pytest.raises(ValueError, match="cost model dtype float32 is 4 bytes wide, but dtype_bytes is 2"):
        RooflineCostModel(LLAMA3_8B, hw, 2, 1, 16, dtype="float32")
    with pytest.raises(ValueError, match=r"cost model dtype must be one of \['bf16', .*got 'fp8'"):
        RooflineCostModel(LLAMA3_8B, hw, 2, 1, 16, dtype="fp8")


def test_the_sim_executor_gives_the_cost_model_the_engine_dtype():
    from framework import EngineConfig, LLMEngine

    for dtype, expected in (("float32", "float32"), ("fp16", "float16"), ("auto", "bfloat16")):
        engine = LLMEngine(EngineConfig(model="qwen2-7b", executor="sim", dtype=dtype, max_model_len=1024))
        assert engine.executor.cost_model.dtype == expected
        assert engine.executor.cost_model._lin_c_tok == pytest.approx(
            2 * engine.model_config.num_hidden_layers * 1e-12 / {"float32": 19.5, "float16": 312, "bfloat16": 312}[expected]
            * (lambda m: m.hidden_size * (m.q_size + 2 * m.num_key_value_heads * m.head_dim) + m.q_size * m.hidden_size
               + 3 * m.hidden_size * m.intermediate_size)(engine.model_config), rel=1e-12)


def test_decode_batch_amortises_weights_until_compute_bound():
    m = model()
    small, large = m.step_time(decode(8, 8 * 1024)), m.step_time(decode(512, 512 * 8))
    assert small < 2 * m.step_time(decode(1, 1024))  # still bound by reading the weights once
    # 512 rows: 2 * 512 FLOPs per weight exceeds the ridge point (312e12 / 2039e9 = 153 FLOP/byte).
    assert large > 2 * 512 * LINEAR_PARAMS / PEAK


def test_tensor_parallel_splits_weights_and_adds_all_reduces():
    # Batch 1 at 1024 tokens on 2 GPUs: each reads half the weights and half the KV cache, then
    # two ring all-reduces of 4096 bf16 values per layer and one after the embedding over 300 GB/s
    # NVLink (each GPU sends 2 (p-1)/p of the data, 8 us latency each) and a gather of the bf16 logits.
    all_reduce = (32 * 2 + 1) * (2 * (1 / 2) * 4096 * 2 / 300e9 + 8e-6)
    gather = (1 / 2) * 128256 * 2 / 300e9 + 8e-6
    expected = (2 * (LINEAR_PARAMS + HEAD_PARAMS) + 1024 * KV_BYTES_PER_TOKEN) / 2 / BW + all_reduce + gather
    assert model(tp=2).step_time(decode(1, 1024)) == pytest.approx(expected, rel=3e-3)
    # 8 KV heads over 16 GPUs: each holds one, replicated (vLLM's rule), so the KV read halves only 8x.
    h16 = model(tp=16).step_time(decode(1, 1 << 20)) - model(tp=16).step_time(decode(1, 0))
    assert h16 == pytest.approx((1 << 20) * KV_BYTES_PER_TOKEN / 8 / BW, rel=1e-9)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_communication_counts_every_collective(tp):
    # vLLM all-reduces twice per layer and once after the vocabulary-parallel embedding (each device
    # looks up only its share of the ids), then gathers the logits: 2 * 32 + 2 collectives for
    # Llama-3-8B. The embedding's all-reduce was left out. Isolated here by slowing the link: a
    # latency of 1 s per collective, and a bandwidth one tenth of NVLink's.
    def link(**fields):
        return load_hardware({**A100.to_dict(), "launch_overhead_us": 1.0, **fields})

    shape = BatchShape()
    for cached, new in [(0, 300), (700, 1), (50, 1)]:
        shape.add_row(cached, new, True)
    n, sampled, layers = 302, 3, 32
    latency = model(tp, link(interconnect_latency_us=1e6)).step_time(shape) - model(tp, link()).step_time(shape)
    assert latency == pytest.approx((2 * layers + 2) * (1.0 - 8e-6), rel=1e-12)
    collectives = ((2 * layers + 1) * 2 * (tp - 1) / tp * n * 4096 * 2   # all-reduces of bf16 hidden states
                   + (tp - 1) / tp * sampled * 128256 * 2)               # gather of bf16 logits (vLLM's)
    slower = model(tp, link(interconnect_gb_s=30)).step_time(shape) - model(tp, link()).step_time(shape)
    assert slower == pytest.approx(collectives * (1 / 30e9 - 1 / 300e9), rel=1e-9)
    # One kernel per collective: the launch cost grows by as many launches.
    launches = model(tp, link(launch_overhead_us=2.0)).step_time(shape) - model(tp, link()).step_time(shape)
    assert launches == pytest.approx((layers * 12 + 6 + 2 * layers + 2) * 1e-6, rel=1e-9)


def test_logits_rows_are_written_in_the_model_dtype():
    # vLLM's LM head writes its logits in the model's dtype (bf16 here); only the sampler makes a
    # float32 copy. Each sampled row reads its 4096 hidden values and writes its 128256 logits;
    # 65 rows against 1 (the head's weights read once either way, still memory bound).
    def head(sampled):
        shape = BatchShape()
        for i in range(65):
            shape.add_row(100, 1, i < sampled)
        return model().step_time(shape)

    assert 2 * 65 * HEAD_PARAMS / PEAK < (2 * HEAD_PARAMS + 65 * (4096 + 128256) * 2) / BW  # memory bound
    assert head(65) - head(1) == pytest.approx(64 * (4096 + 128256) * 2 / BW, rel=1e-9)


def test_swaps_cross_pcie_and_copies_stay_in_device_memory():
    m = model()
    base = m.step_time(decode(4, 4000))
    block = 16 * KV_BYTES_PER_TOKEN
    swapped = BatchShape(**{**decode(4, 4000).__dict__, "swap_in_blocks": 10, "swap_out_blocks": 5})
    assert m.step_time(swapped) == pytest.approx(base + 15 * block / 25e9, rel=1e-9)
    copied = BatchShape(**{**decode(4, 4000).__dict__, "copy_blocks": 3})
    assert m.step_time(copied) == pytest.approx(base + 3 * 2 * block / BW, rel=1e-9)
    # A step that only moves blocks runs no model: its overhead and the transfer.
    stepped = model(step_overhead_us=100)
    assert stepped.step_time(BatchShape(swap_in_blocks=2)) == pytest.approx(100e-6 + 2 * block / 25e9, rel=1e-9)


def test_overheads_add_per_step_request_layer_and_token():
    base = model().step_time(prefill(100))
    m = model(step_overhead_us=100, seq_overhead_us=10, token_overhead_us=0.5)
    assert m.step_time(prefill(100)) == pytest.approx(base + 100e-6 + 10e-6 + 50e-6, rel=1e-9)
    launches = RooflineCostModel(LLAMA3_8B, load_hardware("a100-80gb"), 2, 1, 16, **IDEAL)
    assert launches.step_time(prefill(100)) == pytest.approx(base + (32 * 12 + 6) * 4e-6, rel=1e-9)


def test_decode_step_time_is_step_time_bit_for_bit():
    m = RooflineCostModel(LLAMA3_8B, load_hardware("h100-sxm"), 2, 2, 16)
    for num, ctx in [(1, 1), (3, 700), (64, 64 * 900), (255, 1)]:
        assert m.decode_step_time(num, ctx) == m.step_time(decode(num, ctx))


def test_extra_weight_passes_read_the_layers_weights_again_by_token_count():
    # Extra passes at 1, 4 and 8 tokens: 0.5, 2 and 3, interpolated between and held beyond.
    curve = model(extra_weight_passes={1: 0.5, 4: 2, 8: 3})
    one_pass = 2 * LINEAR_PARAMS / BW
    for tokens, passes in [(1, 0.5), (2, 1.0), (4, 2.0), (6, 2.5), (8, 3.0), (300, 3.0)]:
        added = curve.decode_step_time(tokens, 1024) - model().decode_step_time(tokens, 1024)
        assert added == pytest.approx(passes * one_pass, rel=1e-9), tokens
    assert curve.step_time(prefill(300)) - model().step_time(prefill(300)) == pytest.approx(3 * one_pass, rel=1e-9)
    assert curve.extra_weight_passes == {1: 0.5, 4: 2.0, 8: 3.0}


@pytest.mark.parametrize("curve, message", [
    ({0: 1.0}, "token counts must be positive integers, got 0"), ({"x": 1.0}, "token counts must be positive integers"),
    ({2.0: 1.0}, "token counts must be positive integers"), ({"2": 1.0, 2: 2.0}, "token count 2 is given twice"),
    ({2: -1.0}, r"extra_weight_passes\[2\] must be a finite number >= 0, got -1.0"),
    ({2: "1"}, "must be a finite number >= 0"), ({2: math.inf}, "must be a finite number >= 0"),
    ([1, 2], r"must map token counts .* to extra weight passes .*e.g. \{1: 0, 4: 1.5\}")])
def test_extra_weight_passes_are_checked(curve, message):
    with pytest.raises(ValueError, match=message):
        model(extra_weight_passes=curve)


def test_extra_weight_passes_come_from_the_calibration_under_explicit_ones(tmp_path):
    import yaml

    # Keys may come as strings (YAML written by hand, Hydra overrides); explicit options win, {} turns it off.
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump({"params": {"extra_weight_passes": {"1": 0, "4": 1.5}}}))
    assert RooflineCostModel(LLAMA3_8B, A100, calibration=str(path)).extra_weight_passes == {1: 0.0, 4: 1.5}
    assert RooflineCostModel(LLAMA3_8B, A100, calibration=str(path), extra_weight_passes={8: 2}).extra_weight_passes == {8: 2.0}
    assert RooflineCostModel(LLAMA3_8B, A100, calibration=str(path), extra_weight_passes={}).extra_weight_passes == {}
    path.write_text(yaml.safe_dump({"params": {"extra_weight_passes": {0: 1.0}}}))
    with pytest.raises(ValueError, match=f"from calibration '{path}'.*positive integers"):
        RooflineCostModel(LLAMA3_8B, A100, calibration=str(path))


def test_an_empty_step_costs_only_the_step_overhead():
    m = model(step_overhead_us=100.0, extra_weight_passes={1: 1.0})
    assert m.step_time(BatchShape()) == pytest.approx(100e-6)


def test_a_short_prefill_behind_a_long_cached_context_reads_its_keys_and_values():
    # 8 new tokens behind 4,000 cached ones (a prefix hit, or a late chunk): few query-key pairs, so reading the
    # 4,008 keys and values of every layer binds, at the KV bandwidth (docs/simulator.md).
    m = model(kv_efficiency=0.6)
    cold, hit = BatchShape(), BatchShape()
    cold.add_row(0, 8, True)
    hit.add_row(4000, 8, True)
    kv_read = lambda keys: KV_BYTES_PER_TOKEN * keys / (BW * 0.6)
    assert m.step_time(hit) - m.step_time(cold) == pytest.approx(kv_read(4008) - kv_read(8), rel=0.01)


def test_a_prompt_chunk_that_samples_nothing_reads_no_lm_head():
    chunk = prefill(2048)
    last = model().step_time(chunk)
    chunk.num_sampled = 0  # a chunk before the prompt's end
    assert last - model().step_time(chunk) == pytest.approx((2 * HEAD_PARAMS + 2 * (4096 + 128256)) / BW, rel=1e-6)


def test_legs_reproduce_step_time_for_every_shape():
    from framework.sim.calibration import predict

    m = model(tp=2, hardware=load_hardware("h100-sxm"), matmul_efficiency=0.6, memory_efficiency=0.7,
              attention_efficiency=0.4, kv_efficiency=0.5, step_overhead_us=300, seq_overhead_us=7,
              extra_weight_passes={2: 0.25, 4: 1.5, 16: 2.0})
    mixed = BatchShape(num_seqs=5, num_tokens=260, num_sampled=4, num_decode_seqs=4, decode_context=9000,
                       num_prefill_seqs=1, prefill_tokens=256, prefill_context=1256, prefill_pairs=256 * 1000 + 256 * 257 // 2,
                       swap_in_blocks=2, copy_blocks=1)
    swaps_only = BatchShape(swap_out_blocks=4, copy_blocks=1)
    for shape in (mixed, decode(9, 3000), decode(1, 10), decode(3, 100), prefill(4000), swaps_only):
        offset, groups = m.legs(shape)
        assert predict(offset, groups, m.fit_vector()) == pytest.approx(m.step_time(shape), rel=1e-12)
    # Attention slow enough (as a fit may find it) that decode attention binds on compute, not on the KV read.
    slow = model(attention_efficiency=0.002)
    assert slow.step_time(decode(9, 3000)) > 1.2 * model().step_time(decode(9, 3000))
    for shape in (mixed, decode(9, 3000)):
        offset, groups = slow.legs(shape)
        assert predict(offset, groups, slow.fit_vector()) == pytest.approx(slow.step_time(shape), rel=1e-12)


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown roofline option.*matmul_efficiency"):
        model(matmul_eff=0.5)
    with pytest.raises(ValueError, match="matmul_efficiency must be > 0"):
        model(matmul_efficiency=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must .* divide"):
        model(tp=3)
    for overhead in ("step_overhead_us", "seq_overhead_us", "token_overhead_us"):
        with pytest.raises(ValueError, match=f"roofline {overhead} must be >= 0, got -0.5"):
            model(**{overhead: -0.5})
    no_link = load_hardware({**A100.to_dict(), "interconnect_gb_s": 0})
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs hardware 'a100-80gb' to give interconnect_gb_s"):
        model(tp=2, hardware=no_link)
    with pytest.raises(ValueError, match="calibration file .* does not exist"):
        RooflineCostModel(LLAMA3_8B, A100, calibration="/no/such.yaml")
    assert "roofline" in COST_MODELS.list() and set(PARAMS) >= set(IDEAL)


def test_calibration_parameters_apply_under_explicit_options(tmp_path):
    import yaml

    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump({"params": {"matmul_efficiency": 0.25, "step_overhead_us": 50.0}}))
    m = RooflineCostModel(LLAMA3_8B, A100, calibration=str(path), step_overhead_us=10.0)
    assert m.params["matmul_efficiency"] == 0.25 and m.params["step_overhead_us"] == 10.0
    path.write_text(yaml.safe_dump({"params": {"bogus": 1}}))
    with pytest.raises(ValueError, match="unknown parameter"):
        RooflineCostModel(LLAMA3_8B, A100, calibration=str(path))


def test_a_calibration_applied_to_another_model_device_or_setting_is_warned_about(tmp_path, caplog):
    """A fit on tiny-llama loaded into a Llama-3-8B simulation (or one in another dtype, tensor-parallel
    degree or block size) without a word (another device was warned about)."""
    import yaml

    from framework.sim.profile import calibration_record

    tiny = ModelConfig.from_hf(PRESETS["tiny-llama"])
    record = calibration_record("roofline", "tiny-llama", A100, 2, 16, {"step_overhead_us": 50.0}, {}, [],
                                model_config=tiny)
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(record))
    with caplog.at_level("WARNING", logger="framework.sim.cost_models.roofline"):
        RooflineCostModel(tiny, A100, calibration=str(path))
        assert not caplog.records  # the model and device it was fitted on
        RooflineCostModel(LLAMA3_8B, A100, calibration=str(path))
        assert len(caplog.records) == 1
        assert re.search(r"fitted on model 'tiny-llama' applied to a model of another shape \(.*hidden_size "
                         f"{tiny.hidden_size} vs 4096.*\): its efficiency factors may not carry over",
                         caplog.records[0].getMessage())
        caplog.clear()
        RooflineCostModel(tiny, load_hardware("h100-sxm"), calibration=str(path))
        assert [r.getMessage() for r in caplog.records] == [
            "calibration fitted on hardware 'a100-80gb' applied to 'h100-sxm': its efficiency factors may not carry over"]
        caplog.clear()
        # Measured in 2-byte weights at TP 1 in 16-token blocks: each other setting is named.
        RooflineCostModel(tiny, A100, dtype_bytes=4, tensor_parallel_size=2, block_size=32, calibration=str(path))
        assert [r.getMessage() for r in caplog.records] == [
            "calibration measured with other settings than this simulation's (dtype_bytes 2 vs 4, tensor_parallel_size "
            "1 vs 2, block_size 16 vs 32): its efficiency factors may not carry over"]
        caplog.clear()
        RooflineCostModel(tiny, A100, calibration={"params": {}})  # a calibration without provenance
        assert not caplog.records
        # Efficiencies are fractions of the dtype's peak: a bf16 fit in a float16 simulation (both
        # 2 bytes) is named; a calibration without a dtype (written before it was recorded) is not.
        path.write_text(yaml.safe_dump({**record, "dtype": "bfloat16"}))
        RooflineCostModel(tiny, A100, calibration=str(path))
        assert not caplog.records
        RooflineCostModel(tiny, A100, dtype="float16", calibration=str(path))
        assert [r.getMessage() for r in caplog.records] == [
            "calibration measured with other settings than this simulation's (dtype bfloat16 vs float16): its "
            "efficiency factors may not carry over"]


def test_no_pcie_makes_swaps_infinitely_slow_but_nothing_else():
    hw = load_hardware({**A100.to_dict(), "pcie_gb_s": 0})
    m = RooflineCostModel(LLAMA3_8B, hw, 2, 1, 16, **IDEAL)
    assert math.isfinite(m.step_time(decode(2, 100)))
    assert m.step_time(BatchShape(**{**decode(2, 100).__dict__, "swap_in_blocks": 1})) == math.inf


@pytest.mark.parametrize("option, value", [
    ("step_overhead_us", math.nan), ("seq_overhead_us", math.inf), ("matmul_efficiency", math.inf),
    ("matmul_efficiency", "abc"), ("kv_efficiency", None), ("token_overhead_us", True), ("kernels_per_layer", math.nan)])
def test_parameters_must_be_finite_numbers(option, value):
    # A NaN overhead passed the >= 0 check and made every step time, and every latency, NaN.
    with pytest.raises(ValueError, match=f"roofline {option} must be a finite number, got"):
        model(**{option: value})


def test_structure_must_not_be_negative():
    with pytest.raises(ValueError, match="roofline kernels_per_layer must be >= 0, got -5.0"):
        model(kernels_per_layer=-5)


@pytest.mark.parametrize("value", [".nan", "abc", "null"])
def test_calibration_parameters_must_be_finite_numbers(tmp_path, value):
    path = tmp_path / "cal.yaml"
    path.write_text(f"params:\n  step_overhead_us: {value}\n")
    with pytest.raises(ValueError, match=f"step_overhead_us \\(from calibration '{path}'\\) must be a finite number"):
        RooflineCostModel(LLAMA3_8B, A100, calibration=str(path))


@pytest.mark.parametrize("text, message", [
    (": : :\n  - [\n", "is not valid YAML"), ("params: {}\nhardware: cpu\n", "'hardware' must be the device description")])
def test_malformed_calibration_files_are_reported(tmp_path, text, message):
    # Both used to escape as tracebacks (yaml's ParserError; AttributeError: 'str' object has no attribute 'get').
    path = tmp_path / "cal.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        RooflineCostModel(LLAMA3_8B, A100, calibration=str(path))


def test_a_calibration_fitted_against_other_figures_of_the_same_device_is_warned_about(tmp_path, caplog):
    """A bfloat16 fit made when the cpu preset had one peak (0.3 TFLOP/s for every dtype) holds
    efficiencies that are fractions of 0.3: against today's bfloat16 peak of 0.6 its compute legs
    take half the time it fitted, and this went without a word (the device's name is the same)."""
    import yaml

    from framework.sim.hardware import Hardware
    from framework.sim.profile import calibration_record

    tiny = ModelConfig.from_hf(PRESETS["tiny-llama"])
    cpu = load_hardware("cpu")
    old_cpu = Hardware(**{**cpu.to_dict(), "peak_tflops": 0.3})  # the preset as it was
    params = {"matmul_efficiency": 0.5, "attention_efficiency": 0.5, "step_overhead_us": 0.0, "seq_overhead_us": 0.0}
    record = calibration_record("roofline", "tiny-llama", old_cpu, 2, 16, params, {}, [], model_config=tiny)
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(record))
    shape = BatchShape(num_seqs=1, num_tokens=512, num_sampled=1, num_prefill_seqs=1, prefill_tokens=512,
                       prefill_context=512, prefill_pairs=512 * 513 // 2)
    fitted = RooflineCostModel(tiny, old_cpu, 2, calibration=str(path), kernels_per_layer=0, kernels_per_step=0)
    applied = RooflineCostModel(tiny, cpu, 2, calibration=str(path), kernels_per_layer=0, kernels_per_step=0)
    assert applied.dtype == "bfloat16" and applied.step_time(shape) < 0.75 * fitted.step_time(shape)
    caplog.clear()
    with caplog.at_level("WARNING", logger="framework.sim.cost_models.roofline"):
        RooflineCostModel(tiny, cpu, 2, calibration=str(path))
        assert [r.getMessage() for r in caplog.records] == [
            "calibration fitted on hardware 'cpu' with other figures than this simulation's (bfloat16 peak_tflops "
            "0.3 vs 0.6): its efficiency factors are fractions of them and may not carry over"]
        caplog.clear()
        RooflineCostModel(tiny, old_cpu, 2, calibration=str(path))  # the figures it was fitted against
        assert not caplog.records
        # A fit recorded with today's per-dtype peaks: only the dtype measured is compared, and
        # another bandwidth is named too.
        path.write_text(yaml.safe_dump(calibration_record("roofline", "tiny-llama", cpu, 4, 16, params, {}, [],
                                                          model_config=tiny, dtype="float32")))
        RooflineCostModel(tiny, cpu, 4, calibration=str(path))
        assert not caplog.records
        faster = Hardware(**{**cpu.to_dict(), "peak_tflops": {"float32": 0.6}, "memory_bandwidth_gb_s": 40})
        RooflineCostModel(tiny, faster, 4, calibration=str(path))
        assert [r.getMessage() for r in caplog.records] == [
            "calibration fitted on hardware 'cpu' with other figures than this simulation's (float32 peak_tflops "
            "0.3 vs 0.6, memory_bandwidth_gb_s 20 vs 40): its efficiency factors are fractions of them and may not "
            "carry over"]


def test_a_calibration_naming_no_hardware_loads_as_one_without_provenance(tmp_path, caplog):
    # `hardware: null` passed load_calibration's check, then failed with AttributeError: 'NoneType'
    # object has no attribute 'get'.
    path = tmp_path / "cal.yaml"
    path.write_text("params: {step_overhead_us: 50.0}\nhardware: null\n")
    with caplog.at_level("WARNING", logger="framework.sim.cost_models.roofline"):
        m = RooflineCostModel(LLAMA3_8B, A100, calibration=str(path))
    assert m.params["step_overhead_us"] == 50.0 and not caplog.records


@pytest.mark.parametrize("tp", [True, 2.0, "2"])
def test_tensor_parallel_size_must_be_an_integer(tp):
    # A bool is no device count: true ran as one device, and the run's summary said `true`.
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp!r} must be >= 1"):
        model(tp=tp)
