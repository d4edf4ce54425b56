"""One experiment run: build the engine and workload a composed config describes, send the
workload online, and record everything in the run directory (and the chosen logger).

``run_experiment(cfg, run_dir)`` is what ``python -m framework.run`` calls for each run of a
(multi)run; tests and notebooks call it directly with a config from Hydra's compose API.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.block_allocator import AllocatorStats
from framework.clock import Clock, VirtualClock, WallClock
from framework.config import EngineConfig
from framework.driver import drive
from framework.engine import LLMEngine, StepStats
from framework.metrics import REQUEST_COLUMNS, SLO, RequestRecord, step_row, summarize
from framework.outputs import RequestOutput
from framework.recorder import RunRecorder
from framework.report import format_summary
from framework.run_logger import Guarded, create_logger
from framework.sampling_params import SamplingParams
from framework.scheduler import SchedulerOutput
from framework.workload import WorkloadContext, create_workload

log = logging.getLogger(__name__)

#: Config groups that name a registered part, with the part used when the group is absent.
#: Pluggable parts and their defaults (EngineConfig's, so the CLI and the Python API agree).
PARTS = {part: EngineConfig.__dataclass_fields__[part].default
         for part in ("policy", "backend", "allocator", "preparer", "executor")}


def _split(group: Any, default_name: str) -> tuple[str, dict[str, Any]]:
    """A config group node is ``{name: ..., **options}``."""
    if group is None:
        return default_name, {}
    d = OmegaConf.to_container(group, resolve=True) if isinstance(group, DictConfig) else dict(group)
    name = d.pop("name", default_name)
    return name, d


def engine_config(cfg: DictConfig) -> EngineConfig:
    """The ``EngineConfig`` a composed Hydra config describes: the parts from their groups, the
    model from ``model``, everything else from ``engine``."""
    kwargs: dict[str, Any] = {}
    for part, default in PARTS.items():
        if part == "executor" and cfg.get(part) is None:
            continue  # no executor group: the engine's default (or engine.executor) applies
        name, options = _split(cfg.get(part), default)
        kwargs[part], kwargs[f"{part}_options"] = name, options
    if kwargs.get("executor") == "sim":  # the simulated device and cost model are groups of their own
        for key in ("hardware", "cost_model"):
            if cfg.get(key) is not None:
                kwargs["executor_options"][key] = OmegaConf.to_container(cfg[key], resolve=True)
    model, model_options = _split(cfg.get("model"), "tiny-llama")
    engine = OmegaConf.to_container(cfg.engine, resolve=True)
    engine["check_invariants"] = bool(OmegaConf.select(cfg, "scheduler.check_invariants", default=False))
    return EngineConfig(model=model, model_seed=model_options.get("seed", 0), **kwargs, **engine)


def make_clock(name: str, executor: str) -> Clock:
    """``wall`` for real execution, ``virtual`` for a simulated executor (which advances it);
    ``auto`` picks by executor."""
    if name == "auto":
        name = "wall" if executor == "model" else "virtual"
    if name == "wall":
        return WallClock()
    if name == "virtual":
        if executor == "model":
            raise ValueError("clock=virtual needs an executor that advances time (a simulator); the model "
                             "executor runs in wall time: use clock=wall or clock=auto")
        return VirtualClock()
    raise ValueError(f"clock must be auto, wall or virtual, got {name!r}")


def describe(cfg: DictConfig, config: EngineConfig) -> dict[str, Any]:
    """The run's identity for tables and plots: the parts, the model, the workload and its rate."""
    workload = cfg.get("workload") or {}
    return {"policy": config.policy, "backend": config.backend, "allocator": config.allocator,
            "preparer": config.preparer, "executor": config.executor, "model": config.model,
            "workload": workload.get("name"), "rate": workload.get("rate"),
            "preemption_mode": config.policy_options.get("preemption_mode"),
            "enable_prefix_caching": config.enable_prefix_caching}


def run_experiment(cfg: DictConfig, run_dir: str | Path, clock: Clock | None = None,
                   run_name: str | None = None, group: str | None = None,
                   on_engine: Callable[[LLMEngine], None] | None = None) -> dict[str, Any]:
    """Run the experiment ``cfg`` describes, writing its files to ``run_dir``; return the summary.

    Configuration errors raise ValueError before anything runs. A KeyboardInterrupt while
    requests run stops the run, keeps what was measured and returns a summary with
    ``status: interrupted``. ``run_name`` / ``group`` name the run and its sweep for loggers.
    ``clock`` overrides the config's ``clock``; ``on_engine`` sees the
    engine once it is built (to add step callbacks, e.g. one that advances a ``VirtualClock``).
    """
    config = engine_config(cfg)
    slo = SLO(**OmegaConf.to_container(cfg.slo, resolve=True)) if cfg.get("slo") else SLO()
    workload, sampling = create_workload(OmegaConf.to_container(cfg.workload, resolve=True))
    run_logger = Guarded(create_logger(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else {}))
    clock = clock or make_clock(cfg.get("clock", "auto"), config.executor)
    identity = describe(cfg, config)
    run_name = run_name or f"{config.policy}-{config.backend}"

    engine = LLMEngine(config, clock=clock)
    warm_up(engine, cfg.get("warmup", 1))
    hits0, queries0 = engine.allocator.stats.prefix_hit_tokens, engine.allocator.stats.prefix_query_tokens
    if on_engine is not None:
        on_engine(engine)
    requests = workload.generate(WorkloadContext(engine.model_config.vocab_size, engine.tokenizer,
                                                 engine.config.max_model_len))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    run_dir = Path(run_dir)
    recorder = RunRecorder(run_dir)
    recorder.write_config(resolved)
    recorder.write_workload(requests)
    meta = {**identity, "run_dir": str(run_dir), "num_requests": len(requests)}
    recorder.write_summary({"status": "running", "interrupted": False, **meta})
    run_logger.start({**resolved, "engine_config": config.to_dict()}, run_dir, run_name, group)

    records: list[RequestRecord] = []
    steps: list[dict[str, Any]] = []
    progress = _progress_bar(len(requests), run_name, cfg.get("progress", True))
    start = clock.now()

    def on_step(stats: StepStats, _: SchedulerOutput) -> None:
        row = step_row(stats, start)
        steps.append(row)
        recorder.add_step(row)
        run_logger.log_step(row)
        if progress is not None and stats.step % 8 == 0:
            progress.set_postfix(running=stats.num_running, waiting=stats.num_waiting, kv=f"{stats.kv_usage:.0%}",
                                 refresh=False)

    def on_output(out: RequestOutput) -> None:
        record = RequestRecord.from_output(out, start)
        records.append(record)
        recorder.add_request(record)
        if progress is not None:
            progress.update(1)

    engine.step_callbacks.append(on_step)
    wall_start = time.perf_counter()
    try:
        result = drive(engine, requests, sampling, on_output, start=start)
    except Exception as exc:
        recorder.write_summary({"status": "failed", "error": f"{type(exc).__name__}: {exc}", "interrupted": False, **meta})
        recorder.close()
        run_logger.finish(False)
        raise
    finally:
        engine.step_callbacks.remove(on_step)
        if progress is not None:
            progress.close()
    summary = {"status": "interrupted" if result.interrupted else "completed", "interrupted": result.interrupted,
               **meta, "num_sent": result.num_sent, "num_unfinished": len(result.unfinished),
               "wall_time_s": time.perf_counter() - wall_start,
               **summarize(records, result.end_time - result.start_time, slo, steps,
                           _hit_rate(engine.allocator.stats, hits0, queries0))}
    recorder.write_summary(summary)
    recorder.close()
    plots = _plots(records, steps, run_dir) if cfg.get("plots", True) else {}
    run_logger.log_summary(summary)
    run_logger.log_requests(REQUEST_COLUMNS, [r.row() for r in records])
    run_logger.log_plots(plots)
    run_logger.finish(result.interrupted)
    print(format_summary(summary, f"{run_name} ({identity['workload']}, rate={identity['rate']})"))
    return summary


def warm_up(engine: LLMEngine, num_requests: int) -> None:
    """Run a few short requests first, so one-time costs (first kernel calls, allocations)
    do not land on the measured requests; as ``vllm bench serve --num-warmups``."""
    vocab = engine.model_config.vocab_size
    for i in range(num_requests):
        prompt = [3 + (7 * i + j) % (vocab - 3) for j in range(32)]
        engine.add_request(f"warmup-{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _hit_rate(stats: AllocatorStats, hits0: int, queries0: int) -> float | None:
    """Prefix-cache hit rate (hit tokens / looked-up tokens) since the warm-up."""
    queries = stats.prefix_query_tokens - queries0
    return (stats.prefix_hit_tokens - hits0) / queries if queries else None


def _plots(records: list[RequestRecord], steps: list[dict[str, Any]], run_dir: Path) -> dict[str, Path]:
    from framework import plots

    out = {}
    if any(r.completed for r in records):
        out["latency_cdf"] = plots.latency_cdfs(records, run_dir / "latency_cdf.png")
    if steps:
        out["timeline"] = plots.timeline(steps, run_dir / "timeline.png")
    return out


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)
