"""``python -m framework.profile`` on the quick grid: it measures the real executor, fits, and
writes a calibration the simulated executor loads."""
import yaml

from framework import LLM, SamplingParams
from framework.cost_models.roofline import PARAMS
from framework.profile import grid_cells, main


def test_profile_writes_a_calibration_the_sim_loads(tmp_path):
    out = tmp_path / "cal.yaml"
    result = main(["--grid", "quick", "--repeats", "1", "--out", str(out), "--threads", "1"])
    data = yaml.safe_load(out.read_text())
    assert data["params"] == result["params"] and set(data["params"]) == set(PARAMS)
    shapes = {tuple(row[:-1]) for row in data["samples"]["rows"]}
    assert len(shapes) == len(data["samples"]["rows"]) >= 3 * len(grid_cells("quick"))  # prefill + 2 decodes each
    assert all(row[-1] > 0 for row in data["samples"]["rows"])
    assert data["fit"]["samples"] == len(shapes) and data["hardware"]["name"] == "cpu"
    llm = LLM(model="tiny-llama", executor="sim", max_model_len=256,
              executor_options={"hardware": "cpu", "cost_model": {"name": "roofline", "calibration": str(out)}})
    assert llm.engine.executor.cost_model.params == data["params"]
    assert len(llm.generate({"prompt_token_ids": [5] * 50}, SamplingParams(max_tokens=5))[0].outputs[0].token_ids) == 5
