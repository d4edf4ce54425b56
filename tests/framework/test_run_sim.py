"""Selecting the simulator from Hydra: ``+executor=sim`` with a device, a cost model and a cluster."""
from pathlib import Path

from hydra import compose, initialize_config_dir

from framework.engine import LLMEngine
from framework.run import engine_config, run

CONF = Path(__file__).resolve().parents[2] / "conf"


def compose_with(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_executor_hardware_and_cost_model_reach_the_engine():
    cfg = compose_with(["+executor=sim", "+hardware=h100-sxm", "model.name=llama-3-70b",
                        "executor.tensor_parallel_size=4", "+cost_model.matmul_efficiency=0.5",
                        "+cluster=prefix_aware", "cluster.num_replicas=8"])
    config = engine_config(cfg)
    assert config.executor == "sim" and config.executor_options["tensor_parallel_size"] == 4
    engine = LLMEngine(config)
    assert engine.executor.hardware.name == "h100-sxm" and engine.executor.tp == 4
    assert engine.executor.cost_model.params["matmul_efficiency"] == 0.5
    assert cfg.cluster.num_replicas == 8 and cfg.cluster.router == "prefix_aware"


def test_run_simulates_the_default_workload_on_virtual_time():
    summary = run(compose_with(["+executor=sim", "model.name=qwen2-7b", "workload.num_requests=8"]))
    assert summary["requests"] == 8 and summary["mean_tpot_ms"] > 0
