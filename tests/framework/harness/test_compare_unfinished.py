"""``framework.compare`` on a run that never finished its summary (SIGKILLed): metrics from its CSVs."""
import csv
import json

import pytest

from framework.harness.compare import UNFINISHED, comparison_rows, main
from framework.harness.experiment import run_experiment
from tests.hydra_support import compose_config

#: What a run's summary holds from its start (``status: running``) on: its identity, no metrics.
META = ("policy", "backend", "allocator", "preparer", "executor", "model", "workload", "rate", "preemption_mode",
        "enable_prefix_caching", "hardware", "tensor_parallel_size", "run_dir", "num_requests")
#: Metrics the CSVs give as the summary does (ITLs and the prefix-cache hit rate need what only a run keeps).
FROM_CSVS = ("completed", "failed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
             "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms",
             "mean_queueing_delay_ms", "num_preemptions", "num_swaps", "total_prefill_tokens", "blocks_swapped_out")


@pytest.fixture
def killed_run(tmp_path):
    """A finished simulated run whose summary is put back to the one it wrote at its start, as a SIGKILL leaves
    it (with a row half written at the end of each CSV); returns the folder and the finished run's summary."""
    run = tmp_path / "run"
    finished = run_experiment(compose_config("executor=sim", "progress=false", "plots=false", "workload.rate=8",
                                             "workload.num_requests=24"), run)
    (run / "summary.json").write_text(json.dumps({"status": "running", "interrupted": False,
                                                  **{k: finished[k] for k in META}}))
    for name, half_row in (("requests.csv", "99,length,0,0.5"), ("steps.csv", "12.5,77,12.5")):
        with open(run / name, "a") as f:
            f.write(half_row)
    return run, finished


def test_a_run_whose_summary_says_running_is_compared_from_its_csvs_as_unfinished(killed_run):
    # compare showed no metrics at all for such a run, though requests.csv held every row.
    run, finished = killed_run
    [row] = comparison_rows([run])
    assert row["status"] == UNFINISHED == "running (killed?)"
    for key in FROM_CSVS:
        assert row[key] == pytest.approx(finished[key], rel=1e-3, abs=1e-3), key
    assert row["p99_itl_ms"] is None and row["prefix_cache_hit_rate"] is None
    assert json.loads((run / "summary.json").read_text())["status"] == "running"  # compare only reads


def test_the_cli_shows_an_unfinished_run_with_its_metrics(killed_run, tmp_path, capsys):
    run, finished = killed_run
    assert main([str(run), "--out", str(tmp_path / "cmp")]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if str(run) in line]
    cells = [cell.strip() for cell in line.split("|")]
    assert cells[3:6] == ["1", "running (killed?)", str(finished["completed"])]  # n_repeats, status, completed


def test_an_interrupted_summary_without_metrics_takes_them_from_the_csvs(killed_run):
    # A job marked interrupted (or failed) by its stopped sweep after its worker was killed holds none either.
    run, finished = killed_run
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "interrupted": True}))
    [row] = comparison_rows([run])
    assert row["status"] == "interrupted" and row["completed"] == finished["completed"]


def test_a_run_killed_before_any_row_is_unfinished_with_no_metrics(killed_run):
    run, _ = killed_run
    for name in ("requests.csv", "steps.csv"):
        (run / name).unlink()
    [row] = comparison_rows([run])
    assert row["status"] == UNFINISHED and row["completed"] is None


def _as_killed(run, summary):
    """Put ``run``'s summary back to what it wrote at its start (``status: running``), as a SIGKILL leaves it."""
    (run / "summary.json").write_text(json.dumps({"status": "running", "interrupted": False,
                                                  **{k: summary[k] for k in META if k in summary}}))


def test_a_killed_runs_preemptions_count_those_of_requests_it_cut_off(tmp_path):
    # requests.csv has no row for a request still running at the kill; steps.csv counts its preemptions.
    from tests.framework.harness.test_experiment import SWAPPING, stop_after

    run = tmp_path / "run"
    _as_killed(run, run_experiment(compose_config(*SWAPPING), run, on_engine=stop_after(150)))
    [row] = comparison_rows([run])
    with open(run / "steps.csv") as f:
        preempted = sum(int(r["num_preempted"]) for r in csv.DictReader(f))
    with open(run / "requests.csv") as f:
        recorded = sum(int(r["num_preemptions"]) for r in csv.DictReader(f))
    assert row["status"] == UNFINISHED and row["num_preemptions"] == preempted > recorded


def test_a_killed_real_runs_timing_noise_comes_from_its_steps(tmp_path):
    # compare said "Not measured" for it, though its steps.csv held the steps to measure it from.
    run = tmp_path / "run"
    finished = run_experiment(compose_config("progress=false", "plots=false", "engine.max_model_len=128",
                                             "workload.num_requests=4", "workload.rate=1000",
                                             "workload.prompt_len=[8,8]", "workload.output_len=[24,24]"), run)
    assert finished["step_time_noise_steps"] >= 5
    _as_killed(run, finished)
    [row] = comparison_rows([run])
    assert row["status"] == UNFINISHED
    assert finished["step_time_noise_cv"] is not None
    assert row["step_time_noise_cv"] == pytest.approx(finished["step_time_noise_cv"])


def test_a_killed_run_whose_steps_were_not_yet_written_spans_its_requests(killed_run):
    run, finished = killed_run
    header = (run / "steps.csv").read_text().splitlines()[0]
    (run / "steps.csv").write_text(header + "\n")  # the step rows still buffered when the kill came
    [row] = comparison_rows([run])
    assert row["completed"] == finished["completed"]
    assert row["duration_s"] == pytest.approx(finished["duration_s"], rel=1e-3)
    assert row["request_throughput"] == pytest.approx(finished["request_throughput"], rel=1e-3)
