"""One run end to end: the files in the run directory, the summary, interrupts and config errors."""
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from framework.harness import experiment
from framework.common.clock import Clock, VirtualClock, WallClock
from framework.harness.cluster import check_num_replicas
from framework.execution.executor import EXECUTORS, Executor, ExecutorOutput
from framework.harness.experiment import make_clock, run_experiment
from framework.harness.recorder import RunRecorder
from framework.harness.workload import WorkloadContext
from framework.harness.workloads.trace import load_trace
from framework.testing.registries import forget_registrations
from tests.hydra_support import compose_config, read_csv
from tests.processes import children

ROOT = Path(__file__).resolve().parents[3]
STEP = 0.1
BASE = ["progress=false", "engine.max_model_len=128", "engine.num_gpu_blocks_override=64"]
TINY = ["workload.num_requests=6", "workload.prompt_len=[8,24]", "workload.output_len=[2,5]"]


def config(*overrides, workload=TINY):
    return compose_config(*BASE, *workload, *overrides)


def timed(clock):
    """Forward passes take STEP seconds on the virtual clock (what a simulated executor does)."""
    def patch(engine):
        execute = engine.executor.execute
        engine.executor.execute = lambda out: (clock.advance(STEP), execute(out))[1]
    return patch


def test_a_run_writes_every_file(tmp_path, capsys):
    clock = VirtualClock()
    summary = run_experiment(config("slo.ttft_ms=150"), tmp_path, clock=clock, on_engine=timed(clock))
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.yaml", "workload.jsonl", "summary.json", "requests.csv", "steps.csv", "latency_cdf.png",
            "timeline.png"} <= names
    assert json.loads((tmp_path / "summary.json").read_text()) == pytest.approx(summary)
    assert summary["status"] == "completed" and not summary["interrupted"]
    assert summary["completed"] == 6 and summary["num_requests"] == 6 and summary["policy"] == "fcfs"
    # No +policy: FCFS with its default preemption mode ran, which the summary said was None.
    assert summary["preemption_mode"] == "recompute"
    # All six arrive at t=0 and FCFS prefills them together in the first 0.1 s step.
    assert summary["mean_ttft_ms"] == pytest.approx(100) and summary["p99_ttft_ms"] == pytest.approx(100)
    assert summary["mean_tpot_ms"] == pytest.approx(100) and summary["request_goodput"] > 0
    rows = read_csv(tmp_path / "requests.csv")
    assert sorted(r["request_id"] for r in rows) == [str(i) for i in range(6)]
    steps = read_csv(tmp_path / "steps.csv")
    assert len(steps) == summary["num_steps"] and float(steps[1]["time_s"]) == pytest.approx(STEP)
    assert sum(int(s["num_scheduled_tokens"]) for s in steps) == summary["total_input_tokens"] + \
        summary["total_output_tokens"] - 6  # the last token of each request is sampled, never fed back
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["slo"]["ttft_ms"] == 150
    replay = load_trace(tmp_path / "workload.jsonl", WorkloadContext(vocab_size=1024))
    assert {r.request_id: r.output_len for r in replay} == {r["request_id"]: int(r["output_len"]) for r in rows}
    for png in ("latency_cdf.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / png).with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"
    # Steps on a virtual clock time nothing of the machine's; the device is named for captions.
    assert summary["step_time_noise_cv"] is None and summary["step_time_noise_steps"] == 0
    assert summary["device"].startswith("CPU (")
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "Mean TTFT (ms):" in out


def test_a_replayed_workload_jsonl_sends_the_sampling_the_run_sent(tmp_path):
    """workload.jsonl held no sampling keys: replaying a run of temperature 0.7 under trace.yaml's
    config sampled greedily."""
    def sent_params(*overrides, run_dir, workload=TINY):
        sent = {}

        def spy(engine):
            add = engine.add_request
            engine.add_request = lambda rid, prompt, params, **kw: (sent.setdefault(rid, params), add(rid, prompt, params, **kw))[1]
        clock = VirtualClock()
        run_experiment(config(*overrides, "plots=false", "warmup=0", workload=workload), run_dir, clock=clock,
                       on_engine=lambda e: (timed(clock)(e), spy(e)))
        return sent

    first = sent_params("workload.temperature=0.7", "+workload.top_k=3", "workload.ignore_eos=false", run_dir=tmp_path / "a")
    assert {p.temperature for p in first.values()} == {0.7} and len(first) == 6
    replay = sent_params("workload=trace", f"workload.path={tmp_path / 'a' / 'workload.jsonl'}", run_dir=tmp_path / "b",
                         workload=[])
    assert replay == first
    assert (tmp_path / "b" / "workload.jsonl").read_bytes() == (tmp_path / "a" / "workload.jsonl").read_bytes()


def test_interrupt_keeps_finished_rows_and_marks_the_summary(tmp_path):
    clock = VirtualClock()

    def interrupt_after_5_steps(engine):
        timed(clock)(engine)
        first = engine.num_steps

        def callback(stats, out):
            if stats.step - first == 5:
                raise KeyboardInterrupt

        engine.step_callbacks.append(callback)

    summary = run_experiment(config("workload.output_len=[1,12]", "workload.num_requests=8"), tmp_path,
                             clock=clock, on_engine=interrupt_after_5_steps)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == "interrupted" and saved["interrupted"] is True
    rows = read_csv(tmp_path / "requests.csv")
    assert 0 < len(rows) < 8
    assert saved["completed"] == len(rows) and saved["num_unfinished"] == 8 - len(rows) == summary["num_unfinished"]
    assert all(r["status"] == "length" and int(r["output_len"]) <= 5 for r in rows)


#: A simulated run whose requests preempt each other by swapping from its first steps.
SWAPPING = ("executor=sim", "model.name=llama-3-8b", "workload=poisson", "workload.num_requests=60", "workload.rate=50",
            "workload.output_len=[50,200]", "workload.prompt_len=[10,400]", "engine.num_gpu_blocks_override=60",
            "engine.max_model_len=800", "progress=false", "plots=false", "+policy=fcfs", "policy.preemption_mode=swap")


def stop_after(num_steps: int):
    """An ``on_engine`` that interrupts the run (as a Ctrl-C) after ``num_steps`` steps."""
    def install(engine):
        first = engine.num_steps

        def callback(stats, out):
            if stats.step - first >= num_steps:
                raise KeyboardInterrupt

        engine.step_callbacks.append(callback)
    return install


def test_an_interrupted_runs_preemptions_count_the_requests_it_cut_off(tmp_path):
    # They were summed over requests.csv, which has no row for a request the interrupt aborted: the summary said 0
    # preemptions and 0 swaps where steps.csv showed them.
    summary = run_experiment(compose_config(*SWAPPING), tmp_path, on_engine=stop_after(150))
    steps, rows = read_csv(tmp_path / "steps.csv"), read_csv(tmp_path / "requests.csv")
    assert summary["status"] == "interrupted"
    recorded = sum(int(r["num_preemptions"]) for r in rows), sum(int(r["num_swaps"]) for r in rows)
    assert summary["num_preemptions"] == sum(int(s["num_preempted"]) for s in steps) > recorded[0]
    assert summary["num_swaps"] > recorded[1] and summary["blocks_swapped_out"] > 0


def test_a_ctrl_c_while_a_finished_request_is_recorded_keeps_the_summary_and_the_rows_agreeing(tmp_path, monkeypatch):
    # Landing after the run kept the request's record and before its row was written, the summary counted a
    # request that requests.csv never got.
    import signal

    calls, add = [0], RunRecorder.add_request

    def interrupted(self, record, replica=0):
        calls[0] += 1
        if calls[0] == 10:
            signal.raise_signal(signal.SIGINT)  # Python's handler runs at the next bytecode, inside the call
        return add(self, record, replica)

    monkeypatch.setattr(RunRecorder, "add_request", interrupted)
    summary = run_experiment(compose_config(*SWAPPING), tmp_path)
    rows = read_csv(tmp_path / "requests.csv")
    assert summary["status"] == "interrupted"
    assert summary["completed"] + summary["failed"] == len(rows) >= 10


def test_rows_reach_the_disk_before_a_real_engine_waits_for_the_next_arrival(tmp_path, monkeypatch):
    """A real engine that runs out of work sleeps until the next arrival, and nothing flushed the
    rows of the requests it had finished: a run killed (SIGKILL, OOM) in a long gap between
    arrivals lost rows made long before, not at most flush_interval's worth."""
    seen = []

    class GapClock(Clock):  # a real engine's clock (not simulated time) that looks at the files when idle
        def __init__(self):
            self.t = 0.0

        def now(self):
            return self.t

        def advance(self, dt):
            self.t += dt

        def wait_until(self, t):
            if t > self.t + 10:  # the engine has nothing to do until the late arrival
                seen.append((len(read_csv(tmp_path / "run" / "requests.csv")),
                             len(read_csv(tmp_path / "run" / "steps.csv"))))
            self.t = max(self.t, t)

    monkeypatch.setattr(experiment, "RunRecorder", functools.partial(RunRecorder, flush_interval=3600.0))
    trace = tmp_path / "gap.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": a, "prompt_len": 12, "output_len": 3}) + "\n"
                             for a in (0.0, 0.0, 60.0)))
    clock = GapClock()
    summary = run_experiment(config("workload=trace", f"workload.path={trace}", "plots=false", workload=[]),
                             tmp_path / "run", clock=clock, on_engine=timed(clock))
    assert summary["completed"] == 3
    # Both early requests took a prefill step and two decode steps together before the gap.
    assert seen == [(2, 3)]


def test_trace_workload_with_text_prompts_runs(tmp_path):
    clock = VirtualClock()
    summary = run_experiment(config("workload=trace", "workload.max_requests=5", "plots=false", workload=[]), tmp_path,
                             clock=clock, on_engine=timed(clock))
    assert summary["completed"] == 5 and not (tmp_path / "timeline.png").exists()


def test_clock_choice():
    assert make_clock("auto", "model").__class__.__name__ == "WallClock"
    assert isinstance(make_clock("auto", "sim"), VirtualClock)
    with pytest.raises(ValueError, match="clock=virtual needs an executor that advances time"):
        make_clock("virtual", "model")
    with pytest.raises(ValueError, match="clock must be auto, wall or virtual"):
        make_clock("sundial", "model")


class WallTimeExecutor(Executor):
    """A registered executor of a researcher's own that serves in wall time (``Executor``'s clock):
    each step takes a few real milliseconds and samples token 5."""

    def kv_block_counts(self):
        return 64, 0

    def initialize(self, num_blocks, num_cpu_blocks):
        pass

    def execute(self, out):
        time.sleep(0.002)
        return ExecutorOutput({r.request_id: 5 for r in out.scheduled
                               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens})


def test_a_simulated_runs_steps_time_no_noise_of_the_machine(tmp_path):
    header = "num_scheduled_reqs,num_prefill_tokens,num_decode_tokens,duration\n"
    (tmp_path / "steps.csv").write_text(header + "".join(f"4,0,4,{0.01 + 0.001 * (i % 3)}\n" for i in range(12)))
    real = experiment.timing_noise(tmp_path / "steps.csv", simulated=False)
    assert real["step_time_noise_cv"] > 0 and real["step_time_noise_steps"] == 12
    assert experiment.timing_noise(tmp_path / "steps.csv", simulated=True) == {
        "step_time_noise_cv": None, "step_time_noise_steps": 0, "step_time_noise_shapes": 0}


def test_save_workload_false_writes_no_workload_file(tmp_path):
    summary = run_experiment(config("save_workload=false", "plots=false"), tmp_path)
    assert summary["status"] == "completed" and (tmp_path / "requests.csv").is_file()
    assert not (tmp_path / "workload.jsonl").exists()


def test_a_run_without_prefix_caching_has_no_hit_rate(tmp_path):
    summary = run_experiment(config("engine.enable_prefix_caching=false", "plots=false"), tmp_path)
    assert summary["completed"] == 6 and summary["prefix_cache_hit_rate"] is None


def test_a_registered_executor_runs_on_its_own_clock(tmp_path, monkeypatch):
    """clock=auto is the executor's own clock, as LLMEngine picks it: a wall-time executor that is
    not named "model" ran on a virtual clock that nothing advanced, every latency 0."""
    forget_registrations(monkeypatch, EXECUTORS)
    EXECUTORS.register("test_wall_time")(WallTimeExecutor)
    assert type(make_clock("auto", "test_wall_time")) is WallClock
    with pytest.raises(ValueError, match="executor=test_wall_time runs in wall time"):
        make_clock("virtual", "test_wall_time")
    with pytest.raises(ValueError, match="only in simulated time"):
        check_num_replicas(2, "test_wall_time")
    clocks = []
    # The model executor's own options go with its name.
    summary = run_experiment(config("executor=model", "executor.name=test_wall_time", "~executor.fused_ops",
                                    "~executor.float32_matmul", "~executor.pad_matmul_rows", "~executor.amx_matmul",
                                    "~executor.cuda_graphs", "~executor.decode_matmul", "~executor.weight_prefetch_mb",
                                    "plots=false"), tmp_path, on_engine=lambda engine: clocks.append(engine.clock))
    assert [type(c) for c in clocks] == [WallClock]
    assert summary["completed"] == 6 and summary["duration_s"] > 0 and summary["mean_ttft_ms"] > 0


def cli(*args, cwd):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "framework.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("overrides, message", [
    (["engine.block_size=3"], "block_size must be a power of two"),
    (["+policy=fcfs", "policy.name=nope"], "unknown policy 'nope'; registered policies: .*fcfs"),
    (["policy.preemption_mode=sometimes"], "preemption_mode must be 'recompute' or 'swap'"),
    (["workload.prompt_len=[0,3]"], "prompt_len: lengths must be >= 1"),
    (["logger.name=carrier_pigeon"], "unknown logger 'carrier_pigeon'"),
    (["slo.tpot_ms=0"], "slo.tpot_ms must be a positive number"),
    (["+engine.max_num_seq=32"], r"engine: unknown key\(s\) max_num_seq; valid: .*max_num_seqs"),
    (["workload.temperature=-1"], "workload.temperature must be a finite number >= 0, got -1"),
    (["+workload.top_p=5"], r"workload.top_p must be in \(0, 1\], got 5"),
    (["workload.ignore_eos=maybe"], "workload.ignore_eos must be True or False"),
    (["scheduler.check_invariants=maybe"], "scheduler.check_invariants must be true or false"),
    (["scheduler.async_scheduling=maybe"], "scheduler.async_scheduling must be auto, true or false, got 'maybe'"),
    (["executor=sim", "preparer=v0", "scheduler.async_scheduling=true"],
     r"async_scheduling=true cannot run with preparer=v0"),
    (["executor=sim", "executor.fast_forward=maybe"], "executor.fast_forward must be true or false"),
    (["executor=sim", "cost_model=bogus"], "unknown cost model 'bogus'; registered cost models: .*roofline"),
    # A simulated device or cost model given to the real forward pass used to be ignored silently.
    (["+hardware=h100-sxm"], "hardware is for simulated runs only .*add executor=sim.*executor=model runs on engine.device"),
    (["+cost_model.matmul_efficiency=0.5"], "cost_model is for simulated runs only .*add executor=sim"),
    (["engine.device=tpu"], "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["engine.seed=abc"], r"seed must be an integer in \[0, 2\*\*63\), got 'abc'"),
    (["engine.num_threads=0"], "num_threads must be a positive integer or null, got 0"),
    (["engine.kv_cache_memory_gb=-1"], "kv_cache_memory_gb must be a number > 0"),
    (["engine.swap_space=nan"], "swap_space must be a number >= 0"),
    # These used to escape as TypeErrors (warmup=abc, +slo.foo=1) or be taken: warmup=-1 as no
    # warm-up, plots=maybe as true.
    (["warmup=abc"], "warmup must be an integer >= 0 .*got 'abc'"),
    (["warmup=-1"], "warmup must be an integer >= 0 .*got -1"),
    (["plots=maybe"], "plots must be true or false, got 'maybe'"),
    (["progress=maybe"], "progress must be true or false, got 'maybe'"),
    (["save_workload=no"], "save_workload must be true or false, got 'no'"),
    (["+slo.ttft=100"], r"slo: unknown key\(s\) ttft; valid: ttft_ms, tpot_ms, e2el_ms"),
    # Hydra's own hint for max_num_seqs=8 is +max_num_seqs=8: that ran with engine.max_num_seqs as it was.
    (["+max_num_seqs=8", "+plot=false"], r"unknown top-level key\(s\) max_num_seqs, plot; valid: model, .*plots.* "
                                         r"\(engine options go under engine: engine.max_num_seqs\)$"),
    # Read by nothing, these used to be dropped: the run went on in the default dtype, unchecked.
    (["+model.dtype=float16"], r"model: unknown key\(s\) dtype; valid: name, seed"),
    (["+scheduler.check_invariant=true"], r"scheduler: unknown key\(s\) check_invariant; valid: check_invariants, "
                                          r"async_scheduling"),
    # A list where a name goes (a sweep written as a list) used to crash: "unhashable type: 'list'".
    (["backend.name=[naive,triton]"], r"a backend name is a string, one of .*torch_paged.*; got \['naive', 'triton'\]"),
    (["workload.name=[synthetic]"], r"a workload name is a string, one of .*synthetic"),
    (["engine.dtype=[float16]"], r"dtype must be one of .*float16.*got \['float16'\]"),
    # Both were TypeErrors from pathlib ("expected str, bytes or os.PathLike object, not int").
    (["model.name=5"], "model must be a preset .*tiny-llama.* or a checkpoint directory, got 5"),
    (["executor=sim", "cost_model.calibration=5"], "calibration must be the path of a YAML .*got 5"),
    # A part named the Hydra way failed naming the default part it fell back to ("policy 'fcfs':
    # unexpected keyword argument '_target_'"), never the class the node names.
    (["+policy=chunked", "~policy.name", "+policy._target_=policies.chunked.ChunkedPolicy"],
     r"policy: _target_='policies.chunked.ChunkedPolicy' does not pick a policy here .*name: NAME"),
    (["executor=sim", "~cost_model.name", "+cost_model._target_=my.CostModel"],
     r"cost_model: _target_='my.CostModel' does not pick a cost_model here"),
    (["~logger.name", "+logger._target_=my.Logger"], r"logger: _target_='my.Logger' does not pick a logger here"),
    # A value given to a node itself: TypeErrors ("'int' object is not iterable"), a string read
    # as its letters ("unknown key(s) a, b, c"), or no settings at all (scheduler=5 ran as false).
    (["slo=5"], r"slo must be a node of ttft_ms, tpot_ms and e2el_ms \(slo.ttft_ms=200\), got 5"),
    (["slo=abc"], "slo must be a node of .*got 'abc'"),
    (["scheduler=5"], r"scheduler must be a node of check_invariants .*got 5"),
    (["engine=5"], "engine must be a node of engine settings .*got 5"),
    (["executor=sim", "cost_model=5"], r"cost_model must be a name or a mapping \{name: NAME, \*\*options\}, got 5"),
])
def test_configuration_errors_are_value_errors_raised_before_running(tmp_path, overrides, message):
    if overrides[0].startswith("policy."):
        overrides = ["+policy=fcfs", *overrides]
    with pytest.raises(ValueError, match=message):
        run_experiment(config(*overrides), tmp_path)
    assert not (tmp_path / "summary.json").exists()


def test_cli_prints_configuration_errors_cleanly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "framework.run", "engine.block_size=3", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert "error: block_size must be a power of two" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("overrides, message", [
    # One line, where Hydra prints several with its search path.
    (["+policy=bogus"], r"(?m)^error: Could not find 'policy/bogus'; Available options in 'policy': chunked, fcfs, .*sjf$"),
    (["engine.bogus=1"], r"(?m)^error: engine: unknown key bogus; valid: block_size, .*swap_space$"),
    (["engine.max_num_seq=8"], r"(?m)^error: engine: unknown key max_num_seq \(did you mean max_num_seqs\?\); valid: "),
    (["backend.bogus=1"], r"(?m)^error: backend: unknown key bogus; valid: decode_kernel, name, prefill_kernel$"),
    # A key of a group the defaults leave out says which option to add, not the root's keys.
    (["policy.preemption_mode=swap"], r"(?m)^error: config: no policy is selected, so policy\.\* cannot be set: add "
                                      r"\+policy=NAME first"),
    (["cluster.num_replicas=8"], r"(?m)^error: config: no cluster is selected, .*\+cluster=NAME"),
    (["model=llama-3-8b"], r"(?m)^error: Could not find 'model/llama-3-8b'; .*goes in model\.name=NAME$"),
    # A node with no keys (null by default) keeps Hydra's advice; a wrapped error keeps its cause.
    (["workload.shared_prefix.fraction=0.5"], r"(?m)^error: Could not override 'workload.shared_prefix.fraction'; To "
                                              r"append to your config use \+workload.shared_prefix.fraction=0.5; "),
    (["hydra.job.chdir=maybe"], r"(?m)^error: Error merging override hydra.job.chdir=maybe; Value 'maybe' is not a "
                                r"valid bool"),
    # In a sweep too, with the jobs in this process or in joblib's workers.
    (["-m", "+policy=fcfs,bogus"], r"Could not find 'policy/bogus'"),
    (["-m", "hydra/launcher=parallel", "engine.bogus=1,2"], r"(?m)^error: engine: unknown key bogus; valid: "),
    (["-m", "engine.max_num_seqs=1,["], "mismatched input"),
    # A key of a swept group that the sweep adds reaches the jobs (++); the pre-check reads the device's fields.
    (["-m", "+hardware=h100-sxm,a100-80gb", "hardware.typo_key=4"],
     r"error: unknown hardware field\(s\) \['typo_key'\]"),
    # A named sweep (hydra.mode: MULTIRUN) that does not compose runs as a single run, which Hydra refuses for the
    # swept value ("add --multirun"): the error it hid is TINY's list over mixed_long's {dist: ...} prompt_len.
    (["+experiment=chunked_vs_fcfs", "workload.rate=1,2"],
     r"(?m)\Aerror: Error merging override workload.prompt_len=\[8,24\]; Cannot merge DictConfig with ListConfig$"),
    # Hydra's own message for this one is a traceback from its internals.
    (["workload=null"], "error: workload=null: the config group 'workload' needs one of its options: .*chat"),
    # So are these ("Config group override must be a string or a list. Got int"), in a sweep too.
    (["backend=5"], "error: backend=5: 5 is not an option of the config group 'backend'; its options: .*naive"),
    # Hydra checks these flags before it reports errors itself: a ValueError traceback.
    (["-m", "--cfg", "job"], "error: Only one of --run, --multirun, --cfg, --info and --shell_completion"),
    (["-m", "logger=none,true"], "error: logger=none,true: true is not an option of the config group 'logger'; "
                                 "its options: none, wandb"),
    (["-m", "executor=null,sim"], "error: executor=null,sim: null is not an option of the config group 'executor'; "
                                  "its options: model, sim"),
])
def test_cli_gives_hydras_own_configuration_errors_the_configuration_error_status(tmp_path, overrides, message):
    done = cli(*overrides, "executor=sim", *BASE, *TINY, f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}",
               cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert re.search(message, done.stderr, re.S) and "Traceback" not in done.stderr


@pytest.mark.parametrize("overrides", [
    ["-m", "+policy=fcfs,chunked", "policy.watermark=0.1,0.2"],
    ["-m", "hydra/launcher=parallel", "+policy=fcfs,chunked", "policy.watermark=0.1,0.2"],
    ["+experiment=chunked_vs_fcfs", "policy.watermark=0.1,0.2"],  # the experiment's own sweep params
])
def test_a_sweep_job_that_does_not_compose_is_one_line_before_the_sweeps_folder_is_made(tmp_path, overrides):
    # fcfs has a watermark and chunked has not: only the jobs, not the sweep's own config, fail to compose,
    # which Hydra checks after the sweep's folder and multirun.yaml are made, and reports over six lines.
    sweep = tmp_path / "sweep"
    done = cli(*overrides, "executor=sim", *BASE, f"hydra.sweep.dir={sweep}", cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: policy: unknown key watermark; valid: long_prefill_cap_when_alone, long_prefill_token_threshold, "
        "name, preemption_mode, reserve_full_prompt"]
    assert not sweep.exists()


def test_a_sweep_over_an_added_group_takes_an_option_of_that_group(tmp_path):
    # Hydra's sweep applied cluster.num_replicas=2 to its own config, which has no cluster until a job adds it, and
    # the command failed with "config: unknown key cluster".
    sweep = tmp_path / "sweep"
    done = cli("-m", "+cluster=round_robin,least_outstanding", "cluster.num_replicas=2", "executor=sim", *BASE, *TINY,
               "plots=false", f"hydra.sweep.dir={sweep}", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [(s["router"], s["num_replicas"]) for s in summaries] == [("round_robin", 2), ("least_outstanding", 2)]


def test_swept_group_options_are_forced_only_for_groups_a_sweep_adds():
    from framework.harness.overrides import swept_group_options

    assert swept_group_options(["+cluster=round_robin,least_outstanding", "cluster.num_replicas=4", "engine.seed=1",
                                "+policy=fcfs", "policy.preemption_mode=swap", "cluster.router_options.x=1,2"]) == [
        "+cluster=round_robin,least_outstanding", "++cluster.num_replicas=4", "engine.seed=1", "+policy=fcfs",
        "policy.preemption_mode=swap", "cluster.router_options.x=1,2"]


def test_cli_keeps_hydras_traceback_for_a_users_own_hydra_full_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "framework.run", "engine.bogus=1", "executor=sim",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HYDRA_FULL_ERROR": "1"})
    assert done.returncode == 1 and "Traceback" in done.stderr and "ConfigCompositionException" in done.stderr


def test_cli_gives_a_run_folder_it_cannot_make_the_configuration_error_status():
    # It fails after composing and before the job, in one line as every configuration error.
    done = cli("hydra.run.dir=/proc/servelab", "executor=sim", cwd=ROOT)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
        "error: hydra.run.dir=/proc/servelab cannot be made a folder: ")


def test_cli_takes_executor_null_as_its_default(tmp_path):
    # null is the executor group's default (the real forward pass); Hydra refuses a null group
    # override, and the run refused it as a group left without an option. As for any other
    # value, the last one given wins.
    done = cli("executor=sim", "executor=null", *BASE, *TINY, "plots=false", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["executor"] == "model" and summary["completed"] == 6
    assert "executor" not in yaml.safe_load((tmp_path / "config.yaml").read_text())


def test_a_ctrl_c_while_the_summary_is_computed_waits_for_it(tmp_path, monkeypatch):
    # The serving has ended; the Ctrl-C lands in summarize (millions of records take a while).

    from framework.harness import experiment

    def interrupted_summarize(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return summarize(*args, **kwargs)

    summarize = experiment.summarize
    monkeypatch.setattr(experiment, "summarize", interrupted_summarize)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config("executor=sim", "plots=false"), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["completed"] == 6
    assert summary["completed"] == len(read_csv(tmp_path / "requests.csv"))


def test_a_ctrl_c_while_the_plots_are_drawn_leaves_the_summary_with_the_logger(tmp_path, monkeypatch):
    # The plots come after the summary is written (a big run's take seconds); the logger got the
    # summary only after them, so a Ctrl-C there left the tracker's run without any metric.
    from framework.harness.run_logger import RunLogger

    class Recording(RunLogger):
        name = "recording"
        summaries: list = []

        def log_summary(self, summary):
            self.summaries.append(summary)

    def interrupted_plots(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "create_logger", lambda options: Recording())
    monkeypatch.setattr(experiment, "_plots", interrupted_plots)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config("executor=sim"), tmp_path)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in Recording.summaries] == ["completed"]
    assert Recording.summaries[0]["completed"] == written["completed"] == 6


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_run_that_stops_while_drawing_its_plots_finishes_its_logger(tmp_path, monkeypatch, error):
    # The logger's run was left open: W&B ended it unmarked, and the next job of a sweep in the
    # same process logged its metrics into it (wandb.init returns the active run).
    from framework.harness.run_logger import RunLogger

    class Recording(RunLogger):
        name = "recording"
        events: list = []

        def log_summary(self, summary):
            self.events.append(("summary", summary["status"], summary.get("error")))

        def finish(self, interrupted):
            self.events.append(("finish", interrupted))

    def failing_plots(*args, **kwargs):
        raise error

    monkeypatch.setattr(experiment, "create_logger", lambda options: Recording())
    monkeypatch.setattr(experiment, "_plots", failing_plots)
    with pytest.raises(type(error)):
        run_experiment(config("executor=sim"), tmp_path)
    failed = [("summary", "failed", "OSError: disk full")] if isinstance(error, Exception) else []
    assert Recording.events == [("summary", "completed", None), *failed, ("finish", False)]


def test_cli_reports_a_config_the_run_cannot_read_in_one_line(tmp_path):
    # Hydra composes a config without the workload group; the run then finds none to read.
    done = cli("~workload", "executor=sim", *BASE, f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "error: Key 'workload' is not in struct" in done.stderr and "Traceback" not in done.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
def test_cli_reports_a_backend_that_cannot_run_here_cleanly(tmp_path):
    done = cli("backend=flash_attn", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "error: attention backend 'flash_attn' cannot run here: CUDA is not available" in done.stderr
    assert "Traceback" not in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "UnavailableError" in summary["error"]


def test_cli_marks_a_run_that_fails_before_serving_as_failed(tmp_path):
    # The warm-up request needs more steps than the replayed durations hold.
    done = cli("executor=sim", "cost_model.name=replay", "+cost_model.durations=[0.01]", "warmup=1",
               "progress=false", "plots=false", f"hydra.run.dir={tmp_path}", cwd=ROOT)
    assert done.returncode == 1
    assert "Traceback" in done.stderr  # not a configuration error: the traceback is kept
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "replay cost model has 1 recorded steps" in summary["error"]


def test_a_failure_while_serving_is_not_reported_as_a_configuration_error(tmp_path):
    def boom(stats, out):
        raise ValueError("a policy asked for something impossible")

    with pytest.raises(RuntimeError, match="serving failed: ValueError: a policy asked") as exc:
        run_experiment(config(), tmp_path, on_engine=lambda engine: engine.step_callbacks.append(boom))
    assert isinstance(exc.value.__cause__, ValueError)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "impossible" in summary["error"]


def test_a_failure_while_serving_keeps_the_metrics_of_the_requests_finished_before_it(tmp_path):
    # The summary of a failed run used to hold the error and nothing measured, though
    # requests.csv had the finished requests' rows.
    clock = VirtualClock()

    def fail_after_5_steps(engine):
        timed(clock)(engine)
        first = engine.num_steps

        def callback(stats, out):
            if stats.step - first == 5:
                raise RuntimeError("a bug in user code")

        engine.step_callbacks.append(callback)

    with pytest.raises(RuntimeError, match="a bug in user code"):
        run_experiment(config("workload.output_len=[1,12]", "workload.num_requests=8", "plots=false"), tmp_path,
                       clock=clock, on_engine=fail_after_5_steps)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "a bug in user code" in summary["error"]
    rows = read_csv(tmp_path / "requests.csv")
    assert 0 < len(rows) < 8 and summary["completed"] == len(rows)
    assert summary["mean_ttft_ms"] == pytest.approx(100)  # all prefilled in the first 0.1 s step


def test_a_sweep_goes_on_past_a_job_with_a_configuration_error(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "framework.run", "-m", *BASE, *TINY, "slo.tpot_ms=0,50",
                           f"hydra.sweep.dir={sweep}"],
                          cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    bad, good = (json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2))
    assert bad["status"] == "failed" and "slo.tpot_ms must be a positive number" in bad["error"]
    assert good["status"] == "completed" and good["completed"] == 6
    assert "| failed |" in (sweep / "comparison.md").read_text() and "1 run(s) failed" in done.stderr
    # Said before the first job runs, by the value that sets the job apart.
    assert done.stderr.startswith("warning: job 0 (slo.tpot_ms=0) of 2 will fail: slo.tpot_ms must be a positive "
                                  "number"), done.stderr[:500]
    # One line names the error; a configuration error needs no traceback, in a sweep either.
    log = done.stdout + done.stderr  # Hydra logs a job's records to stdout
    assert "error: slo.tpot_ms must be a positive number" in log and "Traceback" not in log


@pytest.mark.parametrize("overrides, errors", [
    # The bad value is every job's: a single run's one line.
    (["+policy=fcfs", "policy.preemption_mode=swapp", "workload.rate=2,4"],
     ["error: preemption_mode must be 'recompute' or 'swap', got 'swapp'"]),
    # Each job's own: a line per error, naming its jobs by their values.
    (["+policy=fcfs", "policy.preemption_mode=swapp,recomp"],
     ["error: preemption_mode must be 'recompute' or 'swap', got 'swapp' (job 0 (policy.preemption_mode=swapp))",
      "error: preemption_mode must be 'recompute' or 'swap', got 'recomp' (job 1 (policy.preemption_mode=recomp))"]),
    (["workload.rate=2,-1", "engine.block_size=3"], ["error: block_size must be a power of two (1, 2, 4, ..., 16, 32, "
                                                     "...), got 3"]),
    # What the cluster, the clock and the executor check of themselves, too.
    (["clock=bogus", "workload.rate=2,4"], ["error: clock must be auto, wall or virtual, got 'bogus'"]),
    (["+executor.foo=1", "workload.rate=2,4"], ["error: executor 'sim': got an unexpected keyword argument 'foo'; its "
                                               "options: hardware, tensor_parallel_size, cost_model, fast_forward, "
                                               "sampled_token"]),
])
def test_a_sweep_whose_every_job_is_refused_is_refused_before_its_first(tmp_path, overrides, errors):
    # Checked only as each job starts, a typo every job shares would cost a sweep folder and a failed run a job.
    sweep = tmp_path / "sweep"
    done = cli("-m", *overrides, "executor=sim", *BASE, *TINY, f"hydra.sweep.dir={sweep}", cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == errors
    assert not sweep.exists()


def test_a_sweeps_check_reads_interpolations_as_its_jobs_do(tmp_path):
    # An override's ${...} is the job's to resolve (the sweep's own config holds the default of a swept key), and
    # ${hydra:...} resolves only in a job: neither may get a sweep refused.
    sweep = tmp_path / "sweep"
    done = cli("-m", "+policy=chunked", "engine.max_num_batched_tokens=64,128",
               "engine.max_num_seqs=${engine.max_num_batched_tokens}", "workload.seed=${hydra:job.num}", "executor=sim",
               "plots=false", *BASE, *TINY, f"hydra.sweep.dir={sweep}", cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for job, tokens in enumerate((64, 128)):
        config = yaml.safe_load((sweep / str(job) / "config.yaml").read_text())
        assert config["engine"]["max_num_seqs"] == tokens and config["workload"]["seed"] == job


def test_a_sweep_its_config_makes_exits_with_the_failed_job_status_in_parallel_too(tmp_path):
    # A named experiment's file sets hydra.mode: MULTIRUN (no -m on the command line); with the
    # jobs in joblib's workers this process started none, and a failed job's status 1 was taken
    # for a configuration error Hydra reported itself (status 2).
    sweep = tmp_path / "sweep"
    done = cli("hydra.mode=MULTIRUN", "hydra/launcher=parallel", "executor=sim", *BASE, *TINY, "plots=false",
               "slo.tpot_ms=0,50", f"hydra.sweep.dir={sweep}", cwd=ROOT)
    assert done.returncode == 1, done.stderr[-3000:]
    assert [json.loads((sweep / str(i) / "summary.json").read_text())["status"] for i in range(2)] == \
        ["failed", "completed"]
    assert "1 run(s) failed" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds joblib's workers through /proc")
def test_a_sweep_whose_worker_the_os_kills_leaves_no_job_running(tmp_path):
    # A joblib worker killed by the OS (out of memory) fails the launcher, which takes the other
    # worker's job down too: their summaries said "running" for good, and no comparison was made.

    sweep = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "framework.run", "-m", "hydra/launcher=parallel",
                             "engine.num_threads=1", *BASE, *TINY, "plots=false", "workload.num_requests=400",
                             "workload.rate=2,4", f"hydra.sweep.dir={sweep}"],
                            cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    summaries = [sweep / str(i) / "summary.json" for i in range(2)]
    deadline = time.monotonic() + 240
    while proc.poll() is None and not all(p.is_file() for p in summaries) and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = children(proc.pid, "LokyProcess")
    assert workers and proc.poll() is None
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    for path in summaries:
        summary = json.loads(path.read_text())
        assert summary["status"] == "failed" and "TerminatedWorkerError" in summary["error"]
    assert [row["status"] for row in read_csv(sweep / "comparison.csv")] == ["failed", "failed"]


@pytest.mark.parametrize("before, status, after", [
    (None, "interrupted", "interrupted"),      # Ctrl-C while the engine was built
    ("running", "interrupted", "interrupted"),
    ("completed", "interrupted", "completed"),  # a second Ctrl-C while the plots were drawn
    ("interrupted", "failed", "failed"),
    ("completed", "failed", "failed"),          # e.g. the logger failed after the summary was written
])
def test_the_summary_says_how_the_run_ended(tmp_path, before, status, after):
    from framework.harness.supervision import mark

    if before is not None:
        (tmp_path / "summary.json").write_text(json.dumps({"status": before, "completed": 3}))
    measured = mark(tmp_path, status, RuntimeError("boom") if status == "failed" else None)
    assert measured is (before is not None)  # what the message after a Ctrl-C says
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == after
    assert summary.get("interrupted", False) is (after == "interrupted")
    assert summary.get("completed") == (3 if before is not None else None)  # nothing measured is lost
    assert ("boom" in summary.get("error", "")) is (after == "failed")


@pytest.mark.parametrize("failure", [None, RuntimeError("worker died")], ids=["interrupted", "launcher-failed"])
def test_a_stopped_sweep_marks_a_job_killed_while_building_its_engine(tmp_path, failure):
    # Killed before run_experiment wrote its "running" summary, a job left only Hydra's .hydra
    # folder: the stopped sweep's marking passed it by, and the comparison left it out unsaid.
    from framework.harness import supervision
    from framework.harness.compare import CompareCallback

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "completed", "completed": 3}))
    (tmp_path / "1" / ".hydra").mkdir(parents=True)
    CompareCallback.sweep_dir = tmp_path
    try:
        supervision.compare_stopped(failure)
    finally:
        CompareCallback.sweep_dir = None
    done, killed = (json.loads((tmp_path / str(i) / "summary.json").read_text()) for i in range(2))
    assert done["status"] == "completed" and done["completed"] == 3
    assert killed["status"] == ("interrupted" if failure is None else "failed")
    assert ("worker died" in killed.get("error", "")) is (failure is not None)


def test_a_ctrl_c_during_a_stopped_sweeps_comparison_ends_the_command_as_interrupted(tmp_path, monkeypatch, capsys):
    # Ctrl-C twice on a sweep (as "interrupt again to stop now" invites): the second one may land
    # while the first one's handler writes the comparison (matplotlib's import and the plots take
    # seconds). It escaped as a KeyboardInterrupt traceback raised inside the first one's handling.

    from framework.harness import run, supervision
    from framework.harness.compare import CompareCallback

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "interrupted", "completed": 3}))

    def stopped_sweep(*_):
        raise KeyboardInterrupt  # the first Ctrl-C, stopping the sweep

    def comparison_interrupted():
        raise KeyboardInterrupt  # the second, while the comparison is written

    monkeypatch.setattr(run, "main", stopped_sweep)
    monkeypatch.setattr(supervision, "compare_stopped_sweep", comparison_interrupted)
    monkeypatch.setattr(sys, "argv", ["framework.run", "-m"])
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    CompareCallback.sweep_dir = tmp_path
    try:
        with pytest.raises(SystemExit) as exit_:
            try:
                run.cli()
            except KeyboardInterrupt:
                pytest.fail("the Ctrl-C during the comparison escaped the command's handling (a traceback)")
    finally:
        CompareCallback.sweep_dir = None
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert exit_.value.code == 130
    assert "interrupted" in capsys.readouterr().err
    assert json.loads((tmp_path / "0" / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("sig, env", [(signal.SIGTERM, {}), (signal.SIGUSR2, {"SUBMITIT_EXECUTOR": "slurm"})])
def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path, sig, env):
    """A batch scheduler's time limit (or ``kill``) sends SIGTERM, Submitit's jobs get USR2 before it: the run
    keeps what it measured, its summary says ``interrupted`` and counts the rows written, and the status is 143."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "framework.run", "workload.num_requests=5000", "progress=false",
                             "plots=false", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    def rows_written():
        path = tmp_path / "requests.csv"
        return len(read_csv(path)) if path.exists() else 0

    deadline = time.monotonic() + 240
    while proc.poll() is None and rows_written() < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 5 <= summary["completed"] == len(read_csv(tmp_path / "requests.csv"))


def test_a_repeated_interrupt_is_dropped_until_the_summary_is_written():
    # A parallel sweep's worker gets a terminal's Ctrl-C twice (from the terminal, and forwarded
    # by its parent): the second, while the first stops the run, must not cost it its summary.

    from framework.harness.experiment import _repeats_dropped

    with _repeats_dropped():
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # dropped
    with pytest.raises(KeyboardInterrupt):  # the block's end gives Ctrl-C back
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _fake_worker(sweep_dir, insist):
    """A stand-in for a loky worker serving job 0 of ``sweep_dir``: SIGINT makes it write the
    job's ``interrupted`` summary a moment later; with ``insist`` it ignores SIGINT."""

    def stop(signum, frame):
        time.sleep(0.3)
        (sweep_dir / "0" / "summary.json").write_text(json.dumps({"status": "interrupted", "completed": 3}))
        os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN if insist else stop)
    time.sleep(60)


@pytest.mark.parametrize("insist, building", [(False, False), (True, False), (False, True)],
                         ids=["waits-for-the-summary", "second-ctrl-c-stops-waiting", "waits-for-a-job-building-its-engine"])
def test_a_parallel_sweeps_parent_forwards_an_interrupt_and_waits_for_the_jobs(tmp_path, insist, building):
    import multiprocessing
    import threading

    from framework.harness import supervision
    from framework.harness.compare import CompareCallback

    (tmp_path / "0" / ".hydra").mkdir(parents=True)  # Hydra writes it as the job starts
    if not building:  # a job building its engine has written no summary yet (run_experiment writes "running" next)
        (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "running"}))
    # Named as loky's processes, which the parent looks for among its children.
    LokyProcess = type("LokyProcess", (multiprocessing.get_context("fork").Process,), {})
    worker = LokyProcess(target=_fake_worker, args=(tmp_path, insist), daemon=True)
    worker.start()
    previous = signal.signal(signal.SIGINT, supervision.stop)
    CompareCallback.sweep_dir = tmp_path
    again = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    try:
        time.sleep(0.5)  # the worker's handler is set
        start = time.monotonic()
        if insist:
            again.start()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        waited = time.monotonic() - start
    finally:
        again.cancel()
        signal.signal(signal.SIGINT, previous)
        CompareCallback.sweep_dir = None
        worker.kill()
        worker.join()
    status = json.loads((tmp_path / "0" / "summary.json").read_text())["status"]
    if insist:  # the worker did not answer; the second Ctrl-C ended the wait long before its limit
        assert status == "running" and 1.4 < waited < 10
    else:  # the worker got the signal and the parent waited for its summary
        assert status == "interrupted" and 0.25 < waited < 10


@pytest.mark.parametrize("entry, message", [
    ({"prompt_token_ids": [10**9], "output_len": 4}, r"prompt_token_ids must be a non-empty list of ids in \[0, 1024\)"),
    ({"prompt_len": 10, "output_len": 4, "arrival_time": -1}, "arrival_time must be a number >= 0"),
    ({"prompt_len": 10, "output_len": 0}, "output_len must be an integer >= 1"),
])
def test_a_bad_trace_entry_is_refused_before_an_engine_is_built(tmp_path, monkeypatch, entry, message):
    """A trace's entries were read only after the engine was built, its KV cache allocated and warmed up."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(entry) + "\n")
    monkeypatch.setattr(experiment, "build_cluster", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(ValueError, match=message):
        run_experiment(config("workload=trace", f"workload.path={trace}", workload=[]), tmp_path / "run")


def test_the_workload_is_drawn_with_what_the_engine_would_tell_it():
    """``workload_context`` without an engine: the model's vocabulary, max_model_len as resolved, and the
    executor's tokenizer (none for a preset, none for the simulator)."""
    from framework import LLMEngine

    cfg = config("engine.max_model_len=null", "engine.max_num_batched_tokens=null", "engine.num_gpu_blocks_override=300")
    engine_config = experiment.engine_config(cfg)
    context = experiment.workload_context(engine_config)
    engine = LLMEngine(experiment.engine_config(cfg))
    assert (context.vocab_size, context.tokenizer, context.max_model_len) == (
        engine.model_config.vocab_size, engine.tokenizer, engine.config.max_model_len)


def test_warm_up_requests_fit_the_token_budget_and_a_refused_one_is_a_warning(caplog):
    """A budget of 24 tokens without chunked prefills: the warm-up prompts fit it and run (a fixed 32-token
    prompt would be ignored); where the policy refuses them all, a warning says so."""
    import logging

    from framework import EngineConfig, LLMEngine

    common = dict(model="tiny-llama", max_model_len=64, max_num_batched_tokens=24, max_num_seqs=8, block_size=16)
    engine = LLMEngine(EngineConfig(**common), max_prompt_len=24)  # the workload's longest prompt
    decoded = []
    engine.step_callbacks.append(lambda stats, out: decoded.append(stats.num_decode_tokens))
    with caplog.at_level(logging.WARNING, logger="framework.harness.experiment"):
        experiment.warm_up(engine, 2)
    assert not caplog.records and sum(decoded) == 2 * 3, "each warm-up request decodes after its first token"
    strict = LLMEngine(EngineConfig(**common, num_gpu_blocks_override=17, policy="fcfs",
                                    policy_options={"watermark": 0.95}), max_prompt_len=24)
    with caplog.at_level(logging.WARNING, logger="framework.harness.experiment"):
        experiment.warm_up(strict, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "2 of 2 warm-up requests did not run (prompt of 24 tokens needs 2 KV blocks but policy 'fcfs' admits at most "
        "1 (watermark=0.95 keeps 15 of 16 free)): one-time costs land on the measured requests"]


@pytest.mark.parametrize("overrides, message", [
    (["executor=sim", "executor.tensor_parallel_size=3"], "tensor_parallel_size=3 must be >= 1 and divide"),
    (["executor=sim", "+cost_model.nope=1"], "unknown roofline option"),
    (["executor=sim", "engine.num_gpu_blocks_override=null", "engine.kv_cache_memory_gb=0.00001"],
     "the KV cache holds 0 blocks"),
    (["engine.num_gpu_blocks_override=4"], r"the KV cache holds 3 blocks x 16 tokens = 48 tokens, less than one "
                                           r"request of max_model_len=128; raise num_gpu_blocks_override \(now 4\)"),
    (["logger=wandb", "logger.mode=bogus"], "logger.mode must be one of"),
    (["repeat=-1"], "repeat must be an integer >= 0"),
    (["clock=sundial"], "clock must be auto, wall or virtual, got 'sundial'"),
    (["executor=sim", "clock=wall"], "executor=sim runs on simulated time: use clock=auto or clock=virtual"),
    (["executor=sim", "+cluster=round_robin", "cluster.router=nope"], "unknown router 'nope'; registered routers: "),
    (["executor=sim", "+cluster=round_robin", "+cluster.replicas=4"],
     r"cluster: unknown key\(s\) replicas; valid: num_replicas, router, router_options"),
])
def test_what_would_fail_every_job_is_refused_by_the_check_before_a_run(overrides, message, monkeypatch):
    """A sweep's pre-check runs check_experiment on each job: a simulated device, cost model and KV cache, a KV cache
    given in blocks, the logger's options and the repeat index are refused there, before any model is built."""
    monkeypatch.setattr(EXECUTORS.get("model"), "__init__", lambda *a, **k: pytest.fail("a model executor was built"))
    with pytest.raises(ValueError, match=message):
        experiment.check_experiment(config(*overrides))


def test_a_kv_cache_too_small_for_a_request_is_refused_before_the_weights_are_built(monkeypatch):
    from framework import LLMEngine
    from models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "empty_on", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match=r"the KV cache holds 0 blocks .* raise cpu_kv_cache_gb \(now 1e-05\)"):
        LLMEngine(model="tiny-llama", device="cpu", cpu_kv_cache_gb=0.00001, max_model_len=128)


def test_the_check_builds_the_simulator_but_no_other_executor_on_simulated_time(monkeypatch):
    """A plugin running the real forward pass on simulated time loads weights when built: the check (once per job in
    a sweep's pre-check, again in each run) must not build it."""
    from omegaconf import OmegaConf

    from framework.execution.executors.model import ModelExecutor

    class VirtualTimeModel(ModelExecutor):
        @classmethod
        def make_clock(cls):
            return VirtualClock()

        def __init__(self, *args, **kwargs):
            pytest.fail("the check built an executor that loads weights")

    forget_registrations(monkeypatch, EXECUTORS)
    EXECUTORS.register("virtual_time_model_for_test")(VirtualTimeModel)
    cfg = config()
    OmegaConf.update(cfg, "executor", {"name": "virtual_time_model_for_test"}, force_add=True)
    assert experiment.check_experiment(cfg)[0].executor == "virtual_time_model_for_test"
