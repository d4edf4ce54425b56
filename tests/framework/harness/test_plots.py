"""Plots of long and multi-replica runs: CDFs drawn at evenly spaced ranks, timelines cut into
time bins whose values are checked by hand."""
import math

import numpy as np
import pytest

from framework.harness.plots import binned_timeline, cdf_points, timeline

PNG = b"\x89PNG\r\n\x1a\n"


def test_cdf_points_keep_every_point_of_a_small_sample_and_exact_ranks_of_a_large_one():
    v, f = cdf_points(np.array([3.0, 1.0, 2.0]))
    assert v.tolist() == [1.0, 2.0, 3.0] and f.tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])
    big = np.random.default_rng(0).permutation(np.arange(1, 100_001, dtype=float))
    v, f = cdf_points(big, max_points=1000)
    assert len(v) == 1000 and v[0] == 1.0 and v[-1] == 100_000.0 and f[-1] == 1.0
    assert np.allclose(f, v / 100_000)  # value k is the k-th smallest of 100,000


def steps_of_two_replicas():
    # Replica 0 steps at 0, 0.2, 1 and 2.5 s; replica 1 at 0.5 and 3.9 s (rows out of time order,
    # as a cluster's steps.csv has them). Four bins of 0.975 s.
    rows = [(1, 3.9, 0, 4, 4, 0.6), (0, 0.0, 10, 0, 3, 0.1), (0, 1.0, 0, 3, 2, 0.2), (1, 0.5, 20, 0, 5, 0.5),
            (0, 0.2, 0, 1, 9, 0.3), (0, 2.5, 0, 2, 1, 0.3)]
    replica, t, prefill, decode, running, kv = map(np.array, zip(*rows))
    zeros = np.zeros(len(rows))
    return {"replica": replica, "time_s": t, "duration": zeros + 0.1, "num_prefill_tokens": prefill,
            "num_decode_tokens": decode, "num_running": running, "num_waiting": zeros, "num_swapped": zeros,
            "kv_usage": kv}


def test_binned_timeline_sums_queues_and_averages_kv_over_replicas():
    steps = steps_of_two_replicas()
    col = {k: v.astype(float) for k, v in steps.items()}
    edges, prefill, decode, queues, kv = binned_timeline(col, steps["replica"], 4)
    width = 3.9 / 4
    assert edges[-1] == pytest.approx(3.9) and len(edges) == 5
    assert (prefill * width).tolist() == pytest.approx([30, 0, 0, 0])
    assert (decode * width).tolist() == pytest.approx([1, 3, 2, 4])
    # Running: replica 0's last value per bin (9, 2, 1, then 1 carried), replica 1's (5, 5, 5, 4).
    assert queues["num_running"].tolist() == [14, 7, 6, 5]
    # KV: replica 0's mean per bin (0.2, 0.2, 0.3, 0.3 carried), replica 1's (0.5, 0.5, 0.5, 0.6).
    assert kv.tolist() == pytest.approx([0.35, 0.35, 0.4, 0.45])


def test_timelines_of_short_runs_long_runs_and_clusters_are_drawn(tmp_path):
    steps = steps_of_two_replicas()
    assert timeline(steps, tmp_path / "cluster.png").read_bytes()[:8] == PNG
    one = {k: v[steps["replica"] == 0] for k, v in steps.items() if k != "replica"}
    assert timeline(one, tmp_path / "steps.png").read_bytes()[:8] == PNG
    assert timeline(one, tmp_path / "binned.png", max_points=2).read_bytes()[:8] == PNG


def test_a_replica_without_steps_counts_as_idle(tmp_path):
    """A router that never used a replica below the highest one (replica 1 of three here) made
    the binned timeline fail with an IndexError, and the run with it after its summary."""
    steps = steps_of_two_replicas()
    steps["replica"] = steps["replica"] * 2  # replicas 0 and 2
    col = {k: v.astype(float) for k, v in steps.items()}
    _, _, _, queues, kv = binned_timeline(col, steps["replica"], 4)
    assert queues["num_running"].tolist() == [14, 7, 6, 5]
    assert kv.tolist() == pytest.approx([0.7 / 3, 0.7 / 3, 0.8 / 3, 0.9 / 3])  # replica 1 at 0
    assert timeline(steps, tmp_path / "cluster.png").read_bytes()[:8] == PNG


def test_bar_charts_show_every_run_named_by_its_x(monkeypatch, tmp_path):
    """Runs told apart only by a non-numeric x (``--x engine.enable_prefix_caching``) share a
    label: the bar chart showed the first run's value under that label and dropped the others."""
    import framework.harness.plots as plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    rows = [{"label": "fcfs/naive", "x": True, "output_throughput": 100.0},
            {"label": "fcfs/naive", "x": False, "output_throughput": 300.0}]
    plots.metric_vs_x(rows, "x", [("output_throughput", "output tokens/s")], tmp_path / "t.png", "Throughput",
                      xlabel="engine.enable_prefix_caching")
    ax = figures[0].axes[0]
    assert [bar.get_width() for bar in ax.patches] == [100.0, 300.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "fcfs/naive, engine.enable_prefix_caching=True", "fcfs/naive, engine.enable_prefix_caching=False"]
    import matplotlib.pyplot as plt

    plt.close(figures[0])


@pytest.mark.parametrize("other_x", [None, math.inf], ids=["no rate (a trace)", "rate=inf"])
def test_a_run_off_the_x_axis_still_shows(monkeypatch, tmp_path, other_x):
    """A run whose x is no finite number beside runs whose x is (a trace among Poisson runs, a
    rate=inf run in a rate sweep) was silently missing from the line plots."""
    import matplotlib.pyplot as plt

    import framework.harness.plots as plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    rows = [{"label": "fcfs", "x": 2, "output_throughput": 100.0},
            {"label": "fcfs", "x": 4, "output_throughput": 200.0},
            {"label": "trace" if other_x is None else "fcfs", "x": other_x, "output_throughput": 300.0}]
    plots.metric_vs_x(rows, "x", [("output_throughput", "output tokens/s")], tmp_path / "t.png", "Throughput",
                      xlabel="workload.rate")
    ax = figures[0].axes[0]
    shown = [bar.get_width() for bar in ax.patches]
    shown += [y for line in ax.lines for x, y in zip(line.get_xdata(), line.get_ydata()) if math.isfinite(x)]
    assert sorted(shown) == [100.0, 200.0, 300.0]
    plt.close(figures[0])
