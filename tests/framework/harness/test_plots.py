"""Plots of long and multi-replica runs: CDFs drawn at evenly spaced ranks, timelines cut into
time bins whose values are checked by hand."""
import json
import math
import struct

import numpy as np
import pytest
import yaml
from matplotlib.colors import to_hex

from framework.harness import plots
from framework.harness.compare import LATENCY, write_comparison
from framework.harness.metrics import RequestRecord
from framework.harness.plots import (CDF_METRICS, PALETTE, _scale_x, axis_label, binned_timeline, caption_line,
                                       cdf_points, colours, latency_cdf_overlay, latency_cdfs, metric_vs_x, timeline)

PNG = b"\x89PNG\r\n\x1a\n"


def test_cdf_points_keep_every_point_of_a_small_sample_and_exact_ranks_of_a_large_one():
    v, f = cdf_points(np.array([3.0, 1.0, 2.0]))
    assert v.tolist() == [1.0, 2.0, 3.0] and f.tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])
    big = np.random.default_rng(0).permutation(np.arange(1, 100_001, dtype=float))
    v, f = cdf_points(big, max_points=1000)
    assert len(v) == 1000 and v[0] == 1.0 and v[-1] == 100_000.0 and f[-1] == 1.0
    assert np.allclose(f, v / 100_000)  # value k is the k-th smallest of 100,000


def steps_of(rows):
    """``steps.csv`` columns of ``(replica, time_s, prefill, decode, running, kv_usage)`` rows."""
    replica, t, prefill, decode, running, kv = map(np.array, zip(*rows))
    zeros = np.zeros(len(rows))
    return {"replica": replica, "time_s": t, "duration": zeros + 0.1, "num_prefill_tokens": prefill,
            "num_decode_tokens": decode, "num_running": running, "num_waiting": zeros, "num_swapped": zeros,
            "kv_usage": kv}


def steps_of_two_replicas():
    # Replica 0 steps at 0, 0.2, 1 and 2.5 s; replica 1 at 0.5 and 3.9 s (rows out of time order,
    # as a cluster's steps.csv has them). Four bins of 0.975 s.
    return steps_of([(1, 3.9, 0, 4, 4, 0.6), (0, 0.0, 10, 0, 3, 0.1), (0, 1.0, 0, 3, 2, 0.2), (1, 0.5, 20, 0, 5, 0.5),
                     (0, 0.2, 0, 1, 9, 0.3), (0, 2.5, 0, 2, 1, 0.3)])


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


def keep_figures(monkeypatch, write=True):
    """The figures ``plots`` draws from here on, kept for inspection (written and closed, unless not ``write``)."""
    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save",
                        lambda fig, path, *args: figures.append(fig) or (save(fig, path, *args) if write else path))
    return figures


@pytest.fixture
def drawn(monkeypatch):
    """The figures ``plots`` draws from here on, kept (not written) and closed after the test."""
    import matplotlib.pyplot as plt

    figures = keep_figures(monkeypatch, write=False)
    yield figures
    for fig in figures:
        plt.close(fig)


def colours_by_label(fig):
    """``{label: colour}`` of every labelled line and error-bar series of ``fig``'s axes."""
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
    assert axis_label("workload.rate") == "request rate (req/s)"
    assert axis_label("p99_ttft_ms") == "p99 time to first token (ms)"
    assert axis_label("median_tpot_ms") == "p50 time per output token (ms)"
    assert axis_label("output_throughput") == "output throughput (tokens/s)"
    assert axis_label("engine.something_new") == "engine.something_new"  # unknown: as it is
    assert axis_label("total_ttft_ms") == "total_ttft_ms"


def write_fake_runs(root, with_requests):
    """Runs of policies a, b and c at rates 2 and 4; a has no latencies (none of its requests finished)."""
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


def test_the_latency_figure_has_p50_and_p99_panels_with_error_bars(drawn, tmp_path):
    rows = [{"label": "fcfs", "x": x, "p99_ttft_ms": 10.0 * x, "p99_ttft_ms_ci95_low": 10.0 * x - 1,
             "p99_ttft_ms_ci95_high": 10.0 * x + 3} for x in (2, 4)]
    metric_vs_x(rows, "x", LATENCY, tmp_path / "l.png", "Latency", xlabel="request rate (req/s)", ncols=3)
    axes = [ax for ax in drawn[0].axes if ax.get_visible()]
    assert [ax.get_ylabel() for ax in axes] == [label for _, label in LATENCY]
    assert axes[0].get_ylabel().startswith("p50") and axes[3].get_ylabel().startswith("p99")
    [container] = axes[3].containers
    segments = container.lines[2][0].get_segments()
    assert [(s[0][1], s[1][1]) for s in segments] == [(19.0, 23.0), (39.0, 43.0)]  # the 95% intervals


def test_every_figure_is_written_as_png_and_pdf(tmp_path):
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
    figures = keep_figures(monkeypatch)
    steps = steps_of_two_replicas()
    timeline({k: v[steps["replica"] == 0] for k, v in steps.items() if k != "replica"}, tmp_path / "t.png")
    tokens, queues, kv = figures[0].axes[:3]
    colours = [to_hex(c.patches[0].get_facecolor()) for c in tokens.containers]
    colours += [to_hex(line.get_color()) for line in queues.get_lines() + kv.get_lines()]
    assert len(colours) == 6 and len(set(colours)) == 6


def test_rates_that_span_8x_get_a_log_axis_even_when_two():
    import matplotlib.pyplot as plt

    for xs, log in (([4, 64], True), ([4, 16], False), ([2, 4, 16], True), ([0, 64], False)):
        fig, ax = plt.subplots()
        assert _scale_x(ax, xs) is log, xs
        plt.close(fig)


def record(rid, ttft, token_times, status="length", priority=0):
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    return RequestRecord(rid, status, priority, 0.0, 8, len(token_times), 0, 0.0, ttft, tpot, token_times[-1],
                         list(token_times))


def test_a_runs_latency_cdfs_are_in_ms_over_its_completed_requests(drawn, tmp_path):
    records = [record("a", 0.010, [0.010, 0.012, 0.014]), record("b", 0.030, [0.030, 0.034, 0.038]),
               record("aborted", 0.500, [0.5, 0.6], status="abort")]
    latency_cdfs(records, tmp_path / "cdf.png")
    fig = drawn[0]
    panels = {ax.get_xlabel(): ax for ax in fig.axes}
    assert set(panels) == {axis_label(name) for name in ("ttft", "tpot", "itl", "e2el")}
    [ttft] = panels["time to first token (ms)"].get_lines()
    assert list(ttft.get_xdata()) == pytest.approx([10.0, 30.0])
    [itl] = panels["inter-token latency (ms)"].get_lines()
    assert list(itl.get_xdata()) == pytest.approx([2.0, 2.0, 4.0, 4.0])
    assert panels["time to first token (ms)"].get_ylabel() == "fraction of requests"
    assert panels["inter-token latency (ms)"].get_ylabel() == "fraction of gaps"
    assert "(2 completed requests)" in fig.get_suptitle()
    assert all(ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1 for ax in fig.axes)


def test_a_runs_latency_cdfs_draw_a_line_per_priority(drawn, tmp_path):
    records = [record(str(i), 0.01 * (i + 1), [0.0, 0.001 * (i + 1)], priority=i % 2) for i in range(4)]
    latency_cdfs(records, tmp_path / "cdf.png")
    for ax in drawn[0].axes:
        assert [line.get_label() for line in ax.get_lines()] == ["priority 0", "priority 1"]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["priority 0", "priority 1"]
    low, high = drawn[0].axes[0].get_lines()
    assert list(low.get_xdata()) == pytest.approx([10.0, 30.0])
    assert list(high.get_xdata()) == pytest.approx([20.0, 40.0])


def test_a_clusters_timeline_sums_its_replicas_queues_per_time_bin(drawn, tmp_path):
    timeline(steps_of_two_replicas(), tmp_path / "t.png", bins=4)
    _, queues, _ = drawn[0].axes[:3]
    [running] = [line for line in queues.get_lines() if line.get_label() == "running"]
    assert list(running.get_ydata()) == [14, 7, 6, 5]  # as in the binned timeline above


def test_a_short_runs_timeline_stacks_decode_on_prefill_and_shows_kv_in_percent(drawn, tmp_path):
    steps = steps_of_two_replicas()
    one = {k: v[steps["replica"] == 0] for k, v in steps.items() if k != "replica"}
    timeline(one, tmp_path / "t.png")
    tokens, _, kv = drawn[0].axes[:3]
    _, decode = tokens.containers
    assert [bar.get_y() for bar in decode.patches] == one["num_prefill_tokens"].tolist()
    assert [bar.get_y() + bar.get_height() for bar in decode.patches] == \
        (one["num_prefill_tokens"] + one["num_decode_tokens"]).tolist()
    [usage] = kv.get_lines()
    assert list(usage.get_ydata()) == pytest.approx((100 * one["kv_usage"]).tolist())
    assert kv.get_ylim()[0] == 0 and kv.get_ylim()[1] >= 100


def test_binned_queues_take_each_bins_latest_step_whatever_the_row_order():
    # One replica, two bins of 0.5 s: steps at 0.3 s (5 running) and 0.1 s (9 running) in the first.
    steps = steps_of([(0, 0.3, 0, 1, 5, 0.5), (0, 0.1, 0, 1, 9, 0.4), (0, 1.0, 0, 1, 1, 0.2)])
    col = {k: v.astype(float) for k, v in steps.items()}
    _, _, _, queues, _ = binned_timeline(col, steps["replica"], 2)
    assert queues["num_running"].tolist() == [5, 1]


def test_a_replica_counts_as_idle_until_its_first_step():
    # Replica 0 steps every second from 0 to 3 s, replica 1 only at 3 s: four bins of about 0.75 s.
    steps = steps_of([(0, float(t), 0, 1, 2, 0.5) for t in range(4)] + [(1, 3.0, 0, 1, 4, 0.3)])
    col = {k: v.astype(float) for k, v in steps.items()}
    _, _, _, queues, kv = binned_timeline(col, steps["replica"], 4)
    assert queues["num_running"].tolist() == [2, 2, 2, 6]
    assert kv.tolist() == pytest.approx([0.25, 0.25, 0.25, 0.4])


def test_each_configuration_gets_its_own_colour_in_the_order_they_come():
    assert colours(["b", "a", "b"]) == {"b": PALETTE[0], "a": PALETTE[1]}
    assert len(set(colours(f"policy={i}" for i in range(len(PALETTE))).values())) == len(PALETTE)


def test_the_caption_names_only_what_the_runs_record():
    assert caption_line([{"device": "CPU (x, 2 threads)", "num_requests": 3}]) == "device CPU (x, 2 threads)"


def test_the_caption_names_simulated_hardware_with_its_tensor_parallel_size():
    summaries = [{"hardware": "h100", "tensor_parallel_size": 2}, {"hardware": "h100", "tensor_parallel_size": 1}]
    assert caption_line(summaries) == "device h100 x2 (simulated) / h100 (simulated)"


def test_the_caption_names_a_trace_by_its_file():
    assert caption_line([{"workload": "trace", "workload_file": "conv.jsonl"}]) == "workload conv.jsonl"


def test_a_line_per_configuration_through_its_own_runs_in_x_order(drawn, tmp_path):
    rows = [{"label": "a", "x": 4, "y": 40.0}, {"label": "b", "x": 2, "y": 25.0}, {"label": "a", "x": 2, "y": 20.0},
            {"label": "b", "x": 4, "y": 45.0}, {"label": "a", "x": 3, "y": 30.0}]
    metric_vs_x(rows, "x", [("y", "y")], tmp_path / "m.png", "Y", colour_of={"a": "#123456", "b": "#abcdef"})
    ax = drawn[0].axes[0]
    lines = {c.get_label(): c.lines[0] for c in ax.containers}
    assert list(lines["a"].get_ydata()) == [20.0, 30.0, 40.0] and list(lines["b"].get_ydata()) == [25.0, 45.0]
    assert {label: to_hex(line.get_color()) for label, line in lines.items()} == {"a": "#123456", "b": "#abcdef"}
    assert ax.get_ylim()[0] == 0


def test_configurations_at_one_x_are_drawn_apart_either_side_of_it(drawn, tmp_path):
    rows = [{"label": "a", "x": 8, "y": 1.0}, {"label": "b", "x": 8, "y": 1.0}]
    metric_vs_x(rows, "x", [("y", "y")], tmp_path / "m.png", "Y")
    a, b = (c.lines[0].get_xdata()[0] for c in drawn[0].axes[0].containers)
    assert a < 8 < b


def test_a_bar_chart_lists_the_runs_top_down_named_on_each_row_of_panels(drawn, tmp_path):
    metrics = [(m, m) for m in ("m1", "m2", "m3", "m4")]
    rows = [{"label": label, "x": None, **{m: 1.0 + i for m, _ in metrics}} for i, label in enumerate("ab")]
    metric_vs_x(rows, "x", metrics, tmp_path / "m.png", "Y", ncols=2)
    axes = drawn[0].axes
    assert all(ax.yaxis_inverted() for ax in axes)  # the first run on top
    names = [[t.get_text() for t in ax.get_yticklabels()] for ax in axes]
    assert names == [["a", "b"], ["", ""], ["a", "b"], ["", ""]]


def test_up_to_ten_xs_are_ticked_at_their_values():
    import matplotlib.pyplot as plt

    xs = list(range(1, 11))
    fig, ax = plt.subplots()
    _scale_x(ax, xs)
    assert list(ax.get_xticks()) == xs
    plt.close(fig)


def test_the_cdf_overlay_has_a_row_per_x_in_numeric_order_named_at_the_bottom(drawn, tmp_path):
    samples = {("a", x): {"ttft": [1.0, 2.0], "tpot": [0.5, 0.6], "e2el": [3.0, 4.0]} for x in (16, 2, 8)}
    latency_cdf_overlay(samples, tmp_path / "o.png", "rate")
    axes = np.array(drawn[0].axes).reshape(3, len(CDF_METRICS))
    assert [ax.get_title(loc="left") for ax in axes[:, 0]] == ["rate = 2", "rate = 8", "rate = 16"]
    assert [ax.get_xlabel() for ax in axes[-1]] == [axis_label(name) for name, _ in CDF_METRICS]
    assert all(ax.get_xlabel() == "" for ax in axes[:-1].flat)


def test_a_cdf_overlay_without_an_x_has_no_row_title(drawn, tmp_path):
    latency_cdf_overlay({("trace", None): {"ttft": [1.0], "tpot": [0.5], "e2el": [3.0]}}, tmp_path / "o.png", "rate")
    assert drawn[0].axes[0].get_title(loc="left") == ""


def test_a_cdf_panel_turns_log_only_for_a_tail_hundreds_of_times_its_body(drawn, tmp_path):
    samples = {("a", 1): {"ttft": [1.0, 2.0, 500.0], "tpot": [0.0, 1.0, 2.0], "e2el": [3.0, 4.0]}}
    latency_cdf_overlay(samples, tmp_path / "o.png", "rate")
    assert [ax.get_xscale() for ax in drawn[0].axes] == ["log", "linear", "linear"]


def test_the_legend_lists_configurations_in_their_order(monkeypatch, tmp_path):
    figures = keep_figures(monkeypatch)
    rows = [{"label": "a", "x": 1, "m2": 1.0}, {"label": "b", "x": 1, "m1": 1.0, "m2": 2.0}]
    metric_vs_x(rows, "x", [("m1", "m1"), ("m2", "m2")], tmp_path / "m.png", "Y")
    [legend] = figures[0].legends
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b"]


def test_a_figure_is_a_200_dpi_png_beside_a_reproducible_pdf_with_text_fonts(monkeypatch, tmp_path):
    figures = keep_figures(monkeypatch)
    rows = [{"label": "a", "x": 1, "y": 2.0}]
    drawn_at = []
    for day, name in enumerate(("1.png", "2.png")):  # drawn on different days
        monkeypatch.setenv("SOURCE_DATE_EPOCH", str(86400 * day))
        drawn_at.append(metric_vs_x(rows, "x", [("y", "y")], tmp_path / name, "Y"))
    first, second = drawn_at
    width, height = struct.unpack(">II", first.read_bytes()[16:24])  # the PNG header's size in pixels
    assert (width, height) == (round(figures[0].get_figwidth() * 200), round(figures[0].get_figheight() * 200))
    pdf = first.with_suffix(".pdf").read_bytes()
    assert pdf == second.with_suffix(".pdf").read_bytes()
    assert b"/FontFile2" in pdf  # TrueType embedded


def test_drawing_leaves_no_figure_open_and_returns_the_pngs_path(tmp_path):
    import matplotlib.pyplot as plt

    open_before = plt.get_fignums()
    png = timeline(steps_of_two_replicas(), tmp_path / "timeline")
    assert png == tmp_path / "timeline.png" and png.read_bytes()[:8] == PNG
    assert plt.get_fignums() == open_before


def test_a_virtual_clocks_steps_of_no_duration_still_show_as_bars(drawn, tmp_path):
    steps = steps_of_two_replicas()
    one = {k: v[steps["replica"] == 0] for k, v in steps.items() if k != "replica"}
    one["duration"] = np.zeros(len(one["time_s"]))
    timeline(one, tmp_path / "t.png")
    assert all(bar.get_width() > 0 for c in drawn[0].axes[0].containers for bar in c.patches)


def test_a_run_without_steps_still_gets_a_timeline(tmp_path):
    empty = {k: [] for k in ("time_s", "duration", "num_prefill_tokens", "num_decode_tokens", "num_running",
                             "num_waiting", "num_swapped", "kv_usage")}
    assert timeline(empty, tmp_path / "t.png").read_bytes()[:8] == PNG


def test_a_cluster_whose_steps_all_came_at_the_start_bins_them_into_the_first_bin():
    steps = steps_of([(0, 0.0, 10, 0, 1, 0.1), (1, 0.0, 20, 0, 2, 0.3)])
    col = {k: v.astype(float) for k, v in steps.items()}
    edges, prefill, _, queues, kv = binned_timeline(col, steps["replica"], 4)
    assert np.all(np.isfinite(prefill)) and prefill[0] > 0 and not prefill[1:].any()
    assert queues["num_running"].tolist() == [3, 3, 3, 3] and kv.tolist() == pytest.approx([0.2] * 4)


def test_points_on_a_log_axis_are_moved_aside_by_one_ratio(drawn, tmp_path):
    rows = [{"label": label, "x": x, "y": 1.0} for label in "ab" for x in (1, 64)]
    metric_vs_x(rows, "x", [("y", "y")], tmp_path / "m.png", "Y")
    ax = drawn[0].axes[0]
    assert ax.get_xscale() == "log"
    for container in ax.containers:
        low, high = container.lines[0].get_xdata()
        assert low / 1 == pytest.approx(high / 64)


def test_a_run_without_a_metric_gets_no_bar(drawn, tmp_path):
    rows = [{"label": "a", "x": None, "y": 1.0}, {"label": "b", "x": None, "y": None}]
    metric_vs_x(rows, "x", [("y", "y")], tmp_path / "m.png", "Y")
    measured, missing = drawn[0].axes[0].patches
    assert measured.get_width() == 1.0 and math.isnan(missing.get_width())


def test_a_bar_charts_axis_starts_at_zero_even_where_an_interval_reaches_below(drawn, tmp_path):
    rows = [{"label": "a", "x": None, "y": 1.0, "y_ci95_low": -2.0, "y_ci95_high": 3.0},
            {"label": "b", "x": None, "y": 2.0}]
    metric_vs_x(rows, "x", [("y", "y")], tmp_path / "m.png", "Y")
    assert drawn[0].axes[0].get_xlim()[0] == 0
