"""``framework.compare`` on hand-made run folders, and a tiny multirun end to end."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from framework.harness.compare import comparison_rows, label_keys, main, write_comparison
from tests.hydra_support import read_csv

ROOT = Path(__file__).resolve().parents[3]
PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(path, policy, rate, throughput, p99_ttft, preemption_mode="recompute", caching=True, prio=False):
    path.mkdir(parents=True)
    config = {"policy": {"name": policy, "preemption_mode": preemption_mode, "budget": 3 if policy == "b" else None},
              "workload": {"name": "synthetic", "rate": rate, "seed": 0},
              "engine": {"enable_prefix_caching": caching}, "hydra_like_noise": None, "progress": rate is None}
    summary = {"status": "completed", "policy": policy, "backend": "naive", "rate": rate, "completed": 8,
               "output_throughput": throughput, "request_throughput": throughput / 10, "p99_ttft_ms": p99_ttft,
               "p99_tpot_ms": 5.0, "p99_e2el_ms": 50.0}
    if prio:
        summary["prio0_p99_ttft_ms"] = 1.5
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def sweep(tmp_path):
    """A multirun-like tree: policies a and b at rates 2 and 4 (folders numbered as Hydra does)."""
    root = tmp_path / "multirun" / "12-00-00"
    for i, (policy, rate, tput, ttft) in enumerate([("a", 2, 100.0, 10.0), ("a", 4, 150.0, 30.0),
                                                    ("b", 2, 110.0, 8.0), ("b", 4, 190.0, 12.0)]):
        fake_run(root / str(i), policy, rate, tput, ttft)
    return root


def test_rows_are_labelled_by_what_differs(sweep):
    rows = comparison_rows([sweep])
    assert [(r["label"], r["x"], r["output_throughput"]) for r in rows] == [
        ("policy=a", 2, 100.0), ("policy=a", 4, 150.0), ("policy=b", 2, 110.0), ("policy=b", 4, 190.0)]


def test_a_folder_of_numbered_and_named_runs_is_compared(tmp_path):
    # Sorting the runs compared a folder number with a folder name: a TypeError traceback.
    for name, policy in [("10", "a"), ("baseline", "b"), ("2", "a")]:
        fake_run(tmp_path / name, policy, 4, 1.0, 1.0)
    assert main([str(tmp_path), "--out", str(tmp_path / "cmp")]) == 0
    assert [Path(r["run_dir"]).name for r in comparison_rows([tmp_path], label=["workload.seed"])] == \
        ["2", "10", "baseline"]  # numbers in numeric order, before names


def test_label_keys_skip_options_of_a_part_whose_name_differs():
    flats = [{"policy.name": "a", "policy.budget": None, "workload.rate": 2, "hydra.x": 1, "engine.e": True},
             {"policy.name": "b", "policy.budget": 3, "workload.rate": 4, "hydra.x": 2, "engine.e": False}]
    assert label_keys(flats, "workload.rate") == ["engine.e", "policy.name"]


def test_options_and_engine_keys_label_runs_of_one_policy(tmp_path):
    fake_run(tmp_path / "0", "a", 2, 1.0, 1.0, preemption_mode="swap")
    fake_run(tmp_path / "1", "a", 2, 1.0, 1.0, preemption_mode="recompute")
    fake_run(tmp_path / "2", "a", 2, 1.0, 1.0, caching=False)
    labels = [r["label"] for r in comparison_rows([tmp_path])]
    assert labels == ["enable_prefix_caching=False, preemption_mode=recompute",
                      "enable_prefix_caching=True, preemption_mode=recompute",
                      "enable_prefix_caching=True, preemption_mode=swap"]
    assert [r["label"] for r in comparison_rows([tmp_path], label=["preemption_mode"])] == \
        ["preemption_mode=recompute", "preemption_mode=recompute", "preemption_mode=swap"]


def test_writes_table_and_plots(sweep, tmp_path):
    paths = write_comparison([sweep], tmp_path / "out")
    md = paths["markdown"].read_text().splitlines()
    assert md[0].startswith("| label | workload.rate | n_repeats | status |") and md[2 + 4] == ""
    assert "| policy=b | 4 | 1 | completed | 8 |" in md[2 + 3]
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [(r["label"], r["workload.rate"], r["n_repeats"], r["p99_ttft_ms"]) for r in rows][-1] == \
        ("policy=b", "4", "1", "12.0")
    for key in ("throughput", "latency"):
        assert paths[key].name.endswith("_vs_rate.png") and paths[key].read_bytes()[:8] == PNG
        assert paths[key].with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"


def test_single_runs_without_rates_get_bar_charts(tmp_path):
    fake_run(tmp_path / "x", "a", None, 1.0, 1.0, prio=True)
    fake_run(tmp_path / "y", "b", None, 2.0, 1.0, prio=True)
    paths = write_comparison([tmp_path / "x", tmp_path / "y"], tmp_path / "cmp")
    assert paths["throughput"].read_bytes()[:8] == PNG
    assert "prio0_p99_ttft_ms" in paths["markdown"].read_text().splitlines()[0]


def test_cli(sweep, tmp_path, capsys):
    assert main([str(sweep), "--out", str(tmp_path / "c"), "--label", "policy"]) == 0
    assert "| policy=a | 2 |" in capsys.readouterr().out
    assert main([str(tmp_path / "empty")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no runs" in capsys.readouterr().err
    assert main([str(sweep), "--label", "colour"]) == 2
    # The error names the keys worth passing; it used to name none (--label) or two fixed examples (--x).
    differ = "keys that differ between these runs: policy.budget, policy.name, workload.rate"
    assert f"--label key 'colour' is not in the runs' configs; {differ}" in capsys.readouterr().err
    # A misspelt --x used to write a table and plots with every run at x = "-".
    assert main([str(sweep), "--out", str(tmp_path / "d"), "--x", "workload.rte"]) == 2
    assert f"--x key 'workload.rte' is not in the runs' configs; {differ}" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    assert main([str(sweep), "--out", str(tmp_path / "d"), "--x", "engine.enable_prefix_caching"]) == 0
    # An --out where no folder can be made was a FileExistsError / NotADirectoryError traceback.
    (tmp_path / "file").write_text("")
    assert main([str(sweep), "--out", str(tmp_path / "file")]) == 2
    assert f"error: {tmp_path / 'file'} is not a directory (the table and plots" in capsys.readouterr().err
    assert main([str(sweep), "--out", str(tmp_path / "file" / "sub")]) == 2
    assert f"error: {tmp_path / 'file' / 'sub'}: Not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("name, text, problem", [
    ("summary.json", '{"status": "runn', "not valid JSON: "),
    ("summary.json", "[1, 2]", "a list where a mapping belongs"),
    ("config.yaml", "policy: [", "not valid YAML: "),
    ("config.yaml", "- fcfs", "a list where a mapping belongs"),
])
def test_a_run_file_that_is_no_mapping_is_an_error_naming_it(sweep, capsys, name, text, problem):
    # These used to fail naming no file: json's or YAML's own message, or an AttributeError traceback.
    (sweep / "1" / name).write_text(text)
    assert main([str(sweep)]) == 2
    assert f"error: {sweep / '1' / name}: not a run's file ({problem}" in capsys.readouterr().err


def test_tiny_multirun_end_to_end(tmp_path):
    """2 preemption modes x 2 rates through the CLI, then the comparison of the sweep."""
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(
        [sys.executable, "-m", "framework.run", "-m", "+policy=fcfs", "policy.preemption_mode=recompute,swap",
         "workload.rate=20,40", "workload.num_requests=3", "workload.prompt_len=[8,16]", "workload.output_len=[2,4]",
         "engine.max_model_len=64", "engine.num_gpu_blocks_override=16", "progress=false", "plots=false",
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [json.loads((sweep_dir / str(i) / "summary.json").read_text()) for i in range(4)]
    assert [s["status"] for s in summaries] == ["completed"] * 4
    assert {(s["preemption_mode"], s["rate"]) for s in summaries} == {(m, r) for m in ("recompute", "swap") for r in (20, 40)}
    # The multirun compared its own runs at its root.
    table = (sweep_dir / "comparison.md").read_text()
    assert table.count("| preemption_mode=") == 4
    paths = write_comparison([sweep_dir], tmp_path / "cmp")
    assert [r["label"] for r in comparison_rows([sweep_dir])] == ["preemption_mode=recompute"] * 2 + ["preemption_mode=swap"] * 2
    assert paths["throughput"].read_bytes()[:8] == PNG and paths["latency"].read_bytes()[:8] == PNG
    assert paths["latency_cdf"].read_bytes()[:8] == PNG  # from the runs' requests.csv


def test_multirun_callback_compares_and_fails_the_sweep_if_a_run_failed(sweep, capsys):
    from omegaconf import OmegaConf

    from framework.harness.compare import CompareCallback

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    CompareCallback().on_multirun_end(config)
    assert (sweep / "comparison.md").exists()
    summary = json.loads((sweep / "3" / "summary.json").read_text())
    (sweep / "3" / "summary.json").write_text(json.dumps({**summary, "status": "failed"}))
    with pytest.raises(SystemExit) as exc:
        CompareCallback().on_multirun_end(config)
    assert exc.value.code == 1 and "1 run(s) failed" in capsys.readouterr().err
    assert "| failed |" in (sweep / "comparison.md").read_text()


def test_a_groups_config_file_labels_runs_where_its_options_differ(tmp_path):
    # workload=chat against workload=poisson: both 'synthetic', with different options.
    for i, (preset, mean) in enumerate([("chat", 256), ("poisson", None)]):
        fake_run(tmp_path / str(i), "a", 2, 1.0, 1.0)
        config = yaml.safe_load((tmp_path / str(i) / "config.yaml").read_text())
        config["workload"]["prompt_len"] = {"mean": mean}
        (tmp_path / str(i) / "config.yaml").write_text(yaml.safe_dump(config))
        (tmp_path / str(i) / ".hydra").mkdir()
        (tmp_path / str(i) / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(
            {"hydra": {"runtime": {"choices": {"workload": preset, "model": "tiny-llama", "executor": None,
                                               "hydra/launcher": "basic"}}}}))
    assert [r["label"] for r in comparison_rows([tmp_path])] == ["workload=chat", "workload=poisson"]
    # A part whose name differs is still labelled by the name, its config file aside.
    flats = [{"policy.name": "a", "policy.preset": "x", "policy.budget": 1, "workload.rate": 2},
             {"policy.name": "b", "policy.preset": "y", "policy.budget": 2, "workload.rate": 2}]
    assert label_keys(flats, "workload.rate") == ["policy.name"]


def test_a_simulated_run_on_the_default_device_is_labelled_with_its_name(tmp_path):
    # +hardware=h100-sxm against no +hardware (the sim's default, a100-80gb, named by the summary).
    for i, hardware in enumerate(["h100-sxm", None]):
        fake_run(tmp_path / str(i), "a", 2, 1.0, 1.0)
        summary = json.loads((tmp_path / str(i) / "summary.json").read_text())
        summary["hardware"] = hardware or "a100-80gb"
        (tmp_path / str(i) / "summary.json").write_text(json.dumps(summary))
        if hardware:
            config = yaml.safe_load((tmp_path / str(i) / "config.yaml").read_text())
            config["hardware"] = {"name": hardware, "peak_tflops": 989.0}
            (tmp_path / str(i) / "config.yaml").write_text(yaml.safe_dump(config))
    assert [r["label"] for r in comparison_rows([tmp_path])] == ["hardware=a100-80gb", "hardware=h100-sxm"]


def test_an_option_swept_beside_its_parts_name_labels_the_runs_it_tells_apart():
    # workload=poisson,chat x workload.num_requests=20,40: four configurations, four labels.
    flats = [{"workload.preset": w, "workload.num_requests": n, "workload.prompt_len": w, "workload.rate": 8}
             for w in ("chat", "poisson") for n in (20, 40)]
    assert label_keys(flats, "workload.rate") == ["workload.num_requests", "workload.preset"]


def test_a_run_that_failed_on_its_configuration_is_labelled_like_the_others(sweep):
    """It wrote no config.yaml and its summary names no parts: Hydra's copy of its config says what
    it was, and the labels come from the runs that ran, so one failure does not turn every key
    into a label."""
    failed = sweep / "4"
    (failed / ".hydra").mkdir(parents=True)
    config = yaml.safe_load((sweep / "3" / "config.yaml").read_text())
    config["workload"]["rate"] = -1
    (failed / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "error": "ValueError: rate"}))
    rows = comparison_rows([sweep])
    assert [(r["label"], r["x"], r["status"]) for r in rows] == [
        ("policy=a", 2, "completed"), ("policy=a", 4, "completed"), ("policy=b", -1, "failed"),
        ("policy=b", 2, "completed"), ("policy=b", 4, "completed")]


def test_a_failed_run_differing_in_a_key_the_others_share_is_labelled_by_it(tmp_path):
    """-m engine.block_size=16,3: the run with 3 fails on its configuration. Its label used to be
    computed from the run that ran alone, so both rows read 'a/naive' and the table did not say
    which configuration failed."""
    fake_run(tmp_path / "0", "a", None, 1.0, 1.0)
    config = yaml.safe_load((tmp_path / "0" / "config.yaml").read_text())
    config["engine"]["block_size"] = 16
    (tmp_path / "0" / "config.yaml").write_text(yaml.safe_dump(config))
    failed = tmp_path / "1"
    (failed / ".hydra").mkdir(parents=True)
    config["engine"]["block_size"] = 3
    (failed / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "error": "ValueError: block_size"}))
    rows = comparison_rows([tmp_path])
    assert [(r["label"], r["status"]) for r in rows] == [("block_size=3", "failed"), ("block_size=16", "completed")]


def test_a_sweep_stopped_by_ctrl_c_compares_the_runs_it_made(sweep, capsys):
    from omegaconf import OmegaConf

    from framework.harness.compare import CompareCallback, compare_stopped_sweep

    assert compare_stopped_sweep() is None  # no sweep under way
    CompareCallback().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    summary = json.loads((sweep / "3" / "summary.json").read_text())
    (sweep / "3" / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "completed": 2}))
    table = compare_stopped_sweep()
    assert table == sweep / "comparison.md"
    assert table.read_text().count("| policy=") == 4 and "| interrupted |" in table.read_text()
    assert compare_stopped_sweep() is None  # once


def test_ctrl_c_in_a_sweep_through_the_cli_keeps_a_comparison(tmp_path):
    """Ctrl-C (SIGINT to the process group) in the second job: status 130, both jobs' files kept,
    and the table of both at the sweep's root."""
    import signal
    import time

    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "framework.run", "-m", "workload.num_requests=2,5000", "progress=false", "plots=false",
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (sweep_dir / "1" / "steps.csv").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    statuses = [json.loads((sweep_dir / str(i) / "summary.json").read_text())["status"] for i in range(2)]
    assert statuses == ["completed", "interrupted"]
    table = (sweep_dir / "comparison.md").read_text()
    assert "| completed |" in table and "| interrupted |" in table and "comparison of the runs so far" in err


def start_parallel_sweep(sweep_dir, new_session=False):
    """A two-job joblib sweep, returned once both jobs are serving (each has written a row of
    ``requests.csv``: a finished request, so an interrupted job has metrics to keep)."""
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "framework.run", "-m", "hydra/launcher=parallel", "engine.num_threads=1",
         "workload.num_requests=5000", "workload.rate=20,40", "progress=false", "plots=false",
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=new_session)

    def serving(i):
        path = sweep_dir / str(i) / "requests.csv"
        return path.is_file() and len(path.read_text().splitlines()) > 1

    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not all(serving(i) for i in range(2)):
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return proc


def assert_stopped_with_metrics(sweep_dir):
    """Every job of the sweep says ``interrupted`` and keeps its metrics: those of the requests
    whose rows are in its requests.csv (counted here), and the comparison shows both jobs."""
    for i in range(2):
        summary = json.loads((sweep_dir / str(i) / "summary.json").read_text())
        rows = read_csv(sweep_dir / str(i) / "requests.csv")
        assert summary["status"] == "interrupted" and summary["interrupted"] is True
        assert rows and summary["completed"] + summary["failed"] == len(rows)
        assert summary["request_throughput"] > 0 and summary["mean_ttft_ms"] > 0
    rows = read_csv(sweep_dir / "comparison.csv")
    assert [row["status"] for row in rows] == ["interrupted", "interrupted"]
    assert all(float(row["request_throughput"]) > 0 for row in rows)


@pytest.mark.parametrize("group", [False, True], ids=["parent-only", "process-group"])
def test_a_parallel_sweep_interrupted_keeps_every_jobs_metrics(tmp_path, group):
    """``kill -INT`` to the parent only (a scheduler's or a supervisor's): the parent forwards it to
    its workers and waits for their summaries, which joblib's SIGKILL on the parent's interrupt
    used to cut short (``interrupted``, no metrics). A terminal's Ctrl-C (the process group) gets
    to the workers twice, from the terminal and forwarded: they keep their metrics too."""
    import signal

    sweep_dir = tmp_path / "sweep"
    proc = start_parallel_sweep(sweep_dir, new_session=group)
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert_stopped_with_metrics(sweep_dir)
    assert "comparison of the runs so far" in err


def _children(pid):
    """The pids whose parent is ``pid`` (from /proc: no psutil here)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_a_parallel_sweep_terminated_through_its_parent_stops_as_on_ctrl_c(tmp_path):
    """``kill PID`` (SIGTERM) to a joblib sweep's parent, which runs no job itself: status 143,
    every job ``interrupted`` with its metrics (the parent forwards SIGTERM to its workers), the
    comparison written and no worker left running. SIGTERM's default action used to kill the parent alone: its workers ran on as orphans, their summaries
    said ``running`` and no comparison was written."""
    import signal
    import time

    sweep_dir = tmp_path / "sweep"
    proc = start_parallel_sweep(sweep_dir)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, err[-3000:]
        assert_stopped_with_metrics(sweep_dir)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    finally:
        for pid in workers:  # what the old code left running
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.parametrize("hydra", [True, False], ids=["cli", "python-api"])
@pytest.mark.parametrize("others", [[], ["chunked"]], ids=["alone", "beside-chunked"])
def test_a_run_without_a_policy_is_labelled_by_the_policy_it_ran(tmp_path, hydra, others):
    # Without +policy a run's config has no policy node (and Hydra no choice for the group), yet
    # it ran fcfs with fcfs's defaults: the configuration +policy=fcfs runs. It was labelled
    # policy=None beside policy=fcfs (preemption_mode=None beside recompute without Hydra).
    def run(name, policy):
        path = tmp_path / name
        path.mkdir()
        # As +policy=NAME writes it: the policy's own file, every option in it.
        conf = Path(__file__).resolve().parents[3] / "conf" / "policy" / f"{policy}.yaml"
        node = {"policy": yaml.safe_load(conf.read_text())} if policy else {}
        (path / "config.yaml").write_text(yaml.safe_dump({"workload": {"name": "synthetic", "rate": 2}, **node}))
        (path / "summary.json").write_text(json.dumps(
            {"status": "completed", "policy": policy or "fcfs", "backend": "naive", "rate": 2, "completed": 8}))
        if hydra:
            (path / ".hydra").mkdir()
            choices = {"workload": "default", "executor": None, **({"policy": policy} if policy else {})}
            (path / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))

    run("default", None)
    run("fcfs", "fcfs")
    for policy in others:
        run(policy, policy)
    labels = {Path(r["run_dir"]).name: r["label"] for r in comparison_rows([tmp_path])}
    assert labels["default"] == labels["fcfs"]
    assert all(labels[p] != labels["fcfs"] for p in others)


def test_a_sweeps_check_leaves_an_error_that_is_no_configuration_error_to_the_job(monkeypatch):
    # Raised from Hydra's callback, it would be turned into a warning, and the sweep would run without its folder
    # held or its end compared.
    from framework.harness import compare, experiment

    def check(cfg):
        if cfg.n == 1:
            raise KeyError("a part's own defect")
        raise ValueError("bad value")

    monkeypatch.setattr(experiment, "check_experiment", check)
    jobs = [(["n=0"], OmegaConf.create({"n": 0})), (["n=1"], OmegaConf.create({"n": 1}))]
    assert compare.sweep_refusals(jobs) is None
    jobs[1] = (["n=2"], OmegaConf.create({"n": 2}))
    assert compare.sweep_refusals(jobs) == ["bad value"]


def test_a_run_stopped_before_it_said_what_it_runs_takes_no_part_into_the_labels(tmp_path):
    """Ctrl-C during start-up leaves a summary of its status only: its parts are unknown, not None, and the labels
    come from what tells the runs that ran apart."""
    fake_run(tmp_path / "0", "a", None, 1.0, 1.0)
    config = yaml.safe_load((tmp_path / "0" / "config.yaml").read_text())
    stopped = tmp_path / "1"
    stopped.mkdir()
    config["engine"]["max_num_seqs"] = 2
    (stopped / "config.yaml").write_text(yaml.safe_dump(config))
    (stopped / "summary.json").write_text(json.dumps({"status": "interrupted", "interrupted": True}))
    config["engine"]["max_num_seqs"] = 1
    (tmp_path / "0" / "config.yaml").write_text(yaml.safe_dump(config))
    rows = comparison_rows([tmp_path])
    assert [(r["label"], r["status"]) for r in rows] == [("max_num_seqs=1", "completed"),
                                                         ("max_num_seqs=2", "interrupted")]
