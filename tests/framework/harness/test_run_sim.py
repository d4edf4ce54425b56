"""Simulated runs through the experiments' run path: ``executor=sim`` with a device, a cost
model and a cluster selects the simulator from Hydra, runs on simulated time and writes the same
files as a real run, which ``framework.compare`` tables together with real runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.harness.compare import comparison_rows, write_comparison
from framework.engine.llm_engine import LLMEngine
from framework.execution.executor import EXECUTORS
from framework.sim.executor import SimExecutor
from framework.harness.experiment import engine_config, run_experiment
from framework.testing.registries import forget_registrations
from tests.framework.sim.support import RunCounter
from tests.hydra_support import compose_config, read_csv

ROOT = Path(__file__).resolve().parents[3]
FILES = {"config.yaml", "workload.jsonl", "summary.json", "requests.csv", "steps.csv", "latency_cdf.png", "timeline.png"}
SMALL = ["progress=false", "workload.num_requests=24", "workload.rate=2", "workload.prompt_len=[64,512]",
         "workload.output_len=[16,128]"]


def compose_with(overrides):
    return compose_config(*overrides)


def test_executor_hardware_and_cost_model_reach_the_engine():
    cfg = compose_with(["executor=sim", "+hardware=h100-sxm", "model.name=llama-3-70b",
                        "executor.tensor_parallel_size=4", "+cost_model.matmul_efficiency=0.5",
                        "+cluster=prefix_aware", "cluster.num_replicas=8"])
    config = engine_config(cfg)
    assert config.executor == "sim" and config.executor_options["tensor_parallel_size"] == 4
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)  # sim.yaml's serving limits
    engine = LLMEngine(config)
    assert engine.executor.hardware.name == "h100-sxm" and engine.executor.tp == 4
    assert engine.executor.cost_model.params["matmul_efficiency"] == 0.5
    assert cfg.cluster.num_replicas == 8 and cfg.cluster.router == "prefix_aware"


class CountingSim(SimExecutor):
    """A researcher's own simulator: the sim executor, registered under another name."""


def test_a_registered_subclass_of_the_sim_executor_takes_the_device_and_cost_model(monkeypatch):
    """Whether the hardware and cost_model groups apply is asked of the executor's clock, not its
    name: a subclass of the sim executor was refused them ("for simulated runs only"), even
    without +hardware, since conf/executor/sim.yaml sets the cost_model node."""
    forget_registrations(monkeypatch, EXECUTORS)
    EXECUTORS.register("test_counting_sim")(CountingSim)
    config = engine_config(compose_with(["executor=sim", "executor.name=test_counting_sim", "+hardware=h100-sxm",
                                         "+cost_model.matmul_efficiency=0.5"]))
    engine = LLMEngine(config)
    assert type(engine.executor) is CountingSim and engine.executor.hardware.name == "h100-sxm"
    assert engine.executor.cost_model.params["matmul_efficiency"] == 0.5


def test_a_simulated_run_writes_every_file_on_simulated_time(tmp_path):
    counter = RunCounter()
    summary = run_experiment(compose_with(["executor=sim", "+hardware=h100-sxm", "model.name=llama-3-70b",
                                           "executor.tensor_parallel_size=4", "progress=true", *SMALL[1:]]),
                             tmp_path, on_engine=lambda e: e.step_callbacks.append(counter))
    assert FILES <= {p.name for p in tmp_path.iterdir()}
    assert summary["status"] == "completed" and summary["completed"] == 24
    assert (summary["executor"], summary["hardware"], summary["tensor_parallel_size"]) == ("sim", "h100-sxm", 4)
    # The recorder and the progress bar kept the fast path on: most steps came in decode runs.
    assert counter.steps > summary["num_steps"] / 2
    # Requests entered at their arrival times (simulated time starts at 0: no warm-up), and the
    # run's duration is simulated time: 24 requests at 2 req/s last about 12 s, simulated in far less.
    sent = {json.loads(line)["request_id"]: json.loads(line)["arrival_time"]
            for line in (tmp_path / "workload.jsonl").read_text().splitlines()}
    rows = read_csv(tmp_path / "requests.csv")
    assert {r["request_id"]: float(r["arrival_s"]) for r in rows} == pytest.approx(sent, abs=1e-6)
    last_finish = max(float(r["arrival_s"]) + float(r["e2el_ms"]) / 1000 for r in rows)
    assert summary["duration_s"] == pytest.approx(last_finish, abs=1e-6)
    assert summary["duration_s"] > 8 and summary["wall_time_s"] < summary["duration_s"]
    steps = read_csv(tmp_path / "steps.csv")
    assert len(steps) == summary["num_steps"] and "replica" not in steps[0]
    assert sum(float(s["duration"]) for s in steps) <= summary["duration_s"]  # idle gaps between arrivals


def test_a_cluster_run_writes_the_replica_columns(tmp_path):
    summary = run_experiment(compose_with(["executor=sim", "model.name=llama-3-8b", "+cluster=least_outstanding",
                                           "cluster.num_replicas=3", *SMALL]), tmp_path)
    assert (summary["num_replicas"], summary["router"], summary["completed"]) == (3, "least_outstanding", 24)
    rows = read_csv(tmp_path / "requests.csv")
    assert list(rows[0])[:2] == ["request_id", "replica"] and {r["replica"] for r in rows} == {"0", "1", "2"}
    steps = read_csv(tmp_path / "steps.csv")
    assert list(steps[0])[0] == "replica" and {s["replica"] for s in steps} == {"0", "1", "2"}
    assert len(steps) == summary["num_steps"]
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_interrupting_a_cluster_run_keeps_its_rows_and_frees_every_replica(tmp_path):
    engines, counter = [], RunCounter()

    class StopAfter300Steps:  # takes decode runs too, so the replicas keep fast-forwarding
        def __call__(self, stats, out):
            self.on_decode_run(None)

        def on_decode_run(self, run):
            counter.steps += 1 if run is None else len(run.end_times)
            if counter.steps > 300:
                raise KeyboardInterrupt

    def attach(engine):
        engines.append(engine)
        engine.step_callbacks.append(StopAfter300Steps())

    summary = run_experiment(compose_with(["executor=sim", "model.name=llama-3-8b", "+cluster=round_robin", *SMALL]),
                             tmp_path, on_engine=attach)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "interrupted" and summary["interrupted"]
    rows = read_csv(tmp_path / "requests.csv")
    assert 0 < len(rows) == saved["completed"] < 24 and saved["num_unfinished"] > 0
    assert len(read_csv(tmp_path / "steps.csv")) == saved["num_steps"] > 0
    for engine in engines:  # aborted, every block back
        assert not engine.has_unfinished_requests()
        assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks


def test_real_and_simulated_runs_compare_in_one_table(tmp_path):
    common = ["progress=false", "workload.num_requests=6", "workload.prompt_len=[8,24]", "workload.output_len=[2,5]"]
    run_experiment(compose_with(["engine.max_model_len=128", "engine.num_gpu_blocks_override=64", *common]),
                   tmp_path / "real")
    run_experiment(compose_with(["executor=sim", "+hardware=cpu", *common]), tmp_path / "sim")
    rows = comparison_rows([tmp_path])
    assert len(rows) == 2 and all(r["status"] == "completed" and r["completed"] == 6 for r in rows)
    labels = {r["run_dir"].rsplit("/", 1)[1]: r["label"] for r in rows}
    assert "executor=model" in labels["real"] and "executor=sim" in labels["sim"]
    paths = write_comparison([tmp_path], tmp_path / "cmp")
    table = paths["markdown"].read_text()
    assert "executor=model" in table and "executor=sim" in table
    assert paths["throughput"].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("overrides, message", [
    (["+cluster=round_robin"], "several replicas share one machine only in simulated time: use executor=sim"),
    (["executor=sim", "+cluster=prefix_aware", "+cluster.router_options.tries=3"], "router 'prefix_aware'.*tries"),
    (["executor=sim", "+cluster=round_robin", "cluster.num_replicas=0"], "num_replicas must be a positive integer"),
    # A number failed with a TypeError traceback ('int' object is not iterable), a string as "dictionary
    # update sequence element #0 has length 1", and false or 0 were taken as no options.
    (["executor=sim", "+cluster=prefix_aware", "cluster.router_options=5"],
     "cluster.router_options must be a mapping of option names to values, got 5"),
    (["executor=sim", "+cluster=prefix_aware", "cluster.router_options=abc"],
     "cluster.router_options must be a mapping of option names to values, got 'abc'"),
    (["executor=sim", "clock=wall"], "executor=sim runs on simulated time"),
])
def test_cluster_and_clock_errors_are_configuration_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        run_experiment(compose_with(overrides), tmp_path)
    assert not (tmp_path / "summary.json").exists()


def test_a_cluster_node_that_is_no_node_is_a_configuration_error(tmp_path):
    """An experiment file's ``cluster: 4`` (meaning four replicas) failed as "Input cfg is not an
    OmegaConf config object (int)", naming no option."""
    from omegaconf import OmegaConf

    cfg = compose_with(["executor=sim"])
    OmegaConf.set_struct(cfg, False)
    cfg.cluster = 4
    with pytest.raises(ValueError, match=r"cluster must be a node of num_replicas, router and router_options .*got 4"):
        run_experiment(cfg, tmp_path)


@pytest.mark.parametrize("select", ["executor=sim", "+executor=sim"])  # the second: as written before it had a default
def test_the_cli_runs_a_simulated_cluster(tmp_path, select):
    done = subprocess.run([sys.executable, "-m", "framework.run", select, "+hardware=h100-sxm",
                           "model.name=llama-3-70b", "executor.tensor_parallel_size=4", "+cluster=prefix_aware",
                           "cluster.num_replicas=2", "plots=false", *SMALL, f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Successful requests:" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_replicas"] == 2 and summary["completed"] == 24
    assert {"requests.csv", "steps.csv", "workload.jsonl", "config.yaml"} <= {p.name for p in tmp_path.iterdir()}


def test_the_console_script_finds_conf_from_any_folder(tmp_path):
    # servelab-run calls framework.run.cli from an installed module, not as __main__.
    done = subprocess.run([sys.executable, "-c", "from framework.run import cli; cli()", "executor=sim",
                           "model.name=llama-3-8b", "plots=false", *SMALL, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def test_a_fast_forwarded_cluster_run_writes_the_summary_of_stepping(tmp_path):
    """Replicas delivered a decode run's outputs when it was applied, so the records came in another
    order than stepping gives: the latency means and deviations, summed in that order, differed in
    their last digits (summary.json of a fast-forwarded cluster run was not the stepped run's).
    Runs are now applied as stepping takes their last step, and the records come in its order."""
    summaries = []
    for fast in ("true", "false"):
        summary = run_experiment(compose_with(["executor=sim", "model.name=llama-3-8b", "workload=chat",
                                               "workload.num_requests=300", "workload.rate=20", "+cluster=least_outstanding",
                                               "cluster.num_replicas=3", "+policy=chunked", "plots=false",
                                               "save_workload=false", "progress=false",
                                               f"executor.fast_forward={fast}"]), tmp_path / fast)
        summaries.append({k: v for k, v in summary.items() if k not in ("wall_time_s", "run_dir")})
    assert summaries[0] == summaries[1]
    rows = [read_csv(tmp_path / fast / "requests.csv") for fast in ("true", "false")]
    assert rows[0] == rows[1]  # outputs come out in stepping's order, so the records too
