"""``python -m framework.profile`` on the quick grid: it measures the real executor, fits, and
writes a calibration the simulated executor loads."""
import re
import sys
from types import SimpleNamespace

import pytest
import yaml

from framework import LLM, SamplingParams
from framework.common.config import EngineConfig
from framework.sim.cost_model import BatchShape, model_shape
from framework.sim.cost_models.roofline import CURVE, PARAMS
from framework.sim.profile import Profiler, grid_cells, main, measure, profile_engine_config
from framework.engine.output_processor import OutputProcessor
from models.config import ModelConfig
from models.presets import PRESETS


def test_profile_writes_a_calibration_the_sim_loads(tmp_path):
    out = tmp_path / "cal.yaml"
    result = main(["--grid", "quick", "--repeats", "1", "--out", str(out), "--threads", "1", "--statistic", "min"])
    data = yaml.safe_load(out.read_text())
    assert data["measured"]["statistic"] == "min" and data["measured"]["repeats"] == 1
    assert data["measured"]["backend"] == EngineConfig().backend  # what a default real run uses
    assert data["params"] == result["params"] and set(data["params"]) == set(PARAMS) | {CURVE}
    shapes = {tuple(row[:-1]) for row in data["samples"]["rows"]}
    assert len(shapes) == len(data["samples"]["rows"]) >= 3 * len(grid_cells("quick"))  # prefill + 2 decodes each
    assert all(row[-1] > 0 for row in data["samples"]["rows"])
    assert data["fit"]["samples"] == len(shapes) and data["hardware"]["name"] == "cpu"
    assert (data["dtype"], data["dtype_bytes"]) == ("float32", 4)  # the peak the efficiencies are fractions of
    assert data["model"] == "tiny-llama" and data["model_shape"] == model_shape(ModelConfig.from_hf(PRESETS["tiny-llama"]))
    llm = LLM(model="tiny-llama", executor="sim", max_model_len=256,
              executor_options={"hardware": "cpu", "cost_model": {"name": "roofline", "calibration": str(out)}})
    cost = llm.engine.executor.cost_model
    assert {**cost.params, CURVE: cost.extra_weight_passes} == data["params"]
    assert len(llm.generate({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=5))[0].outputs[0].token_ids) == 5


def test_profiled_steps_build_outputs_only_for_finished_requests(monkeypatch):
    """A profiled step costs what an experiment's step costs: no output for a running request."""
    from framework.engine.llm_engine import LLMEngine

    engine = LLMEngine(profile_engine_config([(3, 8, 4)]))
    built = []
    real = OutputProcessor._output
    monkeypatch.setattr(OutputProcessor, "_output", lambda self, rid, children: built.append(rid) or real(self, rid, children))
    Profiler(engine).run_cell(3, 8, 4)
    assert sorted(built) == [f"profile-1-{i}" for i in range(3)]  # one each, when it finished


def test_repeats_reduce_to_the_chosen_statistic():
    profiler = Profiler(SimpleNamespace(executor=SimpleNamespace(execute=lambda out: None)))
    decode, prefill = BatchShape(), BatchShape()
    decode.add_row(40, 1, True)
    prefill.add_row(0, 40, True)
    profiler.seconds[tuple(decode.to_list())] = [3.0, 1.0, 2.0, 10.0]
    profiler.seconds[tuple(prefill.to_list())] = [5.0]
    assert dict((s.num_tokens, t) for s, t in profiler.samples()) == {1: 2.5, 40: 5.0}
    assert dict((s.num_tokens, t) for s, t in profiler.samples("min")) == {1: 1.0, 40: 5.0}
    with pytest.raises(ValueError, match="unknown statistic 'mean'; statistics: median, min"):
        profiler.samples("mean")
    with pytest.raises(ValueError, match="unknown statistic 'p10'"):
        measure(SimpleNamespace(executor=SimpleNamespace(execute=lambda out: None)), [], 1, statistic="p10")


@pytest.mark.parametrize("args, message", [
    (["--backend", "bogus"], "unknown backend 'bogus'; registered backends: .*torch_paged"),
    (["--cost-model", "bogus"], "unknown cost model 'bogus'; registered cost models: .*roofline"),
    (["--model", "bogus"], "model 'bogus' is neither a preset"),
    (["--hardware", "bogus"], "hardware 'bogus' is neither a preset"),
    (["--counts", "-1"], "request counts must be >= 1"),
    (["--lengths", ",,"], "--lengths: expected comma-separated integers, e.g. 1,2,4; got ',,'"),  # was: the defaults
    (["--counts", "2,x"], "--counts: expected comma-separated integers"),
    (["--block-size", "3"], "block_size must be a power of two"),
    # Used to fail with "max() arg is an empty sequence".
    (["--counts", "1000", "--lengths", "16"], "no cell of grid 'default' fits its budget of 4096 prompt tokens"),
    # Used to measure the whole grid first, then fail with a NotImplementedError traceback.
    (["--cost-model", "replay", "--grid", "quick", "--repeats", "1"],
     "cost model 'replay' has no parameters to calibrate; calibratable: roofline"),
    # A CPU measured and labelled an H100: it loaded into an H100 simulation without a warning.
    (["--hardware", "h100-sxm", "--device", "cpu", "--grid", "quick", "--repeats", "1"],
     "measuring on cpu, but hardware 'h100-sxm' describes a cuda device: name the device measured"),
    # The cpu preset lists no float16 peak: the fit would have failed after the whole grid.
    (["--dtype", "float16", "--grid", "quick", "--repeats", "1"],
     "hardware 'cpu' gives no peak_tflops for float16; it lists float32, bfloat16"),
])
def test_bad_arguments_are_usage_errors_before_anything_is_measured(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path / "c.yaml")])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "c.yaml").exists()


def test_an_out_path_that_cannot_be_written_is_a_usage_error_before_anything_is_measured(tmp_path, capsys,
                                                                                         monkeypatch):
    """Checked before measuring: a failure to write afterwards would lose the measurement."""
    monkeypatch.setattr("framework.sim.profile.measure", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "afile").write_text("mine\n")
    for out, message in ((tmp_path, f"--out {tmp_path} is a folder; give a file path"),
                         (tmp_path / "afile" / "c.yaml", f"--out {tmp_path / 'afile' / 'c.yaml'}: "
                                                         f"{tmp_path / 'afile'} is a file, not a folder")):
        with pytest.raises(SystemExit) as exc:
            main(["--grid", "quick", "--repeats", "1", "--out", str(out)])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_grid_too_small_to_fit_is_a_usage_error(tmp_path, capsys):
    # One cell of the quick grid is three step shapes, fewer than the roofline's seven parameters:
    # this measured, then ended in a ValueError traceback from the fit.
    with pytest.raises(SystemExit) as exc:
        main(["--grid", "quick", "--counts", "1", "--lengths", "16", "--repeats", "1", "--threads", "1",
              "--out", str(tmp_path / "c.yaml")])
    assert exc.value.code == 2
    assert re.search(r"calibration needs at least 7 measured steps, got 3 \(the grid measured 3 distinct step "
                     r"shapes; add --lengths or --counts\)", capsys.readouterr().err)
    assert not (tmp_path / "c.yaml").exists()


def test_a_broken_cost_model_plugin_does_not_hide_why_the_asked_one_cannot_be_calibrated(tmp_path, monkeypatch,
                                                                                        capsys):
    """Listing the calibratable cost models left out a plugin that failed to import, but one naming
    no CostModel class raised the registry's ValueError, whose message replaced
    "'replay' has no parameters to calibrate" although the user never asked for that plugin."""
    from framework import COST_MODELS

    (tmp_path / "odd_cost.py").write_text("def make():\n    return None\n")  # a function, not a class
    info = tmp_path / "odd_cost-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: odd-cost\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[framework.sim.cost_models]\nnotaclass = odd_cost:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "odd_cost", raising=False)
    monkeypatch.setattr(COST_MODELS, "_entry_points", None)  # read again, with the package; restored after
    with pytest.raises(SystemExit) as exc:
        main(["--cost-model", "replay", "--out", str(tmp_path / "c.yaml")])
    assert exc.value.code == 2
    assert "error: cost model 'replay' has no parameters to calibrate; calibratable: roofline\n" in capsys.readouterr().err


def test_profiles_time_synchronous_steps_only():
    """An engine with async scheduling (the default on CUDA) launches steps instead of executing them, each
    overlapping the next one's host side: the profiling engine is synchronous, and an async one is refused."""
    from framework.engine.llm_engine import LLMEngine

    assert profile_engine_config([(3, 8, 4)]).async_scheduling is False
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=64, async_scheduling=True))
    with pytest.raises(ValueError, match=r"^profile an engine with async_scheduling=false"):
        Profiler(engine)


def test_an_unimportable_cost_model_plugin_is_left_out_of_the_calibratable_ones(tmp_path, monkeypatch):
    """Its one-line refusal (an UnavailableError) is no answer to a question about another cost model."""
    from framework.sim.cost_model import COST_MODELS
    from framework.sim.profile import calibratable_cost_models

    info = tmp_path / "gone_cost_model-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gone-cost-model\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[framework.cost_models]\ngone = no_such_cost_model_pkg:Gone\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(COST_MODELS, "_entry_points", None)  # read the installed plugins again
    assert "gone" in COST_MODELS.list()
    assert calibratable_cost_models() == ["roofline"]
