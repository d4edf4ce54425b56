"""One experiment run: build what a composed config describes, serve the workload, record it.

``run_experiment(cfg, run_dir)`` is what ``python -m framework.run`` calls for each run; tests and
notebooks call it with a config from Hydra's compose API.
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.kv.block_allocator import AllocatorStats
from framework.common.clock import Clock, VirtualClock, WallClock
from framework.harness.cluster import Cluster, check_num_replicas, check_router_options, gc_paused
from framework.common.config import PART_NAMES, EngineConfig, check_bool, is_int
from framework.engine.llm_engine import (LLMEngine, StepStats, check_before_loading, check_token_budget,
                                         resolve_max_model_len, resolve_token_budget)
from framework.execution.executor import EXECUTORS, check_kv_capacity, simulates_time
from framework.sim.executor import SimExecutor
from framework.harness.metrics import SLO, RequestRecord, step_time_noise, summarize
from framework.common.outputs import RequestOutput
from framework.harness.interrupts import interrupts_held
from framework.harness.recorder import RunRecorder, claim_run_dir, clear_run_files
from framework.harness.report import format_summary
from framework.common.registry import split_spec
from framework.sim.router import ROUTERS, Router
from framework.harness.run_logger import Guarded, create_logger
from framework.common.sampling_params import SamplingParams
from framework.scheduling.output import SchedulerOutput
from framework.harness.workload import Workload, WorkloadContext, WorkloadRequest, create_workload
from models.loader import resolve_model

log = logging.getLogger(__name__)

#: Config groups that name a registered part, with the part used when the group is absent
#: (EngineConfig's default, so the CLI and the Python API agree).
PARTS = {part: EngineConfig.__dataclass_fields__[part].default for part in PART_NAMES}
#: ``EngineConfig`` fields the ``engine`` node may set (the others come from their own groups).
ENGINE_KEYS = set(EngineConfig.__dataclass_fields__) - {*PART_NAMES, *(f"{p}_options" for p in PART_NAMES),
                                                        "model", "model_seed", "check_invariants",
                                                        "async_scheduling"}


#: Keys of the ``model`` node (``seed``: a preset's random weights) and of the ``scheduler`` node.
MODEL_KEYS = ("name", "seed")
SCHEDULER_KEYS = ("check_invariants", "async_scheduling")


def _check_keys(node: str, options: Any, valid: tuple[str, ...]) -> None:
    """ValueError naming the keys of config node ``node`` that nothing reads, and the ``valid``
    ones (``+model.dtype=float16`` would otherwise run in the default dtype, silently)."""
    unknown = sorted(set(options or {}) - set(valid))
    if unknown:
        raise ValueError(f"{node}: unknown key(s) {', '.join(map(str, unknown))}; valid: {', '.join(valid)}")


def _check_node(cfg: DictConfig, key: str, what: str, optional: bool = True) -> None:
    """ValueError unless ``cfg.key`` is a node (or null, when ``optional``): a plain value (``slo=5``,
    ``scheduler=true``) would fail as a TypeError or be read as no settings."""
    node = cfg.get(key)
    if not (isinstance(node, DictConfig) or optional and node is None):
        raise ValueError(f"{key} must be a node {what}, got {node!r}")


def _split(group: Any, default_name: str, node: str) -> tuple[str, dict[str, Any]]:
    """A config group node (``node``) is ``{name: ..., **options}``."""
    return split_spec(OmegaConf.to_container(group, resolve=True) if isinstance(group, DictConfig) else group,
                      default_name, node)


def engine_config(cfg: DictConfig) -> EngineConfig:
    """The ``EngineConfig`` a composed Hydra config describes: the parts from their groups, the
    model from ``model``, everything else from ``engine``."""
    kwargs: dict[str, Any] = {}
    for part, default in PARTS.items():
        if part == "executor" and cfg.get(part) is None:
            continue  # executor: null (the default): the engine's default, the real forward pass
        name, options = _split(cfg.get(part), default, part)
        kwargs[part], kwargs[f"{part}_options"] = name, options
    # The simulated device and cost model are groups of their own, for any executor that runs on
    # simulated time (the sim executor, or a registered subclass of it).
    if "executor" in kwargs and simulates_time(kwargs["executor"]):
        if cfg.get("hardware") is not None:
            kwargs["executor_options"]["hardware"] = OmegaConf.to_container(cfg.hardware, resolve=True)
        if cfg.get("cost_model") is not None:
            # A null option is the cost model's default: so the roofline's `calibration: null` in
            # conf/executor/sim.yaml does not reach a cost model without one (cost_model.name=replay).
            # `cost_model=NAME` on the command line replaces the node with its name.
            name, options = _split(cfg.cost_model, "roofline", "cost_model")
            kwargs["executor_options"]["cost_model"] = {
                "name": name, **{k: v for k, v in options.items() if v is not None}}
    else:
        # The simulated device and cost model mean nothing to a real forward pass: taken silently,
        # a "+hardware=h100-sxm" run on this CPU would be labelled as an H100 one in comparisons.
        simulated_only = [key for key in ("hardware", "cost_model") if cfg.get(key) is not None]
        if simulated_only:
            executor = kwargs.get("executor", PARTS["executor"])
            raise ValueError(f"{' and '.join(simulated_only)} {'is' if len(simulated_only) == 1 else 'are'} for "
                             f"simulated runs only (the device and cost model that time their steps): add "
                             f"executor=sim, or leave {'it' if len(simulated_only) == 1 else 'them'} out; "
                             f"executor={executor} runs on engine.device")
    _check_node(cfg, "engine", "of engine settings (engine.max_num_seqs=32)", optional=False)
    _check_node(cfg, "scheduler", "of check_invariants (scheduler.check_invariants=true)")
    model, model_options = _split(cfg.get("model"), "tiny-llama", "model")
    _check_keys("model", model_options, MODEL_KEYS)
    engine = OmegaConf.to_container(cfg.engine, resolve=True)
    _check_keys("engine", engine, tuple(sorted(ENGINE_KEYS)))
    if isinstance(cfg.get("scheduler"), DictConfig):
        _check_keys("scheduler", OmegaConf.to_container(cfg.scheduler, resolve=True), SCHEDULER_KEYS)
    engine["check_invariants"] = OmegaConf.select(cfg, "scheduler.check_invariants", default=False)
    check_bool("scheduler.check_invariants", engine["check_invariants"])
    engine["async_scheduling"] = OmegaConf.select(cfg, "scheduler.async_scheduling", default="auto")
    if engine["async_scheduling"] not in (True, False, "auto"):
        raise ValueError(f"scheduler.async_scheduling must be auto, true or false, got {engine['async_scheduling']!r}")
    return EngineConfig(model=model, model_seed=model_options.get("seed", 0), **kwargs, **engine)


#: Run-level switches of ``conf/config.yaml``: true or false.
RUN_SWITCHES = ("plots", "progress", "save_workload")
#: What a run's configuration may hold at its root: ``conf/``'s groups and ``conf/config.yaml``'s own keys.
ROOT_KEYS = ("model", "backend", "allocator", "preparer", "workload", "logger", "executor", "policy", "cluster",
             "hardware", "cost_model", "engine", "scheduler", "slo", "warmup", "clock", *RUN_SWITCHES, "repeat",
             "server")


def check_run_options(cfg: DictConfig) -> None:
    """ValueErrors naming the run-level keys that are unknown (not ``ROOT_KEYS``: ``+max_num_seqs=8`` is no
    engine option) or have bad values: ``warmup`` and ``repeat`` (integers >= 0), the ``RUN_SWITCHES`` (booleans: the
    string ``maybe`` or ``no`` would read as true) and the ``slo`` node's keys (those of ``SLO``)."""
    unknown = [str(key) for key in cfg if key not in ROOT_KEYS and key != "hydra"]
    if unknown:
        engine_options = [f"engine.{key}" for key in unknown if key in ENGINE_KEYS]
        hint = f" (engine options go under engine: {', '.join(engine_options)})" if engine_options else ""
        raise ValueError(f"unknown top-level key(s) {', '.join(unknown)}; valid: {', '.join(ROOT_KEYS)}{hint}")
    warmup = cfg.get("warmup", 1)
    if not is_int(warmup) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0 (short requests run before the measured ones), got {warmup!r}")
    repeat = cfg.get("repeat", 0)
    if not is_int(repeat) or repeat < 0:
        raise ValueError(f"repeat must be an integer >= 0 (which repeat of its configuration a run is: -m ... "
                         f"repeat=0,1,2), got {repeat!r}")
    for key in RUN_SWITCHES:
        check_bool(key, cfg.get(key, True))
    _check_node(cfg, "slo", "of ttft_ms, tpot_ms and e2el_ms (slo.ttft_ms=200)")
    if cfg.get("slo"):
        _check_keys("slo", cfg.slo, tuple(f.name for f in dataclasses.fields(SLO)))


def make_clock(name: str, executor: str) -> Clock:
    """``wall`` for real execution, ``virtual`` for a simulated executor (which advances it);
    ``auto`` is the executor's own clock (``Executor.make_clock``, as ``LLMEngine`` picks it)."""
    if name not in ("auto", "wall", "virtual"):
        raise ValueError(f"clock must be auto, wall or virtual, got {name!r}")
    if name == "auto":
        return EXECUTORS.get(executor).make_clock()
    simulated = simulates_time(executor)
    if name == "wall":
        if simulated:
            raise ValueError(f"executor={executor} runs on simulated time: use clock=auto or clock=virtual")
        return WallClock()
    if not simulated:
        raise ValueError(f"clock=virtual needs an executor that advances time (a simulator); executor={executor} "
                         f"runs in wall time: use clock=wall or clock=auto")
    return VirtualClock()


def describe(cfg: DictConfig, cluster: Cluster) -> dict[str, Any]:
    """The run's identity for tables and plots: the parts, the model, the workload and its rate,
    for a simulated run the device, and for a cluster its replicas and router."""
    workload = cfg.get("workload") or {}
    executor = cluster.engines[0].executor
    config = cluster.engines[0].config
    identity = {**{part: getattr(config, part) for part in PART_NAMES}, "model": config.model,
                "workload": workload.get("name"), "workload_file": _workload_choice(), "rate": workload.get("rate"),
                # The policy's own: a run that left the policy group out (or its option) ran its default.
                "preemption_mode": getattr(cluster.engines[0].policy, "preemption_mode", None),
                "enable_prefix_caching": config.enable_prefix_caching}
    if hasattr(executor, "hardware"):
        identity.update(hardware=executor.hardware.name, tensor_parallel_size=executor.tp)
    else:
        identity["device"] = device_name(getattr(executor, "device", None))
    if cfg.get("cluster") is not None:
        identity.update(num_replicas=len(cluster.engines), router=cluster.router.name)
    return identity


def _workload_choice() -> str | None:
    """The ``conf/workload`` file Hydra composed the run from (``poisson``); None outside Hydra's CLI."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    choice = HydraConfig.get().runtime.choices.get("workload")
    return None if choice is None else str(choice)


def device_name(device: str | None) -> str | None:
    """What a real run ran on, for captions: the GPU's name, or the CPU's model and torch's thread count."""
    if device is None:
        return None
    import torch  # a real run has loaded it already

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device == "cpu":
        model = None
        with suppress(OSError):
            model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                          if line.startswith("model name")), None)
        return f"CPU ({model or platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return device


def cluster_spec(cfg: DictConfig) -> tuple[int, str, dict[str, Any]] | None:
    """``(num_replicas, router, router_options)`` of the ``cluster`` node (``+cluster=NAME``),
    or None for a run without one (a single engine)."""
    node = cfg.get("cluster")
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        raise ValueError(f"cluster must be a node of num_replicas, router and router_options (+cluster=NAME), "
                         f"got {node!r}")
    spec = OmegaConf.to_container(node, resolve=True)
    _check_keys("cluster", spec, ("num_replicas", "router", "router_options"))
    num_replicas = spec.get("num_replicas", 1)
    check_num_replicas(num_replicas)
    try:
        options = check_router_options(spec.get("router_options"))
    except ValueError as exc:
        raise ValueError(f"cluster.{exc}") from None
    return num_replicas, spec.get("router", "round_robin"), options


def cluster_parts(cfg: DictConfig, config: EngineConfig) -> tuple[int, Router]:
    """The number of replicas and the router ``cfg``'s ``cluster`` node asks for (one, round robin, without one),
    checked against ``config``'s executor."""
    num_replicas, router, router_options = cluster_spec(cfg) or (1, "round_robin", {})
    check_num_replicas(num_replicas, config.executor)
    return num_replicas, ROUTERS.create_with(router, router_options)


def check_workload(config: EngineConfig, workload: Workload) -> int | None:
    """ValueError for what an engine of ``config`` could never serve of ``workload``, found before any engine is
    built or request drawn: a length past its ``max_model_len``, a prompt its token budget cannot prefill whole (a
    policy that does not chunk prefills). Returns the longest prompt sent, where the workload's options tell."""
    max_model_len = resolve_max_model_len(config.max_model_len, resolve_model(config.model).config)
    longest = workload.check_lengths(max_model_len)
    check_token_budget(config.policy, resolve_token_budget(config, max_model_len), max_model_len, longest)
    return longest


def build_cluster(cfg: DictConfig, config: EngineConfig, clock: Clock | None = None,
                  max_prompt_len: int | None = None) -> Cluster:
    """The replicas (one engine without a ``cluster`` node) and their router, each replica on
    its own clock: ``clock`` for a single replica, else the config's ``clock``. ``max_prompt_len``:
    the longest prompt the workload sends (``check_workload``), when known."""
    num_replicas, router = cluster_parts(cfg, config)  # a bad router fails before any engine is built
    if clock is not None and num_replicas > 1:
        raise ValueError("a given clock drives one replica; each of several replicas needs its own")
    clocks = [clock or make_clock(cfg.get("clock", "auto"), config.executor) for _ in range(num_replicas)]
    engines = [LLMEngine(dataclasses.replace(config), clock=c, max_prompt_len=max_prompt_len) for c in clocks]
    return Cluster(engines, router)


@contextmanager
def _repeats_dropped() -> Iterator[None]:
    """One interrupt per run: the first SIGINT or SIGTERM acts as it would, later ones are dropped
    until the block ends. A parallel sweep's worker gets Ctrl-C from the terminal and its parent
    (``supervision.stop``). A signal whose handler is no Python function is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = False

    def once(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
        def handle(signum: int, frame: Any) -> None:
            nonlocal taken
            if taken:
                return
            try:
                handler(signum, frame)
            except KeyboardInterrupt:
                taken = True
                raise
        return handle

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, handler in previous.items():
        if callable(handler):
            signal.signal(s, once(handler))
    try:
        yield
    finally:
        for s, handler in previous.items():
            if callable(handler):
                signal.signal(s, handler)


def clear_run_dir(cfg: DictConfig, run_dir: str | Path) -> None:
    """Start ``run_dir`` afresh: remove the files an earlier run left there (``recorder.RUN_FILES``), but none
    that ``cfg`` names (a trace replayed from the folder's own ``workload.jsonl`` is this run's input)."""
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:  # a broken interpolation, which the run reports: the strings as written
        container = OmegaConf.to_container(cfg, resolve=False)
    clear_run_files(run_dir, keep=_strings(container))


def _strings(node: Any) -> Iterator[str]:
    """Every string in a config's nested dicts and lists."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, (dict, list)):
        for value in node.values() if isinstance(node, dict) else node:
            yield from _strings(value)


def check_experiment(cfg: DictConfig) -> tuple[EngineConfig, SLO, Workload, dict[str, Any], int | None]:
    """What a run of ``cfg`` refuses before it draws a request or loads a model, with ValueError or UnavailableError:
    its run options, engine settings and parts, SLO and workload, and what of the workload the engine could never
    serve. Returns the engine's config, the SLO, the workload, its sampling options and its longest prompt."""
    check_run_options(cfg)
    config = engine_config(cfg)
    slo = SLO(**OmegaConf.to_container(cfg.slo, resolve=True)) if cfg.get("slo") else SLO()
    workload, sampling = create_workload(OmegaConf.to_container(cfg.workload, resolve=True))
    max_prompt_len = check_workload(config, workload)  # before a huge prompt is drawn, or an engine built
    resolved = dataclasses.replace(config)
    checked = check_before_loading(resolved, max_prompt_len)
    EXECUTORS.check_options(config.executor, config.executor_options, config, None, None)
    if issubclass(EXECUTORS.get(config.executor), SimExecutor):
        # Built from shapes alone (no weights), in milliseconds: its device, cost model and KV cache are checked
        # here, so a sweep's pre-check refuses a job that would fail on them.
        executor = EXECUTORS.create_with(config.executor, config.executor_options, resolved, checked.source,
                                         VirtualClock())
        check_kv_capacity(resolved, executor.kv_block_counts()[0])
    create_logger(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else {})  # options only
    cluster_parts(cfg, config)
    make_clock(cfg.get("clock", "auto"), config.executor)
    return config, slo, workload, sampling, max_prompt_len


def run_experiment(cfg: DictConfig, run_dir: str | Path, clock: Clock | None = None,
                   run_name: str | None = None, group: str | None = None,
                   on_engine: Callable[[LLMEngine], None] | None = None) -> dict[str, Any]:
    """Run the experiment ``cfg`` describes into ``run_dir`` (an earlier run's files removed first); return its summary.
    Config errors (a live run's folder too) raise ValueError first; a serving failure writes a ``failed`` summary, then
    raises (ValueError in RuntimeError); an interrupt returns an ``interrupted`` one. ``clock``: one replica's."""
    with claim_run_dir(run_dir):  # before anything in it is removed: another live run's files stay as they are
        clear_run_dir(cfg, run_dir)
        config, slo, workload, sampling, max_prompt_len = check_experiment(cfg)
        # A simulated run is pure Python bookkeeping over millions of small objects: no collector.
        with gc_paused(simulates_time(config.executor)):
            # Drawn (so checked: token ids, arrival times, a trace's or dataset's entries) before an engine is built.
            requests = workload.generate(workload_context(config))
            run_logger = Guarded(create_logger(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger")
                                               else {}))
            cluster = build_cluster(cfg, config, clock, max_prompt_len)
            identity = describe(cfg, cluster)
            run_name = run_name or f"{config.policy}-{config.backend}"
            return _run(cfg, cluster, requests, sampling, slo, run_logger, identity, Path(run_dir), run_name, group,
                        on_engine)


def workload_context(config: EngineConfig) -> WorkloadContext:
    """What an engine of ``config`` tells its workload (vocabulary, tokenizer, ``max_model_len``), without one."""
    source = resolve_model(config.model)
    return WorkloadContext(source.config.vocab_size, EXECUTORS.get(config.executor).load_tokenizer(source),
                           resolve_max_model_len(config.max_model_len, source.config))


def _run(cfg: DictConfig, cluster: Cluster, requests: list[WorkloadRequest], sampling: dict[str, Any], slo: SLO,
         run_logger: Guarded, identity: dict[str, Any], run_dir: Path, run_name: str, group: str | None,
         on_engine: Callable[[LLMEngine], None] | None) -> dict[str, Any]:
    """``run_experiment`` once its parts are built: warm up, serve, record."""
    engines = cluster.engines
    for engine in engines:
        warm_up(engine, cfg.get("warmup", 1))
    hits0 = [(e.allocator.stats.prefix_hit_tokens, e.allocator.stats.prefix_query_tokens) for e in engines]
    preempted0 = _preemptions(engines)
    if on_engine is not None:
        for engine in engines:
            on_engine(engine)
    first = engines[0]
    resolved = OmegaConf.to_container(cfg, resolve=True)
    plots_wanted = cfg.get("plots", True)
    # Not cfg.get("cluster"): DictConfig.get raises and catches for an absent key, and the caught
    # exception's frames hold this one (with the run's records) until the next cycle collection.
    recorder = RunRecorder(run_dir, replica_column="cluster" in resolved, keep_timeline=plots_wanted,
                           step_listener=run_logger.log_step if run_logger.implements("log_step") else None)
    recorder.write_config(resolved)
    if cfg.get("save_workload", True):
        recorder.write_workload(requests, sampling)
    meta = {**identity, "run_dir": str(run_dir), "num_requests": len(requests)}
    recorder.write_summary({"status": "running", "interrupted": False, **meta})
    run_logger.start({**resolved, "engine_config": first.config.to_dict()}, run_dir, run_name, group)

    records: list[RequestRecord] = []
    replica_of: list[int] = []
    progress = _progress_bar(len(requests), run_name, cfg.get("progress", True))
    start = max(e.clock.now() for e in engines)
    callbacks = []
    for i, engine in enumerate(engines):
        callbacks.append((engine, recorder.step_log(i, start)))
        if progress is not None and len(engines) == 1:
            callbacks.append((engine, QueuePostfix(progress)))
    for engine, callback in callbacks:
        engine.step_callbacks.append(callback)

    # An engine on a real clock that runs out of work sleeps until the next arrival, with no step
    # to flush the recorder: what it finished goes to the disk first, or a run killed in a long
    # gap between arrivals would lose rows made long before.
    waits = [not isinstance(e.clock, VirtualClock) for e in engines]

    def on_output(replica: int, out: RequestOutput) -> None:
        record = RequestRecord.from_output(out, start)
        records.append(record)
        replica_of.append(replica)
        recorder.add_request(record, replica)
        if waits[replica] and not engines[replica].has_unfinished_requests():
            recorder.flush()
        if progress is not None:
            progress.update(1)

    # From the first interrupt until the summary is written, a repeated one is the same one.
    with _repeats_dropped():
        wall_start = time.perf_counter()
        try:
            result = cluster.run(_handed_over(requests), sampling, on_output, start=start)
        except Exception as exc:
            recorder.close()
            # The requests finished before the failure are measured (their rows are in requests.csv):
            # the summary keeps their metrics, as an interrupted run's does.
            try:
                measured = summarize(records, max(e.clock.now() for e in engines) - start, slo, recorder.step_totals,
                                     _hit_rate([e.allocator.stats for e in engines], hits0),
                                     _preemptions(engines, preempted0))
            except Exception as summary_exc:  # the failure itself is what must be reported
                log.warning("could not summarize the requests finished before the failure: %s", summary_exc)
                measured = {}
            failed = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "interrupted": False, **meta,
                      **measured}
            recorder.write_summary(failed)
            run_logger.log_summary(failed)  # the logger's record says failed too, with what was measured
            run_logger.finish(False)
            if isinstance(exc, ValueError):  # a ValueError from here on is a failure, not a configuration error
                raise RuntimeError(f"serving failed: {type(exc).__name__}: {exc}") from exc
            raise
        finally:
            for engine, callback in callbacks:
                engine.step_callbacks.remove(callback)
            if progress is not None:
                progress.close()
        wall_time = time.perf_counter() - wall_start
        with interrupts_held():  # the run is measured: its summary is written before a Ctrl-C goes on
            recorder.close()
            summary = {"status": "interrupted" if result.interrupted else "completed",
                       "interrupted": result.interrupted, **meta, "num_sent": result.num_sent,
                       "num_unfinished": len(result.unfinished), "wall_time_s": wall_time,
                       **summarize(records, result.end_time - result.start_time, slo, recorder.step_totals,
                                   _hit_rate([e.allocator.stats for e in engines], hits0),
                                   _preemptions(engines, preempted0)),
                       **timing_noise(run_dir / "steps.csv", simulated=any(isinstance(e.clock, VirtualClock)
                                                                           for e in engines))}
            recorder.write_summary(summary)
    # The logger gets the metrics before the plots are drawn (seconds for a big run), so a Ctrl-C
    # there leaves them in the tracker as in summary.json.
    run_logger.log_summary(summary)
    try:
        plots = _plots(records, recorder.timeline(), run_dir, caption(summary)) if plots_wanted else {}
        if run_logger.implements("log_requests"):
            columns = recorder.request_columns
            run_logger.log_requests(columns, [dict(zip(columns, recorder.request_values(r, i)))
                                              for r, i in zip(records, replica_of)])
        run_logger.log_plots(plots)
    except BaseException as exc:
        # End the logger's run here too, or the sweep's next job in this process would log into it
        # (wandb.init returns the active run). A failure marks it failed, as summary.json is
        # (supervision.mark); a Ctrl-C leaves the summary that says how the run ended.
        if isinstance(exc, Exception):
            run_logger.log_summary({"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        run_logger.finish(result.interrupted)
        raise
    run_logger.finish(result.interrupted)
    print(format_summary(summary, f"{run_name} ({identity['workload']}, rate={identity['rate']})"))
    return summary


class QueuePostfix:
    """Shows the engine's queues on the progress bar every few steps. It takes decode runs
    (``on_decode_run``, so the fast path stays on) without a word: they change only the running
    count, which the next ordinary step shows."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def __call__(self, stats: StepStats, _: SchedulerOutput) -> None:
        if stats.step % 8 == 0:
            self.bar.set_postfix(running=stats.num_running, waiting=stats.num_waiting, kv=f"{stats.kv_usage:.0%}",
                                 refresh=False)

    def on_decode_run(self, run: Any) -> None:
        pass


def _handed_over(requests: list[WorkloadRequest]) -> Iterator[WorkloadRequest]:
    """The requests in order, each dropped from the list as it is handed to the driver: its
    prompt is freed once the engine is done with it (a big simulated workload holds tens of
    millions of prompt tokens)."""
    for i in range(len(requests)):
        request, requests[i] = requests[i], None  # type: ignore[call-overload]
        yield request


def warm_up(engine: LLMEngine, num_requests: int) -> None:
    """Run a few short requests first, so one-time costs (first kernel calls, allocations)
    do not land on the measured requests; as ``vllm bench serve --num-warmups``. Each fits the engine's
    token budget and ``max_model_len``; one the engine would not run is a warning."""
    vocab, low = engine.model_config.vocab_size, WorkloadContext.first_token_id  # no special tokens
    config = engine.config
    length = max(1, min(32, config.max_num_batched_tokens, config.max_model_len - 4))
    params = SamplingParams(max_tokens=max(1, min(4, config.max_model_len - length)), temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"warmup-{i}", [low + (7 * i + j) % (vocab - low) for j in range(length)], params)
    unrun = []
    while engine.has_unfinished_requests():
        unrun += [o for o in engine.step(final_only=True) if len(o.outputs[0].token_ids) < params.max_tokens]
    if unrun:
        log.warning("%d of %d warm-up requests did not run (%s): one-time costs land on the measured requests",
                    len(unrun), num_requests, unrun[0].status_message or unrun[0].outputs[0].finish_reason)


def _hit_rate(stats: list[AllocatorStats], since: list[tuple[int, int]]) -> float | None:
    """Prefix-cache hit rate (hit tokens / looked-up tokens) of every replica since the warm-up."""
    hits = sum(s.prefix_hit_tokens - h for s, (h, _) in zip(stats, since))
    queries = sum(s.prefix_query_tokens - q for s, (_, q) in zip(stats, since))
    return hits / queries if queries else None


def _preemptions(engines: list[LLMEngine], since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """(Preemptions, swap-outs) of every replica's scheduler since ``since``: the requests a stop cut off, which
    leave no record, count too."""
    return (sum(e.scheduler.num_preemptions for e in engines) - since[0],
            sum(e.scheduler.num_swap_outs for e in engines) - since[1])


def timing_noise(steps_csv: Path, simulated: bool) -> dict[str, Any]:
    """``metrics.step_time_noise`` of the steps in ``steps_csv``; for a simulated run, whose step times are a
    function of their shape, none (None, 0 steps): its repeats differ only by their seed."""
    if simulated or not steps_csv.is_file():
        return {"step_time_noise_cv": None, "step_time_noise_steps": 0, "step_time_noise_shapes": 0}
    with open(steps_csv, newline="") as f:
        return step_time_noise((int(r["num_scheduled_reqs"]), int(r["num_prefill_tokens"]),
                                int(r["num_decode_tokens"]), float(r["duration"])) for r in csv.DictReader(f))


def caption(summary: dict[str, Any]) -> str:
    """A figure's caption line: the run's model, device and workload (from its summary)."""
    from framework.harness.plots import caption_line

    return caption_line([summary])


def _plots(records: list[RequestRecord], steps: dict[str, Any], run_dir: Path, text: str | None = None
           ) -> dict[str, Path]:
    """The run's figures (each as PNG and PDF; the PNGs' paths returned), captioned ``text``."""
    from framework.harness import plots

    out = {}
    if any(r.completed for r in records):
        out["latency_cdf"] = plots.latency_cdfs(records, run_dir / "latency_cdf.png", caption=text)
    if len(steps.get("time_s", ())):
        out["timeline"] = plots.timeline(steps, run_dir / "timeline.png", caption=text)
    return out


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)
