"""``framework.compare`` over repeats: one row per configuration with its mean and 95% interval, the runs kept,
differences whose intervals overlap marked not significant, and the machine's timing noise reported."""
import csv
import json
import math

import pytest
import yaml

from framework.harness.compare import _ratio, aggregate, comparison_rows, main, markdown, write_comparison

HALF_3 = 4.3027 / math.sqrt(3)  # t(0.975, 2) / sqrt(3): the half-width of 3 repeats per unit of their std


def table(root):
    """``comparison.md`` of the runs under ``root``, as ``write_comparison`` writes it (without the figures)."""
    return markdown(aggregate(comparison_rows([root])), "workload.rate")


def fake_run(path, policy, repeat, throughput, p99_ttft, seed=0, rate=4, status="completed", noise=None,
             hardware=None):
    path.mkdir(parents=True)
    config = {"policy": {"name": policy}, "workload": {"name": "synthetic", "rate": rate, "seed": seed},
              "repeat": repeat}
    summary = {"status": status, "policy": policy, "backend": "naive", "model": "tiny-llama", "workload": "synthetic",
               "num_requests": 8, "rate": rate, "completed": 8, "output_throughput": throughput,
               "request_throughput": throughput / 10, "p99_ttft_ms": p99_ttft, "median_ttft_ms": p99_ttft / 2,
               "step_time_noise_cv": noise, "step_time_noise_steps": 0 if noise is None else 40,
               **({"hardware": hardware} if hardware else {"device": "CPU (test, 2 threads)"})}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def repeats(tmp_path):
    """Policies a and b, three repeats each, interleaved as a sweep numbers them: a's throughput 100/110/120
    against b's 200/210/220 (apart), their p99 TTFT 10/20/30 against 15/25/35 (overlapping)."""
    root = tmp_path / "sweep"
    for repeat in range(3):
        fake_run(root / str(2 * repeat), "a", repeat, 100.0 + 10 * repeat, 10.0 + 10 * repeat, noise=0.05 * (repeat + 1))
        fake_run(root / str(2 * repeat + 1), "b", repeat, 200.0 + 10 * repeat, 15.0 + 10 * repeat, noise=0.1)
    return root


def test_repeats_are_one_configuration_with_its_mean_and_interval(repeats):
    rows = comparison_rows([repeats])
    assert [(r["label"], r["repeat"]) for r in rows] == [("policy=a", 0), ("policy=a", 1), ("policy=a", 2),
                                                         ("policy=b", 0), ("policy=b", 1), ("policy=b", 2)]
    a, b = aggregate(rows)
    assert (a["label"], a["x"], a["n_repeats"], a["status"]) == ("policy=a", 4, 3, "completed")
    # 100, 110, 120: mean 110, std 10.
    assert a["output_throughput"] == pytest.approx(110.0)
    assert (a["output_throughput_ci95_low"], a["output_throughput_ci95_high"]) == \
        pytest.approx((110 - 10 * HALF_3, 110 + 10 * HALF_3))
    assert b["p99_ttft_ms"] == pytest.approx(25.0) and b["completed"] == 8 and isinstance(b["completed"], int)
    assert a["run_dir"].split() == [str(repeats / str(i)) for i in (0, 2, 4)]


def test_the_tables_hold_a_row_per_configuration_and_per_run(repeats, tmp_path):
    paths = write_comparison([repeats], tmp_path / "out")
    with open(paths["csv"]) as f:
        configs = list(csv.DictReader(f))
    assert [(c["label"], c["workload.rate"], c["n_repeats"]) for c in configs] == [("policy=a", "4", "3"),
                                                                                 ("policy=b", "4", "3")]
    assert float(configs[0]["output_throughput_ci95_high"]) == pytest.approx(110 + 10 * HALF_3)
    assert {"p99_ttft_ms_ci95_low", "p99_ttft_ms_ci95_high"} <= set(configs[0])
    with open(paths["runs"]) as f:
        runs = list(csv.DictReader(f))
    assert [(r["label"], r["repeat"], r["output_throughput"]) for r in runs][:2] == [("policy=a", "0", "100.0"),
                                                                                    ("policy=a", "1", "110.0")]
    md = paths["markdown"].read_text()
    assert f"| policy=a | 4 | 3 | completed | 8 | - | - | 11.0 ± {HALF_3:.3f} | 110.0 ± {10 * HALF_3:.1f} |" in md
    assert "## Runs" in md and md.count(f"| {repeats / '5'} |") == 1  # every run, once


def test_differences_whose_intervals_overlap_are_marked_not_significant(repeats):
    md = table(repeats).splitlines()
    header = next(line for line in md if line.startswith("| workload.rate | configurations |"))
    row = next(line for line in md if line.startswith("| 4 | policy=a / policy=b |"))
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|"))))
    assert cells["output_throughput"] == "0.52x"  # 110 / 210, intervals apart
    assert cells["p99_ttft_ms"] == "0.80x **n.s.**"  # 20 / 25, intervals overlap
    assert cells["median_ttft_ms"] == "0.80x **n.s.**"


def test_the_noise_floor_is_reported(repeats):
    md = table(repeats)
    # Noise 0.05, 0.1, 0.15 (a) and 0.1 x3 (b): the median run's 10.0%.
    assert "coefficient of variation of 10.0% (the median run, from 40 steps; 5.0% to 15.0% over 6 runs)" in md


def test_a_seed_sweep_gives_repeats_unless_the_seed_is_asked_for(tmp_path):
    for i, seed in enumerate((0, 1, 2)):
        fake_run(tmp_path / str(i), "a", 0, 100.0 + seed, 10.0, seed=seed)
    [config] = aggregate(comparison_rows([tmp_path]))
    assert (config["label"], config["n_repeats"]) == ("a/naive", 3)
    assert [r["label"] for r in comparison_rows([tmp_path], label=["workload.seed"])] == ["seed=0", "seed=1", "seed=2"]


def test_a_whole_float_and_its_int_are_one_value(tmp_path):
    """rate=8 on one command line and 8.0 in a YAML file, burstiness 1 and 1.0: repeats of one configuration."""
    for i, (rate, burstiness) in enumerate(((8, 1), (8.0, 1.0), (8.5, 1))):
        fake_run(tmp_path / str(i), "a", i, 100.0 + i, 10.0, rate=rate)
        config = yaml.safe_load((tmp_path / str(i) / "config.yaml").read_text())
        config["workload"]["burstiness"] = burstiness
        (tmp_path / str(i) / "config.yaml").write_text(yaml.safe_dump(config))
    rows = aggregate(comparison_rows([tmp_path]))
    assert [(r["label"], r["x"], r["n_repeats"]) for r in rows] == [("a/naive", 8, 2), ("a/naive", 8.5, 1)]


def test_failed_repeats_show_in_the_status_and_stay_out_of_the_mean(tmp_path):
    fake_run(tmp_path / "0", "a", 0, 100.0, 10.0)
    fake_run(tmp_path / "1", "a", 1, 120.0, 10.0)
    fake_run(tmp_path / "2", "a", 2, 1.0, 10.0, status="failed")
    [config] = aggregate(comparison_rows([tmp_path]))
    assert config["status"] == "2 completed, 1 failed" and config["n_repeats"] == 3
    assert config["output_throughput"] == pytest.approx(110.0)


def test_a_numeric_label_sorts_by_value(tmp_path):
    # Sorted as text, max_num_seqs 16 came before 2 and 8 in the tables, the legends and the colours.
    for i, seqs in enumerate((16, 2, 8)):
        fake_run(tmp_path / str(i), "a", 0, 100.0, 10.0)
        config = yaml.safe_load((tmp_path / str(i) / "config.yaml").read_text())
        (tmp_path / str(i) / "config.yaml").write_text(yaml.safe_dump({**config, "engine": {"max_num_seqs": seqs}}))
    rows = comparison_rows([tmp_path])
    assert [r["label"] for r in rows] == ["max_num_seqs=2", "max_num_seqs=8", "max_num_seqs=16"]


def test_the_latency_cdfs_pool_only_the_repeats_the_table_averages(tmp_path, monkeypatch):
    # An interrupted repeat's requests (its early arrivals alone) were pooled into the CDF, whose caption counted
    # it among the repeats, while the table left it out.
    from framework.harness import plots

    for i, (status, ttft) in enumerate((("completed", 10.0), ("completed", 20.0), ("interrupted", 500.0))):
        fake_run(tmp_path / "runs" / str(i), "a", i, 100.0, 10.0, status=status)
        (tmp_path / "runs" / str(i) / "requests.csv").write_text(
            "status,output_len,ttft_ms,tpot_ms,e2el_ms\n" + f"length,4,{ttft},1.0,{ttft + 3}\n")
    drawn = {}
    monkeypatch.setattr(plots, "latency_cdf_overlay", lambda samples, path, xlabel, colours, caption: drawn.update(
        samples=samples, caption=caption) or path)
    write_comparison([tmp_path / "runs"], tmp_path / "out")
    [samples] = drawn["samples"].values()
    assert sorted(samples["ttft"]) == [10.0, 20.0]
    assert drawn["caption"].endswith("2 repeats pooled (1 not completed left out)")
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert "mean and 95% CI over 2 repeats (1 not completed left out)" in table


def test_identical_simulated_repeats_are_pointed_out(tmp_path):
    for repeat in range(2):
        fake_run(tmp_path / str(repeat), "a", repeat, 100.0, 10.0, seed=repeat, hardware="a100-80gb")
        fake_run(tmp_path / f"b{repeat}", "b", repeat, 90.0, 10.0, seed=repeat, hardware="a100-80gb")
    md = table(tmp_path)
    assert "The repeats of 2 configuration(s) gave identical results" in md and "`workload.seed=0,1,2`" in md
    assert "None: simulated runs are deterministic" in md
    from framework.harness.plots import caption_line

    assert caption_line([r["summary"] for r in comparison_rows([tmp_path])]).startswith(
        "model tiny-llama · device a100-80gb (simulated) · workload synthetic")


def test_single_runs_say_there_is_no_interval(tmp_path, capsys):
    fake_run(tmp_path / "0", "a", 0, 100.0, 10.0)
    fake_run(tmp_path / "1", "b", 0, 90.0, 10.0)
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "One run per configuration: no confidence intervals" in out and "## Differences" not in out
    assert "model tiny-llama · device CPU (test, 2 threads) · workload synthetic, 8 requests at 4 req/s." in out
    assert "throughput_vs_rate.pdf" in out and "latency_vs_rate.pdf" in out


def test_a_simulated_sweep_with_a_failed_job_is_still_deterministic(tmp_path):
    """The failed job's summary names no hardware (it never built an executor): it says nothing of determinism."""
    fake_run(tmp_path / "0", "a", 0, 100.0, 10.0, hardware="a100-80gb")
    fake_run(tmp_path / "1", "b", 0, 90.0, 10.0, hardware="a100-80gb")
    fake_run(tmp_path / "2", "c", 0, 1.0, 10.0, status="failed")
    assert "None: simulated runs are deterministic" in table(tmp_path)


def test_a_mean_of_zero_is_a_difference_not_a_missing_metric(tmp_path):
    """Goodput 0 (no request met the SLO) against a positive one is the largest difference, not a missing one."""
    for repeat in range(3):
        fake_run(tmp_path / f"a{repeat}", "a", repeat, 100.0 + repeat, 10.0)
        fake_run(tmp_path / f"b{repeat}", "b", repeat, 0.0, 10.0)
        fake_run(tmp_path / f"c{repeat}", "c", repeat, 0.0, 10.0)
    md = table(tmp_path).splitlines()
    header = next(line for line in md if line.startswith("| workload.rate | configurations |"))
    column = [c.strip() for c in header.split("|")].index("output_throughput")
    cells = {row.split("|")[2].strip(): row.split("|")[column].strip() for row in md if row.startswith("| 4 | policy=")}
    # a's interval is apart from b's and c's [0, 0]: significant; b and c are the same zero.
    assert cells == {"policy=a / policy=b": "inf", "policy=a / policy=c": "inf", "policy=b / policy=c": "-"}
    zero = {"output_throughput": 0.0, "output_throughput_ci95_low": 0.0, "output_throughput_ci95_high": 0.0}
    some = {"output_throughput": 5.0, "output_throughput_ci95_low": 4.0, "output_throughput_ci95_high": 6.0}
    assert _ratio(zero, some, "output_throughput") == "0.00x"


def test_a_repeat_identical_to_another_of_its_seed_counts_once(tmp_path):
    """A simulated run is deterministic: repeat=0,1 with workload.seed=0,1 gives each seed twice. Counted as four
    samples, the interval would be narrower than two samples allow, and nothing would say why."""
    for run, (repeat, seed) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        fake_run(tmp_path / str(run), "a", repeat, 100.0 + 20 * seed, 10.0, seed=seed, hardware="a100-80gb")
    [config] = aggregate(comparison_rows([tmp_path]))
    assert (config["n_repeats"], config["duplicates"], len(config["used"])) == (4, 2, 2)
    assert config["output_throughput"] == 110.0
    half = 12.706 * 10.0 * math.sqrt(2) / math.sqrt(2)  # t(0.975, 1) x the two samples' std / sqrt(2)
    assert config["output_throughput_ci95_high"] - 110.0 == pytest.approx(half, rel=1e-3)
    md = table(tmp_path)
    assert "1 configuration(s) had repeats identical to another of the same seed" in md and "2 in all" in md
    assert "not completed left out" not in md


def test_configurations_that_ran_once_are_left_out_of_the_differences(tmp_path):
    for repeat in range(3):
        fake_run(tmp_path / f"a{repeat}", "a", repeat, 100.0 + repeat, 10.0)
        fake_run(tmp_path / f"b{repeat}", "b", repeat, 200.0 + repeat, 10.0)
    fake_run(tmp_path / "c0", "c", 0, 300.0, 10.0)
    md = table(tmp_path).splitlines()
    compared = [line.split("|")[2].strip() for line in md if line.startswith("| 4 | policy=")]
    assert compared == ["policy=a / policy=b"]


def test_repeats_that_measured_nothing_are_not_called_identical(tmp_path):
    for repeat in range(2):
        fake_run(tmp_path / f"a{repeat}", "a", repeat, 100.0 + repeat, 10.0)
    for repeat in range(2):
        path = tmp_path / f"b{repeat}"
        path.mkdir()
        (path / "config.yaml").write_text(yaml.safe_dump({"policy": {"name": "b"}, "workload": {"rate": 4},
                                                          "repeat": repeat}))
        (path / "summary.json").write_text(json.dumps({"status": "failed", "error": "RuntimeError: boom",
                                                       "policy": "b", "rate": 4}))
    assert "gave identical results" not in table(tmp_path)


def test_timing_noise_of_simulated_and_real_runs_together_is_not_called_deterministic(tmp_path):
    fake_run(tmp_path / "0", "a", 0, 100.0, 10.0, hardware="a100-80gb")
    fake_run(tmp_path / "1", "b", 0, 90.0, 10.0)
    md = table(tmp_path)
    assert "None: simulated runs are deterministic" not in md and "Not measured" in md


def test_the_caption_counts_the_repeats_used_and_those_left_out(tmp_path, capsys):
    for repeat in range(3):
        fake_run(tmp_path / f"a{repeat}", "a", repeat, 100.0 + repeat, 10.0)
    fake_run(tmp_path / "b0", "b", 0, 90.0, 10.0)
    fake_run(tmp_path / "b1", "b", 1, 90.0, 10.0)
    fake_run(tmp_path / "c0", "c", 0, 80.0, 10.0)
    fake_run(tmp_path / "c1", "c", 1, 1.0, 10.0, status="failed")
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert "mean and 95% CI over 1-3 repeats (1 not completed left out)" in capsys.readouterr().out


def test_a_run_without_an_x_value_comes_after_those_with_one(tmp_path):
    fake_run(tmp_path / "0", "a", 0, 100.0, 10.0, rate=None)
    fake_run(tmp_path / "1", "a", 0, 100.0, 10.0, rate=8)
    fake_run(tmp_path / "2", "a", 0, 100.0, 10.0, rate=2)
    assert [row["x"] for row in comparison_rows([tmp_path])] == [2, 8, None]


def test_the_caption_says_a_failed_repeat_was_left_out_of_a_single_run(tmp_path, capsys):
    fake_run(tmp_path / "a0", "a", 0, 100.0, 10.0)
    fake_run(tmp_path / "a1", "a", 1, 1.0, 10.0, status="failed")
    fake_run(tmp_path / "b0", "b", 0, 90.0, 10.0)
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert "mean and 95% CI over 1 repeat (1 not completed left out)" in capsys.readouterr().out
