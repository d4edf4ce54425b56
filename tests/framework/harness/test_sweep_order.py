"""A sweep over ``repeat`` (or ``workload.seed``) runs every configuration once before any runs again."""
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from framework.harness import overrides as overrides_module
from framework.harness.overrides import BASIC_SWEEPER, interleave_repeats, repeats_first, skip_composed_jobs_check
from tests.hydra_support import read_csv

ROOT = Path(__file__).resolve().parents[3]


def test_repeat_keys_go_first_the_others_keep_their_order():
    overrides = OverridesParser.create().parse_overrides(
        ["+policy=fcfs,chunked", "workload.seed=0,1", "workload.rate=2,4", "repeat=0,1,2"])
    assert [o.key_or_group for o in repeats_first(overrides)] == ["repeat", "workload.seed", "policy", "workload.rate"]


def test_the_basic_sweeper_varies_repeats_slowest_a_named_experiments_params_included():
    from hydra.core.plugins import Plugins

    interleave_repeats()
    interleave_repeats()  # idempotent: one reordering, not two wrapped in each other
    sweeper_class = Plugins.instance().class_name_to_class[BASIC_SWEEPER]
    # A named experiment's hydra.sweeper.params come before the command line's overrides.
    sweeper = sweeper_class(max_batch_size=None, params={"+policy": "fcfs,chunked", "workload.rate": "2,4"})
    overrides = OverridesParser.create().parse_overrides([*sweeper._parse_config(), "repeat=0,1"])
    [jobs] = sweeper_class.split_arguments(overrides, None)
    assert [tuple(j) for j in jobs] == [
        (f"repeat={r}", f"+policy={p}", f"workload.rate={x}") for r in (0, 1) for p in ("fcfs", "chunked") for x in (2, 4)]


def test_a_repeat_sweep_runs_interleaved_and_is_compared_by_configuration(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "framework.run", "-m", "executor=sim", "+policy=fcfs,chunked", "repeat=0,1",
         "workload.num_requests=4", "progress=false", "plots=false", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = [yaml.safe_load((sweep / str(i) / "config.yaml").read_text()) for i in range(4)]
    assert [(j["policy"]["name"], j["repeat"]) for j in jobs] == [("fcfs", 0), ("chunked", 0), ("fcfs", 1),
                                                                   ("chunked", 1)]
    # The repeat names no job (nor a W&B run) and labels no configuration.
    names = [yaml.safe_load((sweep / str(i) / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]["override_dirname"]
             for i in range(4)]
    assert names[0] == names[2] and "repeat" not in names[0]
    rows = read_csv(sweep / "comparison.csv")
    assert [(r["label"], r["n_repeats"]) for r in rows] == [("policy=chunked", "2"), ("policy=fcfs", "2")]
    assert len(read_csv(sweep / "runs.csv")) == 4
    # A simulated run is deterministic: the same seed twice gives the same run, counted once, which the comparison
    # says.
    assert rows[0]["output_throughput_ci95_low"] == rows[0]["output_throughput_ci95_high"] == ""
    assert "2 configuration(s) had repeats identical to another of the same seed" in (sweep / "comparison.md").read_text()
    assert json.loads((sweep / "0" / "summary.json").read_text())["step_time_noise_cv"] is None


def test_hydras_sweeper_does_not_compose_again_the_jobs_the_sweeps_check_composed(monkeypatch):
    # Composing a job takes about 0.1 s: twice over a 400-job sweep, 40 s before its first job.
    from types import SimpleNamespace

    from hydra.core.plugins import Plugins

    skip_composed_jobs_check()
    skip_composed_jobs_check()  # idempotent
    composed = []
    loader = SimpleNamespace(load_sweep_config=lambda master_config, sweep_overrides: composed.append(sweep_overrides))
    sweeper = Plugins.instance().class_name_to_class[BASIC_SWEEPER](max_batch_size=None, params=None)
    sweeper.hydra_context, sweeper.config = SimpleNamespace(config_loader=loader), SimpleNamespace()
    monkeypatch.setattr(overrides_module, "_composed", {("+policy=fcfs", "workload.rate=2")})
    sweeper.validate_batch_is_legal([["+policy=fcfs", "workload.rate=2"], ["+policy=fcfs", "workload.rate=4"]])
    assert composed == [["+policy=fcfs", "workload.rate=4"]]
