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
    monkeypatch.setattr(plots, "_save", lambda fig, path, *args: figures.append(fig) or path)
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
    monkeypatch.setattr(plots, "_save", lambda fig, path, *args: figures.append(fig) or path)
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


def keep_figures(monkeypatch):
    """The figures ``plots`` draws from here on, kept for inspection (still written, then closed)."""
    import framework.harness.plots as plots

    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path, *args: figures.append(fig) or save(fig, path, *args))
    return figures


def colours_by_label(fig):
    """``{label: colour}`` of every labelled line and error-bar series of ``fig``'s axes."""
    from matplotlib.colors import to_hex

    found = {}
    for ax in fig.axes:
        for container in ax.containers:
            if hasattr(container, "lines") and not container.get_label().startswith("_"):
                found.setdefault(container.get_label(), set()).add(to_hex(container.lines[0].get_color()))
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                found.setdefault(line.get_label(), set()).add(to_hex(line.get_color()))
    return found


def test_axis_labels_are_words_with_units():
    from framework.harness.plots import axis_label

    assert axis_label("workload.rate") == "request rate (req/s)"
    assert axis_label("p99_ttft_ms") == "p99 time to first token (ms)"
    assert axis_label("median_tpot_ms") == "p50 time per output token (ms)"
    assert axis_label("output_throughput") == "output throughput (tokens/s)"
    assert axis_label("engine.something_new") == "engine.something_new"  # unknown: as it is


def write_fake_runs(root, with_requests):
    """Runs of policies a, b and c at rates 2 and 4; a has no latencies (none of its requests finished)."""
    import json

    import yaml

    for i, (policy, rate) in enumerate((p, r) for p in "abc" for r in (2, 4)):
        run = root / str(i)
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"policy": {"name": policy}, "workload": {"rate": rate}}))
        latencies = {} if policy == "a" else {"median_ttft_ms": 5.0 * rate, "p99_ttft_ms": 9.0 * rate}
        (run / "summary.json").write_text(json.dumps({
            "status": "completed", "completed": 3, "policy": policy, "model": "tiny-llama", "device": "CPU (x, 2 threads)",
            "workload": "synthetic", "num_requests": 3, "rate": rate, "output_throughput": 10.0 * rate, **latencies}))
        if with_requests and policy != "a":
            (run / "requests.csv").write_text("status,output_len,ttft_ms,tpot_ms,e2el_ms\n" + "".join(
                f"length,4,{t},{t / 4},{t * 2}\n" for t in (1.0 * rate, 2.0 * rate, 3.0 * rate)))


def test_a_configuration_keeps_its_colour_in_every_figure_of_a_comparison(monkeypatch, tmp_path):
    """A colour follows the configuration, not the order a figure draws its lines in: policy b, first of the
    latency figure (a has no latencies), keeps its own colour there."""
    from framework.harness.compare import write_comparison

    write_fake_runs(tmp_path / "runs", with_requests=True)
    figures = keep_figures(monkeypatch)
    paths = write_comparison([tmp_path / "runs"], tmp_path / "out")
    assert len(figures) == 3  # throughput, latency, CDFs
    seen = {}
    for fig in figures:
        for label, colour in colours_by_label(fig).items():
            seen.setdefault(label, set()).update(colour)
    assert set(seen) == {"policy=a", "policy=b", "policy=c"}
    assert all(len(c) == 1 for c in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == 3  # and the three differ
    assert "policy=a" not in colours_by_label(figures[2])  # no latencies of its own to draw
    for key in ("throughput", "latency", "latency_cdf"):
        assert paths[key].read_bytes()[:8] == PNG and paths[key].with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"
    # Words on the axes, and the caption line under each figure.
    assert figures[0].axes[0].get_xlabel() == "request rate (req/s)"
    assert figures[0].axes[0].get_ylabel() == "output throughput (tokens/s)"
    caption = "model tiny-llama · device CPU (x, 2 threads) · workload synthetic, 3 requests"
    assert all(any(t.get_text() == caption for t in fig.texts) for fig in figures)


def test_the_latency_figure_has_p50_and_p99_panels_with_error_bars(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    import framework.harness.plots as plots
    from framework.harness.compare import LATENCY

    rows = [{"label": "fcfs", "x": x, "p99_ttft_ms": 10.0 * x, "p99_ttft_ms_ci95_low": 10.0 * x - 1,
             "p99_ttft_ms_ci95_high": 10.0 * x + 3} for x in (2, 4)]
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, *args: figures.append(fig) or path)
    plots.metric_vs_x(rows, "x", LATENCY, tmp_path / "l.png", "Latency", xlabel="request rate (req/s)", ncols=3)
    axes = [ax for ax in figures[0].axes if ax.get_visible()]
    assert [ax.get_ylabel() for ax in axes] == [label for _, label in LATENCY]
    assert axes[0].get_ylabel().startswith("p50") and axes[3].get_ylabel().startswith("p99")
    [container] = axes[3].containers
    segments = container.lines[2][0].get_segments()
    assert [(s[0][1], s[1][1]) for s in segments] == [(19.0, 23.0), (39.0, 43.0)]  # the 95% intervals
    plt.close(figures[0])


def test_every_figure_is_written_as_png_and_pdf(tmp_path):
    from framework.harness.metrics import RequestRecord
    from framework.harness.plots import latency_cdf_overlay, latency_cdfs, metric_vs_x

    records = [RequestRecord(str(i), "length", 0, 0.0, 8, 4, 0, 0.01, 0.02 * (i + 1), 0.005, 0.05 * (i + 1),
                             [0.0, 0.01, 0.02, 0.03]) for i in range(4)]
    drawn = [latency_cdfs(records, tmp_path / "cdf.png", caption="model m"),
             timeline(steps_of_two_replicas(), tmp_path / "timeline.png"),
             metric_vs_x([{"label": "a", "x": 1, "y": 2.0}], "x", [("y", "y")], tmp_path / "m.png", "Y"),
             latency_cdf_overlay({("a", 1): {"ttft": [1.0, 2.0], "tpot": [0.5], "e2el": [3.0]}}, tmp_path / "o.png",
                                 "rate")]
    for png in drawn:
        assert png.suffix == ".png" and png.read_bytes()[:8] == PNG
        assert png.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-"


def test_the_timelines_series_each_have_their_own_colour(monkeypatch, tmp_path):
    """The KV cache line and the 'swapped' queue were both drawn in the same green."""
    from matplotlib.colors import to_hex

    figures = keep_figures(monkeypatch)
    steps = steps_of_two_replicas()
    timeline({k: v[steps["replica"] == 0] for k, v in steps.items() if k != "replica"}, tmp_path / "t.png")
    tokens, queues, kv = figures[0].axes[:3]
    colours = [to_hex(c.patches[0].get_facecolor()) for c in tokens.containers]
    colours += [to_hex(line.get_color()) for line in queues.get_lines() + kv.get_lines()]
    assert len(colours) == 6 and len(set(colours)) == 6


def test_rates_that_span_8x_get_a_log_axis_even_when_two():
    import matplotlib.pyplot as plt

    from framework.harness.plots import _scale_x

    for xs, log in (([4, 64], True), ([4, 16], False), ([2, 4, 16], True), ([0, 64], False)):
        fig, ax = plt.subplots()
        assert _scale_x(ax, xs) is log, xs
        plt.close(fig)
