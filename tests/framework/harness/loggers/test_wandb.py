"""W&B logging: an offline run directory holding what was logged; nothing W&B without it; a
failing W&B never fails the run."""
import json
import struct
import time
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from framework.common.clock import VirtualClock
from framework.harness.experiment import run_experiment
from framework.harness.loggers.wandb import WandbLogger, resolve_mode
from tests.hydra_support import compose_config

ROOT = Path(__file__).resolve().parents[4]
TINY = ["workload.num_requests=3", "workload.prompt_len=[8,16]", "workload.output_len=[2,3]", "progress=false",
        "engine.max_model_len=64", "engine.num_gpu_blocks_override=16"]


def config(*overrides):
    return compose_config(*TINY, *overrides)


def wandb_records(path):
    """Records of a ``.wandb`` transaction log: a 7-byte header, then LevelDB-log framing (32 KiB
    blocks; each chunk a 7-byte header of crc32, length and type FULL/FIRST/MIDDLE/LAST)."""
    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        if pos + 7 + length > len(data):
            break  # a chunk W&B's service is still writing: complete_records reads again
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def complete_records(run_file, timeout=30.0):
    """The run's records once its ``exit`` record is on disk: W&B's service process writes the
    log asynchronously and may still be flushing when ``finish()`` returns."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(run_file))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def logged_keys(run_file):
    keys = {"config": set(), "history": set(), "summary": set(), "group": set(), "kinds": []}
    for r in complete_records(run_file):
        kind = r.WhichOneof("record_type")
        keys["kinds"].append(kind)
        if kind == "run":
            keys["config"] |= {i.key for i in r.run.config.update}
            keys["group"].add(r.run.run_group)
        elif kind == "config":
            keys["config"] |= {i.key for i in r.config.update}
        elif kind == "history":
            keys["history"] |= {i.key or "/".join(i.nested_key) for i in r.history.item}
        elif kind == "summary":
            keys["summary"] |= {i.key or "/".join(i.nested_key) for i in r.summary.update}
    return keys


def test_offline_run_directory_holds_the_logged_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no key configured: offline by default
    monkeypatch.setenv("HOME", str(tmp_path))
    run_dir = tmp_path / "run"
    clock = VirtualClock()
    summary = run_experiment(config("logger=wandb", "logger.project=servelab-test"), run_dir, clock=clock,
                             on_engine=lambda e: e.step_callbacks.append(lambda s, o: clock.advance(0.01)),
                             group="multirun/sweep-1")
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    keys = logged_keys(next(offline[0].glob("run-*.wandb")))
    assert "exit" in keys["kinds"], keys["kinds"]
    assert {"engine", "workload", "slo", "logger", "engine_config"} <= keys["config"], keys["kinds"]
    assert {"step/time_s", "step/num_scheduled_tokens", "step/kv_usage", "step/num_running"} <= keys["history"]
    assert any(k.startswith("requests") for k in keys["history"])  # the per-request table
    assert {"plots/latency_cdf", "plots/timeline"} <= {k.split("/")[0] + "/" + k.split("/")[1]
                                                       for k in keys["history"] if k.startswith("plots/")}
    assert {"request_throughput", "mean_ttft_ms", "p99_e2el_ms", "interrupted"} <= keys["summary"]
    assert keys["group"] == {"multirun/sweep-1"}
    assert summary["status"] == "completed"


def test_a_simulated_cluster_run_logs_the_same_with_replicas(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))
    run_dir = tmp_path / "run"
    summary = run_experiment(config("logger=wandb", "logger.project=servelab-test", "executor=sim", "+cluster=round_robin",
                                    "workload.num_requests=6", "workload.output_len=[20,30]"), run_dir)
    offline, = (run_dir / "wandb").glob("offline-run-*")
    keys = logged_keys(next(offline.glob("run-*.wandb")))
    # Steps of decode runs reach W&B as rows like any other (the recorder expands them).
    assert {"step/replica", "step/time_s", "step/num_decode_tokens", "step/kv_usage"} <= keys["history"]
    assert any(k.startswith("requests") for k in keys["history"])
    assert {"num_replicas", "router", "hardware", "mean_tpot_ms"} <= keys["summary"]
    assert summary["status"] == "completed" and summary["num_replicas"] == 2


def test_logger_none_creates_nothing_wandb(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_experiment(config(), tmp_path / "run")
    assert not list(tmp_path.rglob("*wandb*"))


def test_an_unreachable_wandb_never_fails_the_run(tmp_path, monkeypatch, caplog):
    import wandb

    def unreachable(*args, **kwargs):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(wandb, "init", unreachable)
    summary = run_experiment(config("logger=wandb", "logger.mode=online"), tmp_path)
    assert summary["status"] == "completed" and (tmp_path / "requests.csv").exists()
    assert "switched off" in caplog.text and "unreachable" in caplog.text


def test_online_failure_falls_back_to_offline(tmp_path, monkeypatch):
    import wandb

    real_init, modes = wandb.init, []

    def online_fails(*args, mode=None, **kwargs):
        modes.append(mode)
        if mode == "online":
            raise ConnectionError("no network")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", online_fails)
    run_experiment(config("logger=wandb", "logger.mode=online"), tmp_path)
    assert modes == ["online", "offline"]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1


def test_wandb_mode_run_is_online_and_falls_back_to_offline(tmp_path, monkeypatch):
    # W&B takes WANDB_MODE=run as online; it reached wandb.init as "run", whose failed start was
    # not retried offline, so the run went unlogged.
    import wandb

    real_init, modes = wandb.init, []

    def online_fails(*args, mode=None, **kwargs):
        modes.append(mode)
        if mode in ("online", "run"):
            raise ConnectionError("no network")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setenv("WANDB_MODE", "run")
    monkeypatch.setattr(wandb, "init", online_fails)
    run_experiment(config("logger=wandb"), tmp_path)
    assert modes == ["online", "offline"]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1


def test_mode_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_mode(None) == "offline"
    assert resolve_mode("disabled") == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert resolve_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_mode(None) == "offline" and resolve_mode("online") == "online"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    (tmp_path / "netrc").chmod(0o600)
    assert resolve_mode(None) == "online"


def test_long_timelines_are_thinned_geometrically():
    class FakeRun:
        def __init__(self):
            self.logged = []

        def log(self, row):
            self.logged.append(row["step/step"])

    logger = WandbLogger(max_step_rows=4)
    logger.run = FakeRun()
    for step in range(1, 41):
        logger.log_step({"step": step})
    # Steps 1-4, then every 2nd (5, 7), every 4th (9, 13), every 8th (17, 25), every 16th (33).
    assert logger.run.logged == [1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33]
    every = WandbLogger(max_step_rows=None)
    every.run = FakeRun()
    for step in range(1, 41):
        every.log_step({"step": step})
    assert every.run.logged == list(range(1, 41))
    with pytest.raises(ValueError, match="max_step_rows must be a positive integer or null"):
        WandbLogger(max_step_rows=0)


def test_bad_mode_is_a_configuration_error(tmp_path):
    with pytest.raises(ValueError, match="logger.mode must be one of online, offline, disabled"):
        run_experiment(config("logger=wandb", "logger.mode=sometimes"), tmp_path)


def logged_summary_and_exit_code(run_file):
    """The last value of every summary key, and the run's exit code."""
    summary, exit_code = {}, None
    for r in complete_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
        elif kind == "exit":
            exit_code = r.exit.exit_code
    return summary, exit_code


def test_a_run_that_fails_while_serving_is_logged_as_failed_with_its_metrics(tmp_path, monkeypatch):
    """W&B used to show such a run as finished (exit code 0) with none of what summary.json holds:
    the status, the error and the metrics of the requests finished before the failure."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))
    run_dir = tmp_path / "run"
    clock = VirtualClock()

    def fail_after_3_steps(engine):
        first = engine.num_steps

        def callback(stats, out):
            clock.advance(0.01)
            if stats.step - first == 3:
                raise RuntimeError("a bug in user code")

        engine.step_callbacks.append(callback)

    with pytest.raises(RuntimeError, match="a bug in user code"):
        run_experiment(config("logger=wandb", "workload.num_requests=8", "workload.output_len=[1,8]", "plots=false"),
                       run_dir, clock=clock, on_engine=fail_after_3_steps)
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["status"] == "failed" and saved["completed"] > 0
    offline, = (run_dir / "wandb").glob("offline-run-*")
    summary, exit_code = logged_summary_and_exit_code(next(offline.glob("run-*.wandb")))
    assert exit_code != 0
    for key in ("status", "error", "completed", "mean_ttft_ms", "duration_s"):
        assert summary[key] == pytest.approx(saved[key]), key


@pytest.mark.parametrize("override, message", [
    # list("abc") tagged the run 'a', 'b' and 'c'.
    ("logger.tags=abc", r"logger.tags must be a list of tags .* got 'abc'"),
    # W&B refused these at start: the run went on unlogged, with a warning.
    ("logger.init_timeout=abc", "logger.init_timeout must be a number of seconds > 0, got 'abc'"),
    ("logger.init_timeout=-1", "logger.init_timeout must be a number of seconds > 0, got -1"),
])
def test_bad_options_are_configuration_errors(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        run_experiment(config("logger=wandb", override), tmp_path)


def test_names_hydra_reads_as_numbers_reach_wandb_as_strings(tmp_path, monkeypatch, caplog):
    """``logger.group=2024`` is an int to Hydra; W&B refused it and the run went unlogged."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))
    run_dir = tmp_path / "run"
    run_experiment(config("logger=wandb", "logger.project=servelab-test", "logger.group=2024", "logger.tags=[7,v2]"),
                   run_dir)
    assert "switched off" not in caplog.text
    offline, = (run_dir / "wandb").glob("offline-run-*")
    run, = [r.run for r in complete_records(next(offline.glob("run-*.wandb"))) if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "2024" and list(run.tags) == ["7", "v2"]


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_an_init_timeout_of_no_seconds_is_a_configuration_error(timeout):
    with pytest.raises(ValueError, match="logger.init_timeout must be a number of seconds > 0"):
        WandbLogger(init_timeout=timeout)
