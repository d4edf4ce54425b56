"""Every YAML file under conf/ composes, and every group option builds a working engine on CPU."""
import itertools
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from framework.common.config import EngineConfig
from framework.engine.llm_engine import LLMEngine, check_token_budget, resolve_max_model_len, resolve_token_budget
from framework.harness.experiment import ENGINE_KEYS, ROOT_KEYS, build_cluster, check_workload, engine_config
from framework.run import engine_config as cli_engine_config
from framework.harness.run_logger import LOGGERS, create_logger
from framework.harness.workload import WorkloadContext, create_workload
from models.loader import resolve_model
from tests.hydra_support import CONF, compose_config

#: Groups not in the defaults list are added with '+'.
OPTIONAL_GROUPS = {"policy", "experiment", "hardware", "cluster"}
#: Options that need hardware CI does not have; they must fail with a clear message instead.
NEEDS_CUDA = {("backend", "flash_attn")}
#: Options composed together with another group's (a device or a cluster needs the simulator).
NEEDS = {"hardware": ["executor=sim"], "cluster": ["executor=sim"]}


def group_options():
    for path in sorted(CONF.glob("*/*.yaml")):
        yield path.parent.name, path.stem


def overrides_for(group, option):
    prefix = "+" if group in OPTIONAL_GROUPS else ""
    return [*NEEDS.get(group, []), f"{prefix}{group}={option}"]


def compose_with(overrides, return_hydra_config=False):
    return compose_config(*overrides, return_hydra_config=return_hydra_config)


def test_root_config_composes():
    cfg = compose_with([])
    assert engine_config(cfg).policy == "fcfs"
    assert cli_engine_config is engine_config  # framework.run keeps exporting it
    assert cfg.logger.name == "none" and cfg.workload.rate is None


@pytest.mark.parametrize("path", sorted(str(p.relative_to(CONF)) for p in CONF.rglob("*.yaml")))
def test_every_yaml_file_composes(path):
    """Parametrised over the files themselves, so a file in a new folder is not missed."""
    parts = Path(path).with_suffix("").parts
    if len(parts) == 1:
        cfg = compose_with([])
        assert cfg.engine.block_size
    elif parts[0] == "hydra":
        cfg = compose_with(["/".join(parts[:-1]) + f"={parts[-1]}"], return_hydra_config=True)
        node = cfg.hydra
        for key in parts[1:-1]:
            node = node[key]
        assert node._target_
    else:
        cfg = compose_with(overrides_for("/".join(parts[:-1]), parts[-1]))
        engine_config(cfg)


def build_workload(cfg, config):
    workload, _ = create_workload(OmegaConf.to_container(cfg.workload, resolve=True))
    requests = workload.generate(WorkloadContext(vocab_size=1024, max_model_len=config.max_model_len))
    assert requests and all(r.prompt_len >= 1 for r in requests)
    return requests


@pytest.mark.parametrize("group, option", list(group_options()))
def test_every_group_option_composes_and_builds(group, option):
    cfg = compose_with(overrides_for(group, option))
    assert set(cfg) <= set(ROOT_KEYS), "a key at the root that check_run_options would refuse"
    config = engine_config(cfg)
    if group == "workload":
        build_workload(cfg, config)
        return
    if group == "logger":
        assert isinstance(create_logger(OmegaConf.to_container(cfg.logger)), LOGGERS.get(option))
        return
    if group == "cluster":
        cluster = build_cluster(cfg, config)
        assert len(cluster.engines) == cfg.cluster.num_replicas and cluster.router.name == cfg.cluster.router
        return
    if group == "experiment":
        build_workload(cfg, config)
        create_logger(OmegaConf.to_container(cfg.logger))
    if config.executor != "sim":  # real KV tensors: keep them small (the simulator sizes its own)
        config.max_model_len = min(config.max_model_len or 256, 256)
        config.num_gpu_blocks_override = config.num_gpu_blocks_override or 64
    if (group, option) in NEEDS_CUDA and not torch.cuda.is_available():
        with pytest.raises((RuntimeError, ImportError, ValueError), match="(?i)cuda|flash"):
            LLMEngine(config)
        return
    engine = LLMEngine(config)
    if group == "executor":
        assert engine.executor.name == option
    if group == "hardware":
        assert engine.executor.hardware.name == option and engine.allocator.num_usable_blocks > 0


def sweep_jobs():
    """(experiment, overrides) for every job an experiment's own sweep would launch."""
    for path in sorted(CONF.glob("experiment/*.yaml")):
        cfg = compose_with([f"+experiment={path.stem}"], return_hydra_config=True)
        params = cfg.hydra.sweeper.get("params") or {}
        axes = [[f"{key}={v.strip()}" for v in str(values).split(",")] for key, values in params.items()]
        for combo in itertools.product(*axes):
            yield path.stem, list(combo)


@pytest.mark.parametrize("experiment, overrides", list(sweep_jobs()))
def test_every_experiment_sweep_job_composes(experiment, overrides):
    for o in overrides:
        key, value = o.split("=", 1)
        if key in OPTIONAL_GROUPS and not (CONF / key / f"{value}.yaml").exists():
            pytest.skip(f"conf/{key}/{value}.yaml is not in this checkout (another branch adds it)")
    cfg = compose_with([f"+experiment={experiment}", *overrides])
    config = engine_config(cfg)
    check_workload(config, create_workload(OmegaConf.to_container(cfg.workload, resolve=True))[0])  # it can serve it
    for o in overrides:
        key, value = o.split("=", 1)
        got = config.policy if key == "policy" else cfg[key.split(".")[0]][key.split(".", 1)[1]] if "." in key else None
        assert str(got).lower() == value.lower(), (o, got)


@pytest.mark.parametrize("executor", [[], ["executor=sim"]])
def test_the_default_engine_can_run_any_prompt_its_max_model_len_allows(executor):
    """conf/ paired fcfs, the default policy, with a token budget of 512 under max_model_len 1024: a prompt of
    513 to 1024 tokens was dropped."""
    config = engine_config(compose_with(executor))
    max_model_len = resolve_max_model_len(config.max_model_len, resolve_model(config.model).config)
    check_token_budget(config.policy, resolve_token_budget(config, max_model_len), max_model_len)


@pytest.mark.parametrize("executor", [[], ["executor=sim"]])
def test_every_engine_key_the_run_reads_has_a_default_in_conf(executor):
    """A key the run takes from ``engine`` but conf/ leaves out can only be set with '+': Hydra
    refuses ``engine.gpu_memory_utilization=0.8``, though errors tell the user to change it."""
    cfg = compose_with(executor)
    assert set(cfg.engine) == ENGINE_KEYS
    assert cfg.engine.gpu_memory_utilization == EngineConfig.gpu_memory_utilization
    assert engine_config(compose_with([*executor, "engine.gpu_memory_utilization=0.5"])).gpu_memory_utilization == 0.5
