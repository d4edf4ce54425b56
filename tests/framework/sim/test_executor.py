"""The simulated executor: vLLM's KV sizing from the model and device description, virtual time
from the cost model, and outputs whose lengths are the requests' own."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from framework import LLM, EngineConfig, LLMEngine, SamplingParams
from framework.common.clock import VirtualClock, WallClock
from framework.harness.cluster import Cluster
from framework.sim.cost_model import COST_MODELS, BatchShape
from framework.sim.cost_models.roofline import RooflineCostModel
from framework.execution.executor import EXECUTORS
from framework.sim.hardware import GiB, hardware_presets, load_hardware
from framework.testing.registries import forget_registrations
from tests.framework.sim.support import RunCounter, chat_requests

LLAMA3_8B_PARAMS = 8_030_261_248


def sim_engine(**kw):
    args = dict(model="llama-3-8b", executor="sim")
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def test_kv_blocks_are_what_vllm_leaves_after_weights_and_activations():
    engine = sim_engine(max_num_batched_tokens=4096, max_num_seqs=128, policy="chunked")
    # 0.9 of 80 GiB, less the CUDA runtime (0.75 GiB), bf16 weights and the largest step's
    # activations: 4096 tokens x (fused gate/up + qkv + 4 x hidden) bf16 values, twice, and float32
    # logits for 128 rows. A block is 16 tokens x 32 layers x K and V x 8 heads x 128 x 2 bytes.
    activations = 4096 * (2 * 14336 + 4096 + 2 * 1024 + 4 * 4096) * 2 * 2 + 128 * 128256 * 4
    budget = 80 * GiB * 0.9 - 0.75 * GiB - LLAMA3_8B_PARAMS * 2 - activations
    assert engine.allocator.num_blocks == int(budget // (16 * 32 * 2 * 8 * 128 * 2))
    assert engine.allocator.num_cpu_blocks == 4 * GiB // (16 * 32 * 2 * 8 * 128 * 2)  # swap_space=4 GiB
    h200 = sim_engine(max_num_batched_tokens=4096, max_num_seqs=128, policy="chunked", executor_options={"hardware": "h200"})
    assert h200.allocator.num_blocks > 1.9 * engine.allocator.num_blocks  # 140 GiB, same weights


def test_a_simulated_engine_logs_its_kv_cache_as_the_model_executor_does(caplog):
    with caplog.at_level("INFO", logger="framework.sim.executor"):
        engine = sim_engine(executor_options={"hardware": "h200", "tensor_parallel_size": 2})
    block_mib = 16 * 32 * 2 * 4 * 128 * 2 / 2**20  # 16 tokens x 32 layers x K and V x 4 of 8 KV heads x 128 x bf16
    assert (f"KV cache (simulated, h200, per device): {engine.allocator.num_blocks} blocks x 16 tokens "
            f"({engine.allocator.num_blocks * block_mib:.1f} MiB), swap space {engine.allocator.num_cpu_blocks} "
            f"blocks") in caplog.messages


def test_under_tensor_parallelism_the_sampling_device_holds_the_whole_vocabularys_logits():
    # Llama-3-8B at TP 2 on A100s: each device holds half the GEMM activations, but the logits
    # are gathered onto the device that samples: 256 rows x 128256 float32, not half of them.
    engine = sim_engine(max_num_batched_tokens=8192, max_num_seqs=256,
                        executor_options={"hardware": "a100-80gb", "tensor_parallel_size": 2})
    config = engine.executor.source.config
    activations = 8192 * (2 * 14336 // 2 + 4096 // 2 + 2 * 512 + 4 * 4096) * 2 * 2 + 256 * 128256 * 4
    budget = 80 * GiB * 0.9 - 0.75 * GiB - config.num_params_per_device(2) * 2 - activations
    block = 16 * 32 * 2 * 4 * 128 * 2  # 8 KV heads / 2 devices = 4 each
    assert engine.allocator.num_blocks == int(budget // block) < 256 * 8192 // 16  # not capped


def test_tensor_parallelism_shards_weights_and_kv_heads():
    one = sim_engine(model="llama-3-70b", executor_options={"hardware": "h100-sxm", "tensor_parallel_size": 4})
    two = sim_engine(model="llama-3-70b", executor_options={"hardware": "h100-sxm", "tensor_parallel_size": 8})
    assert one.executor.weight_bytes() == pytest.approx(70.55e9 * 2 / 4, rel=1e-3)
    assert one.executor.bytes_per_block == 16 * 80 * 2 * 2 * 128 * 2  # 8 KV heads / 4 GPUs = 2 each
    assert two.allocator.num_blocks > 2 * one.allocator.num_blocks  # half the weights and half the KV per GPU


def test_kv_projections_are_replicated_past_the_kv_head_count():
    # 16 GPUs, 8 KV heads: each GPU holds one whole KV head (its K and V projections), twice its
    # even share; the 161 norms (2 a layer and the final one) are whole on every GPU too.
    sixteen = sim_engine(model="llama-3-70b", executor_options={"hardware": "h200", "tensor_parallel_size": 16})
    config = sixteen.executor.source.config
    extra = 80 * (2 * 8192 * 128 - 2 * 8192 * 1024 / 16) + 161 * 8192 * 15 / 16
    assert sixteen.executor.weight_bytes() / 2 == pytest.approx(config.num_params() / 16 + extra, abs=1)


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit on 'l40s'.*raise tensor_parallel_size"):
        sim_engine(model="llama-3-70b", executor_options={"hardware": "l40s"})


def test_the_does_not_fit_error_counts_the_runtime_reserve_out_of_the_usable_memory():
    # Llama-3-8B on an L40S at 0.3545: 0.3545 x 45 GiB = 15.95 GiB, less the 0.75 GiB runtime
    # reserve, is under the 15.0 GiB of weights and 0.5 GiB of activations. The message used to
    # call the 15.95 GiB usable, so the model "did not fit" in more than it needs.
    with pytest.raises(ValueError, match="does not fit") as err:
        sim_engine(gpu_memory_utilization=0.3545, executor_options={"hardware": "l40s"})
    message = str(err.value)
    weights, activations, usable = (float(x) for x in re.findall(r"([\d.]+) GiB (?:of weights|of activations|usable)",
                                                                  message))
    assert weights + activations > usable
    assert usable == pytest.approx(45.0 * 0.3545 - 0.75, abs=0.01)
    assert "gpu_memory_utilization" in message


def test_explicit_kv_sizes_and_the_cpu_device_follow_the_model_executor():
    assert sim_engine(num_gpu_blocks_override=1000).allocator.num_blocks == 1000
    assert sim_engine(kv_cache_memory_gb=2.0).allocator.num_blocks == 2 * GiB // (16 * 131072)
    cpu = sim_engine(model="tiny-llama", max_model_len=256, cpu_kv_cache_gb=0.004,
                     executor_options={"hardware": "cpu"})
    assert cpu.executor.dtype_bytes == 4  # dtype=auto on a CPU is float32, as the model executor has it
    # 16 tokens x K and V x 4 layers x 4 KV heads x 32 dims x 4 bytes
    assert cpu.allocator.num_blocks == int(0.004 * GiB // (16 * 2 * 4 * 4 * 32 * 4))


def test_sim_runs_on_virtual_time_from_the_cost_model():
    engine = sim_engine()
    assert isinstance(engine.clock, VirtualClock) and EXECUTORS.get("model").make_clock().__class__ is WallClock
    with pytest.raises(ValueError, match="VirtualClock"):
        LLMEngine(EngineConfig(model="llama-3-8b", executor="sim"), clock=WallClock())
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(10, 110)), params)
    cost = engine.executor.cost_model
    prefill = BatchShape(num_seqs=1, num_tokens=100, num_sampled=1, num_prefill_seqs=1, prefill_tokens=100,
                         prefill_context=100, prefill_pairs=100 * 101 // 2)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    times = outs[-1].metrics.token_times
    t1 = cost.step_time(prefill)
    t2 = t1 + cost.decode_step_time(1, 101)
    assert times == [t1, t2, t2 + cost.decode_step_time(1, 102)]
    assert engine.clock.now() == times[-1]


def test_outputs_run_to_max_tokens_and_never_stop_on_the_sampled_token():
    llm = LLM(model="tiny-llama", executor="sim", max_model_len=512, executor_options={"hardware": "cpu"})
    token = llm.engine.executor.sampled_token
    assert token not in llm.engine.model_config.eos_token_ids
    outs = llm.generate([{"prompt_token_ids": [5] * 20}, {"prompt_token_ids": [6] * 30}],
                        [SamplingParams(max_tokens=40), SamplingParams(max_tokens=7, stop_token_ids=[token])])
    assert [len(o.outputs[0].token_ids) for o in outs] == [40, 7]
    assert outs[0].outputs[0].finish_reason == "length" and token not in outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="sampled_token must be a non-EOS id"):
        LLM(model="tiny-llama", executor="sim", executor_options={"hardware": "cpu", "sampled_token": 2})


def test_penalties_and_min_p_are_accepted_and_change_no_timing():
    """The simulator's tokens are synthetic and its cost model has no sampler term: requests with
    penalties or min-p run exactly as the same requests without them."""
    def run(**sampling):
        llm = LLM(model="tiny-llama", executor="sim", max_model_len=512, executor_options={"hardware": "cpu"})
        outs = llm.generate([{"prompt_token_ids": [5] * 20}, {"prompt_token_ids": [6] * 30}],
                            [SamplingParams(max_tokens=m, temperature=0.0, **sampling) for m in (12, 5)])
        return [(o.outputs[0].token_ids, o.metrics.token_times) for o in outs]

    plain = run()
    assert run(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=1.0, min_p=0.1) == plain


@pytest.mark.parametrize("bad", ["abc", True, 1.5])
def test_sampled_token_must_be_an_integer_id(bad):
    # A string used to fail in a comparison (TypeError); True and 1.5 were taken as ids.
    with pytest.raises(ValueError, match="sampled_token must be a non-EOS id"):
        LLM(model="tiny-llama", executor="sim", executor_options={"hardware": "cpu", "sampled_token": bad})


def test_shape_only_presets_are_refused_by_the_model_executor():
    with pytest.raises(ValueError, match="shape-only preset .* executor=sim"):
        LLMEngine(EngineConfig(model="mistral-7b", executor="model"))


@pytest.mark.parametrize("part", ["backend", "preparer"])
def test_a_simulated_run_still_refuses_an_unknown_tensor_part(part):
    """It never uses the attention backend or the input preparer, but a typo there would label the
    run with a part that does not exist."""
    from framework import UnknownNameError

    with pytest.raises(UnknownNameError, match=f"unknown {part} 'bogus'; registered {part}s: "):
        LLMEngine(EngineConfig(model="llama-3-8b", executor="sim", **{part: "bogus"}))


def test_a_simulated_run_never_imports_torch():
    code = ("import sys; from framework import LLM, SamplingParams; "
            "llm = LLM(model='qwen2-7b', executor='sim', max_model_len=1024); "
            "out = llm.generate({'prompt_token_ids': [1, 2, 3]}, SamplingParams(max_tokens=5))[0]; "
            "print(len(out.outputs[0].token_ids), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["5", "False"]


def test_hardware_presets_and_errors():
    for name in ("a100-80gb", "h100-sxm", "h200", "l40s", "cpu"):
        hw = load_hardware(name)
        assert hw.peak_flops(hw.dtype) > 0 and hw.memory_bandwidth > 0 and hw.memory_bytes > 0
    with pytest.raises(ValueError, match="neither a preset .*a100-80gb"):
        load_hardware("tpu-v9")
    with pytest.raises(ValueError, match="unknown hardware field"):
        load_hardware({"name": "x", "peak_tflops": 1, "memory_bandwidth_gb_s": 1, "memory_gib": 1, "tflops": 2})
    with pytest.raises(ValueError, match="peak_tflops must be a finite number > 0"):
        load_hardware({"name": "x", "peak_tflops": 0, "memory_bandwidth_gb_s": 1, "memory_gib": 1})


#: Dense peak TFLOP/s per dtype from the datasheets (float32: the CUDA cores' FP32, as PyTorch runs
#: float32 GEMMs without TF32 by default); the cpu preset's from its own comment.
DATASHEET_TFLOPS = {
    "a100-80gb": {"bfloat16": 312, "float16": 312, "float32": 19.5},
    "h100-sxm": {"bfloat16": 989, "float16": 989, "float32": 67},
    "h200": {"bfloat16": 989, "float16": 989, "float32": 67},
    "l40s": {"bfloat16": 362, "float16": 362, "float32": 91.6},
    "cpu": {"float32": 0.3, "bfloat16": 0.6},
}


def test_every_preset_gives_the_datasheet_peak_of_each_dtype():
    assert sorted(DATASHEET_TFLOPS) == hardware_presets()
    for name, peaks in DATASHEET_TFLOPS.items():
        hw = load_hardware(name)
        assert {dtype: hw.peak_flops(dtype) for dtype in peaks} == {d: t * 1e12 for d, t in peaks.items()}
        assert hw.peak_flops(hw.dtype) > 0 and hw.flops == hw.peak_flops(hw.dtype)  # dtype=auto has a peak on every preset


def test_a_single_peak_applies_to_every_dtype(tmp_path):
    # A hardware description from before the peaks were per dtype: one figure, whatever the dtype.
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\npeak_tflops: 100\nmemory_bandwidth_gb_s: 1000\nmemory_gib: 40\n")
    for spec in (str(path), {"name": "mine", "peak_tflops": 100, "memory_bandwidth_gb_s": 1000, "memory_gib": 40}):
        hw = load_hardware(spec)
        assert [hw.peak_flops(d) for d in ("bfloat16", "float16", "float32", "fp32")] == [100e12] * 4
    engine = sim_engine(model="tiny-llama", dtype="float32", executor_options={"hardware": str(path)})
    assert engine.executor.cost_model.dtype == "float32"


def test_peaks_are_keyed_by_canonical_dtype_names():
    hw = load_hardware({**load_hardware("a100-80gb").to_dict(), "peak_tflops": {"bf16": 300, "fp32": 20}})
    assert hw.peak_tflops == {"bfloat16": 300, "float32": 20} and hw.peak_flops("bf16") == 300e12
    assert hw.to_dict()["peak_tflops"] == {"bfloat16": 300, "float32": 20}


@pytest.mark.parametrize("peaks, message", [
    ({}, "peak_tflops must be a number or a mapping of dtypes .* got an empty mapping"),
    ({"fp8": 600}, r"peak_tflops has a peak for 'fp8', which is no dtype; dtypes: \['bf16', "),
    # Named as given, whichever comes first ('bfloat16' was called the alias of itself).
    ({"bf16": 300, "bfloat16": 300}, r"peak_tflops gives bfloat16 twice, as 'bf16' and 'bfloat16'; give it once$"),
    ({"bfloat16": 300, "bf16": 300}, r"peak_tflops gives bfloat16 twice, as 'bfloat16' and 'bf16'; give it once$"),
    ({"float32": math.nan}, r"peak_tflops\[float32\] must be a finite number > 0, got nan"),
    ({"float32": "19.5"}, r"peak_tflops\[float32\] must be a finite number > 0, got '19.5'"),
    ({"float32": 0}, r"peak_tflops\[float32\] must be a finite number > 0, got 0")])
def test_bad_peak_mappings_are_one_line_errors(peaks, message):
    with pytest.raises(ValueError, match=f"hardware 'a100-80gb': {message}"):
        load_hardware({**load_hardware("a100-80gb").to_dict(), "peak_tflops": peaks})


@pytest.mark.parametrize("field", ["launch_overhead_us", "pcie_gb_s", "interconnect_gb_s", "runtime_reserved_gib"])
def test_a_negative_hardware_figure_is_refused(field):
    with pytest.raises(ValueError, match=f"hardware 'a100-80gb': {field} must be a finite number >= 0, got -1"):
        load_hardware({**load_hardware("a100-80gb").to_dict(), field: -1})


@pytest.mark.parametrize("peaks", [[312, 19.5], None, True])
def test_a_peak_neither_number_nor_mapping_is_told_both_forms(peaks):
    # A list (or null) was answered "must be a finite number > 0", as if one number were the only form.
    with pytest.raises(ValueError, match=r"^hardware 'a100-80gb': peak_tflops must be a finite number > 0 \(every "
                                         r"dtype's peak\) or a mapping of dtypes \(float32, float16, bfloat16\) to "
                                         rf"TFLOP/s, got {re.escape(repr(peaks))}$"):
        load_hardware({**load_hardware("a100-80gb").to_dict(), "peak_tflops": peaks})


def test_a_dtype_the_hardware_lists_no_peak_for_is_refused():
    # The cpu preset has no FP16 arithmetic: a float16 simulation is refused, not given bf16's peak.
    with pytest.raises(ValueError, match=r"^hardware 'cpu' gives no peak_tflops for float16; it lists float32, "
                                         r"bfloat16 \(add a float16 figure to its description\)$"):
        sim_engine(model="tiny-llama", dtype="float16", executor_options={"hardware": "cpu"})


@pytest.mark.parametrize("bad", [None, 5, ["a100-80gb"]])
def test_hardware_that_names_nothing_is_a_one_line_error(bad):
    # executor.hardware=null (or a number, or a list) failed with a TypeError from pathlib.
    with pytest.raises(ValueError, match=r"hardware must be a preset \(a100-80gb, .*\), the path of a YAML file"):
        sim_engine(executor_options={"hardware": bad})


@pytest.mark.parametrize("field, value, message", [
    ("launch_overhead_us", math.nan, "launch_overhead_us must be a finite number >= 0, got nan"),
    ("runtime_reserved_gib", math.nan, "runtime_reserved_gib must be a finite number >= 0"),
    ("memory_gib", math.inf, "memory_gib must be a finite number > 0, got inf"),
    ("peak_tflops", "abc", r"peak_tflops must be a finite number > 0 \(every dtype's peak\) or a mapping of dtypes "
                           r"\(float32, float16, bfloat16\) to TFLOP/s, got 'abc'"),
    ("pcie_gb_s", "25", "pcie_gb_s must be a finite number >= 0")])
def test_hardware_figures_must_be_finite_numbers(field, value, message):
    # A NaN launch overhead made every simulated step time NaN (a "completed" run with no latencies);
    # a NaN or infinite memory figure failed with "cannot convert float NaN to integer", a string with a TypeError.
    spec = {**load_hardware("a100-80gb").to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        load_hardware(spec)


@pytest.mark.parametrize("text, message", [
    ("", "hardware file .*empty.yaml.*: a hardware description is a mapping of its fields"),
    ("- a100\n", "hardware file .*empty.yaml.*: a hardware description is a mapping of its fields"),
    ("name: mine\npeak_tflops: [1\n", "hardware file .*empty.yaml.* is not valid YAML"),
    ("name: mine\npeak_tflops: 100\n", "hardware 'mine' lacks memory_bandwidth_gb_s, memory_gib")])
def test_malformed_hardware_files_are_reported(tmp_path, text, message):
    # An empty file or one lacking a datasheet figure failed with a TypeError, broken YAML with
    # the parser's traceback; a list of names was reported as an unknown field.
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_hardware(str(path))
    with pytest.raises(ValueError, match=message.replace("hardware file .*empty.yaml.*: ", "")):
        sim_engine(executor_options={"hardware": str(path)})


def test_a_simulated_engine_never_loads_torch_even_with_num_threads():
    # num_threads is the forward pass's setting: it used to import torch in the engine itself.
    code = ("import sys; from framework import LLM; "
            "LLM(model='tiny-llama', executor='sim', num_threads=1, executor_options={'hardware': 'cpu'}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


class SlowerRoofline(RooflineCostModel):
    """The roofline, 20% slower: a subclass overriding step_time alone."""

    def step_time(self, batch):
        return 1.2 * super().step_time(batch)


def test_decode_runs_of_a_cost_model_overriding_step_time_alone_take_its_times(monkeypatch):
    """The fast path timed decode runs with the base's decode_step_time, skipping the override:
    the fast-forwarded run ended earlier than stepping one by one."""
    forget_registrations(monkeypatch, COST_MODELS)
    COST_MODELS.register("test_slower_roofline")(SlowerRoofline)
    requests = chat_requests(20, rate=4.0, seed=1)
    results = []
    for fast in (True, False):
        config = EngineConfig(model="llama-3-8b", executor="sim",
                              executor_options={"fast_forward": fast, "cost_model": {"name": "test_slower_roofline"}})
        cluster = Cluster.build(config)
        counter = RunCounter()
        cluster.engines[0].step_callbacks.append(counter)
        results.append(sorted((o.request_id, o.metrics.token_times) for _, o in cluster.run(requests).outputs))
        if fast:
            assert counter.steps > 0  # still fast-forwarded
    assert results[0] == results[1]


def test_a_cost_model_without_a_dtype_keyword_still_loads_and_is_told_the_dtype():
    """A cost model plugin written before dtypes were passed (its constructor has no ``dtype``)
    is built without one and then told the run's dtype; one that takes it gets it."""
    from framework.sim.cost_model import COST_MODELS, BatchShape, CostModel

    class OldStyle(CostModel):
        name = "old_style_for_test"

        def __init__(self, model, hardware, dtype_bytes=2, tensor_parallel_size=1, block_size=16) -> None:
            super().__init__(model, hardware, dtype_bytes, tensor_parallel_size, block_size)

        def step_time(self, shape: BatchShape) -> float:
            return 1e-3

    COST_MODELS.register("old_style_for_test")(OldStyle)
    try:
        engine = LLMEngine(EngineConfig(model="llama-3-8b", executor="sim", dtype="float16",
                                        executor_options={"cost_model": "old_style_for_test"}))
        assert isinstance(engine.executor.cost_model, OldStyle)
        assert engine.executor.cost_model.dtype == "float16"
        roofline = LLMEngine(EngineConfig(model="llama-3-8b", executor="sim", dtype="float16"))
        assert roofline.executor.cost_model.dtype == "float16"
    finally:
        COST_MODELS._classes.pop("old_style_for_test", None)


def test_a_simulated_run_composed_by_hydra_checks_and_builds_without_torch():
    # The default backend's config file gives every composed run backend options: checking their names would
    # import torch (about 2 s) into every simulated run and every sweep's pre-check.
    code = ("import sys; from tests.hydra_support import compose_config; "
            "from framework.harness.experiment import check_experiment; from framework.run import engine_config; "
            "from framework import LLMEngine; cfg = compose_config('executor=sim', 'workload.num_requests=2'); "
            "check_experiment(cfg); LLMEngine(engine_config(cfg)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.parametrize("stops, token", [(None, 1023), ([7], 1023), ([1023, 0, 1], 3)])
def test_a_simulated_request_samples_the_highest_id_unless_it_stops_it(stops, token):
    # tiny-llama: 1,024 ids, EOS 2. A request whose stop tokens hold that id takes the lowest id neither stops it
    # nor is an EOS, so it runs to its length as the fast path assumes.
    llm = LLM(model="tiny-llama", executor="sim", executor_options={"fast_forward": False})
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, stop_token_ids=stops))
    assert out.outputs[0].token_ids == [token] * 4 and out.outputs[0].finish_reason == "length"
