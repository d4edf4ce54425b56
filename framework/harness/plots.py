"""Figures, drawn headless (Agg), each written as a PNG (200 dpi) and a vector PDF beside it: a run's latency
CDFs and step timeline; a comparison's metrics against its x axis and its latency CDFs overlaid. Axes are
labelled in words with units (``axis_label``), a caption line names the model, device and workload, and a
comparison passes one colour per configuration (``colours``) to every figure it draws."""
from __future__ import annotations

import logging
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from framework.harness.metrics import RequestRecord, latencies


#: Axis labels, in words with units, of the config keys sweeps put on the x axis and of the metrics plotted.
AXIS_LABELS = {
    "workload.rate": "request rate (req/s)",
    "workload.num_requests": "requests sent",
    "workload.burstiness": "burstiness (gamma shape)",
    "engine.max_num_seqs": "max running requests",
    "engine.max_num_batched_tokens": "token budget per step (tokens)",
    "engine.block_size": "KV block size (tokens)",
    "engine.num_gpu_blocks_override": "KV cache size (blocks)",
    "engine.enable_prefix_caching": "prefix caching",
    "engine.num_threads": "torch threads",
    "cluster.num_replicas": "replicas",
    "executor.tensor_parallel_size": "tensor-parallel size",
    "output_throughput": "output throughput (tokens/s)",
    "request_throughput": "request throughput (req/s)",
    "total_token_throughput": "total throughput (tokens/s)",
    "request_goodput": "goodput (req/s meeting every SLO)",
    "ttft": "time to first token (ms)",
    "tpot": "time per output token (ms)",
    "itl": "inter-token latency (ms)",
    "e2el": "end-to-end latency (ms)",
    "queueing_delay": "queueing delay (ms)",
}
#: Words for the statistic prefixes of summary keys (``p99_ttft_ms``).
_STATISTICS = {"mean": "mean", "median": "p50", "p90": "p90", "p99": "p99", "std": "std of"}


def axis_label(key: str) -> str:
    """``key`` (a config key or a summary metric such as ``p99_ttft_ms``) in words with its unit; an
    unknown key as it is."""
    if key in AXIS_LABELS:
        return AXIS_LABELS[key]
    stat, _, rest = key.partition("_")
    name = rest[: -len("_ms")] if rest.endswith("_ms") else None
    if stat in _STATISTICS and name in AXIS_LABELS:
        return f"{_STATISTICS[stat]} {AXIS_LABELS[name]}"
    return key


#: Colours given to configurations in order: tab10's, then tab20's lighter shades, then again.
PALETTE = [f"C{i}" for i in range(10)] + ["#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
                                          "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]


def colours(labels: Iterable[str]) -> dict[str, str]:
    """One colour per distinct label, in the order the labels first come: a comparison makes this
    once and passes it to each of its figures, so a configuration keeps its colour in all of them."""
    distinct = list(dict.fromkeys(labels))
    return {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(distinct)}


def caption_line(summaries: Sequence[Mapping[str, Any]], extra: str | None = None) -> str:
    """``model M · device D · workload W`` of the runs' summaries (differing values joined by ``/``;
    the rate only where all share one), then ``extra``."""
    def values(get: Any) -> str:
        return " / ".join(dict.fromkeys(str(v) for v in map(get, summaries) if v is not None))

    rates = {s.get("rate") for s in summaries}
    workload = values(lambda s: s.get("workload_file") or s.get("workload"))
    requests = values(lambda s: s.get("num_requests"))
    if workload and requests:
        workload += f", {requests} requests"
    if workload and len(rates) == 1 and _finite_number(next(iter(rates))):
        workload += f" at {next(iter(rates)):g} req/s"
    parts = [f"model {values(lambda s: s.get('model'))}", f"device {values(_device)}", f"workload {workload}"]
    parts = [p for p in parts if not p.endswith(" ")]
    return " · ".join(parts + ([extra] if extra else []))


def _device(summary: Mapping[str, Any]) -> str | None:
    """A summary's device: a simulated run's hardware (and tensor-parallel size), else what the run names."""
    if summary.get("hardware"):
        tp = summary.get("tensor_parallel_size") or 1
        return f"{summary['hardware']}{f' x{tp}' if tp > 1 else ''} (simulated)"
    return summary.get("device")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["pdf.fonttype"] = 42  # TrueType in the PDFs: text stays text for journals and editors
    logging.getLogger("fontTools").setLevel(logging.WARNING)  # its font subsetting logs every table at INFO

    return plt


#: Most points a CDF line draws (a longer sample is drawn at evenly spaced ranks) and most steps a
#: timeline draws one by one (a longer or multi-replica run is cut into TIMELINE_BINS time bins),
#: so plotting a simulated run of millions of tokens stays quick.
MAX_POINTS = 2000
TIMELINE_BINS = 500


def cdf_points(values: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """``(sorted values, fraction <= value)``: every point, or ``max_points`` evenly spaced ranks
    (the first and the last included) of a longer sample."""
    v = np.sort(values)
    n = len(v)
    ranks = np.arange(n) if n <= max_points else np.unique(np.linspace(0, n - 1, max_points).round().astype(np.int64))
    return v[ranks], (ranks + 1) / n


def latency_cdfs(records: Sequence[RequestRecord], path: str | Path, caption: str | None = None) -> Path:
    """CDFs of TTFT, TPOT, ITL and E2EL (ms) of the completed requests, a line per priority
    when priorities differ; ``caption`` under the figure. Returns the PNG's path (the PDF is beside it)."""
    plt = _pyplot()
    done = [r for r in records if r.completed]
    groups = {p: [r for r in done if r.priority == p] for p in sorted({r.priority for r in done})}
    if len(groups) <= 1:
        groups = {None: done}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, ("ttft", "tpot", "itl", "e2el")):
        for prio, group in groups.items():
            v = np.asarray(latencies(group, name), dtype=np.float64) * 1000
            if len(v):
                ax.step(*cdf_points(v), where="post", label="all" if prio is None else f"priority {prio}")
        ax.set_xlabel(axis_label(name))
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"Latency CDFs ({len(done)} completed requests)")
    return _save(fig, path, caption)


#: The timeline's series: one colour each across its three panels.
SERIES_COLOURS = {"prefill": "tab:orange", "decode": "tab:blue", "num_running": "tab:purple",
                  "num_waiting": "tab:red", "num_swapped": "tab:brown", "kv_usage": "tab:green"}


def timeline(steps: Mapping[str, Any], path: str | Path, max_points: int = MAX_POINTS,
             bins: int = TIMELINE_BINS, caption: str | None = None) -> Path:
    """Against run time: tokens per step (prefill and decode), queue lengths and KV cache usage.

    ``steps`` holds ``steps.csv`` columns (``time_s``, ``duration``, ``num_prefill_tokens``,
    ``num_decode_tokens``, ``num_running``, ``num_waiting``, ``num_swapped``, ``kv_usage`` and,
    for a cluster, ``replica``). One replica with at most ``max_points`` steps is drawn step by
    step; otherwise the run is cut into ``bins`` time bins (``binned_timeline``). ``caption`` goes under the figure;
    returns the PNG's path (the PDF is beside it)."""
    plt = _pyplot()
    col = {k: np.asarray(v, dtype=np.float64) for k, v in steps.items()}
    t = col["time_s"]
    replicas = col["replica"].astype(np.int64) if "replica" in col and len(col["replica"]) else np.zeros(len(t), np.int64)
    num_replicas = int(replicas.max()) + 1 if len(t) else 1
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    if num_replicas == 1 and len(t) <= max_points:
        # A bar spans its step; a step of zero duration (a virtual clock) still gets a visible width.
        span = float(t.max() - t.min()) if len(t) > 1 else 1.0
        width = np.maximum(col["duration"], span / max(len(t), 1) / 2)
        a.bar(t, col["num_prefill_tokens"], width=width, align="edge", label="prefill", color=SERIES_COLOURS["prefill"])
        a.bar(t, col["num_decode_tokens"], width=width, align="edge", bottom=col["num_prefill_tokens"],
              label="decode", color=SERIES_COLOURS["decode"])
        a.set_ylabel("tokens per step")
        x, queues, kv = t, {k: col[k] for k in ("num_running", "num_waiting", "num_swapped")}, col["kv_usage"]
        title = f"Step timeline ({len(t)} steps)"
    else:
        edges, prefill, decode, queues, kv = binned_timeline(col, replicas, bins)
        x = edges[:-1]
        a.stairs(prefill, edges, fill=True, label="prefill", color=SERIES_COLOURS["prefill"])
        a.stairs(prefill + decode, edges, baseline=prefill, fill=True, label="decode", color=SERIES_COLOURS["decode"])
        a.set_ylabel("tokens per second")
        title = (f"Timeline ({len(t)} steps" + (f" on {num_replicas} replicas" if num_replicas > 1 else "")
                 + f", {bins} time bins)")
    a.legend(fontsize=8)
    for key, label in (("num_running", "running"), ("num_waiting", "waiting"), ("num_swapped", "swapped")):
        b.step(x, queues[key], where="post", label=label, color=SERIES_COLOURS[key])
    b.set_ylabel("requests" if num_replicas == 1 else "requests (all replicas)")
    b.legend(fontsize=8)
    c.step(x, 100 * kv, where="post", color=SERIES_COLOURS["kv_usage"])
    c.set_ylabel("KV cache used (%)" if num_replicas == 1 else "KV cache used (%, mean of replicas)")
    c.set_ylim(0, 105)
    c.set_xlabel("time since start (s)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path, caption)


def binned_timeline(col: Mapping[str, np.ndarray], replicas: np.ndarray, bins: int,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """``(edges, prefill, decode, queues, kv)`` of the steps in ``bins`` equal time bins from 0 to the
    last step: tokens per second, queue lengths summed over replicas (each one's last value in the
    bin) and KV usage averaged over replicas ``0 .. replicas.max()`` (each one's mean in the bin; 0 for
    a replica without steps). A replica's values carry over bins where it took no step."""
    t = col["time_s"]
    edges = np.linspace(0.0, float(t.max()) * (1 + 1e-9) + 1e-9, bins + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    width = edges[1] - edges[0]
    prefill = np.bincount(which, col["num_prefill_tokens"], bins) / width
    decode = np.bincount(which, col["num_decode_tokens"], bins) / width
    queues = {k: np.zeros(bins) for k in ("num_running", "num_waiting", "num_swapped")}
    kv = np.zeros(bins)
    num_replicas = int(replicas.max()) + 1
    for r in range(num_replicas):
        mine = np.flatnonzero(replicas == r)
        if not len(mine):  # a replica the router never used: no queue, no KV usage (0 in the mean)
            continue
        mine = mine[np.argsort(t[mine], kind="stable")]
        ends = np.flatnonzero(np.append(which[mine][1:] != which[mine][:-1], True))  # each bin's last step
        for k in queues:
            last = np.full(bins, np.nan)
            last[which[mine][ends]] = col[k][mine][ends]
            queues[k] += _carry_forward(last)
        counts = np.bincount(which[mine], minlength=bins)
        mean = np.bincount(which[mine], col["kv_usage"][mine], bins) / np.maximum(counts, 1)
        kv += _carry_forward(np.where(counts > 0, mean, np.nan))
    return edges, prefill, decode, queues, kv / num_replicas


def _carry_forward(values: np.ndarray) -> np.ndarray:
    """NaNs replaced by the last value before them (0 before the first)."""
    idx = np.where(np.isnan(values), 0, np.arange(len(values)))
    np.maximum.accumulate(idx, out=idx)
    out = values[idx]
    return np.nan_to_num(out, nan=0.0)


def metric_vs_x(rows: Sequence[dict[str, Any]], x: str, metrics: Sequence[tuple[str, str]], path: str | Path,
                title: str, xlabel: str | None = None, colour_of: Mapping[str, str] | None = None,
                caption: str | None = None, ncols: int | None = None) -> Path:
    """One panel per ``(key, label)`` metric (``ncols`` to a row; default all in one row): per
    ``rows[i]['label']`` a line against ``x`` through its means, with error bars from the rows'
    ``<key>_ci95_low``/``_high`` where they have them. When some row has no finite numeric ``x``, a bar per
    row instead, named by its label and its ``x``. ``colour_of``: label -> colour (default ``colours``)."""
    plt = _pyplot()
    labels = list(dict.fromkeys(r["label"] for r in rows))
    colour_of = colour_of or colours(labels)
    # Lines only when every run has a place on the x axis: a run without one (a trace's rate of
    # None, rate=inf) would silently be missing from the figure.
    numeric = list(rows) if all(_finite_number(r.get(x)) for r in rows) else []
    names = [r["label"] if r.get(x) is None else f"{r['label']}, {xlabel or x}={r[x]}" for r in rows]
    ncols = min(ncols or len(metrics), len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    lines = sum(len(textwrap.wrap(name, 48)) or 1 for name in names)
    height = nrows * (3.4 if numeric else 1.5 + 0.25 * lines + 0.15 * len(names))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, height), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    for i, (ax, (key, ylabel)) in enumerate(zip(axes.flat, metrics)):
        if numeric:
            log = _scale_x(ax, [r[x] for r in numeric])
            for j, label in enumerate(labels):
                # Each label's points a little to one side, so that error bars at one x do not hide each other.
                shift = _dodge([r[x] for r in numeric], (j - (len(labels) - 1) / 2) * DODGE, log)
                _line_with_errors(ax, [r for r in numeric if r["label"] == label], x, key, colour_of[label], label,
                                  shift)
            ax.set_xlabel(xlabel or x)
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
        else:  # horizontal bars, so long labels stay readable; a colour per label
            vals = [np.nan if r.get(key) is None else r[key] for r in rows]
            ax.barh(range(len(rows)), vals, xerr=_errors(rows, key), capsize=3, ecolor="0.2",
                    color=[colour_of[r["label"]] for r in rows])
            first = i % ncols == 0
            ticks = [textwrap.fill(name, 48) for name in names] if first else [""] * len(names)
            ax.set_yticks(range(len(names)), ticks, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(ylabel)
            ax.set_xlim(left=0)  # as the line plots' y axis: every metric is >= 0
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title} against {xlabel or x}" if numeric else f"{title} by configuration")
    legend = None
    if numeric:
        handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
        legend = ([handles[label] for label in labels if label in handles], [l for l in labels if l in handles])
    return _save(fig, path, caption, legend)


#: How far apart the configurations' points at one x are drawn, as a fraction of the x axis's span.
DODGE = 0.012


def _dodge(xs: Sequence[float], fraction: float, log: bool) -> Any:
    """A function moving an x value by ``fraction`` of the span of ``xs`` (of its log where the axis is log)."""
    lo, hi = min(xs), max(xs)
    if log:
        factor = (hi / lo) ** fraction
        return lambda v: v * factor
    step = (hi - lo or 1.0) * fraction
    return lambda v: v + step


def _line_with_errors(ax: Any, rows: Sequence[dict[str, Any]], x: str, key: str, colour: str, label: str,
                      shift: Any = None) -> None:
    """``rows``' means of ``key`` against ``x`` (moved by ``shift``) as a line with markers, and their 95%
    intervals as error bars."""
    rows = sorted((r for r in rows if r.get(key) is not None), key=lambda r: r[x])
    if not rows:
        return
    err = _errors(rows, key)
    xs = [shift(r[x]) if shift else r[x] for r in rows]
    ax.errorbar(xs, [r[key] for r in rows], yerr=err, marker="o", markersize=4, linewidth=1.2, capsize=3,
                color=colour, label=label)


def _errors(rows: Sequence[dict[str, Any]], key: str) -> np.ndarray | None:
    """``[[below], [above]]`` the mean of ``key`` per row from its 95% interval (0 where a row has none), or
    None when no row has one."""
    below, above = [], []
    for r in rows:
        low, high, mean = r.get(f"{key}_ci95_low"), r.get(f"{key}_ci95_high"), r.get(key)
        known = None not in (low, high, mean)
        below.append(mean - low if known else 0.0)
        above.append(high - mean if known else 0.0)
    return np.array([below, above]) if any(below) or any(above) else None


def _scale_x(ax: Any, xs: Sequence[float]) -> bool:
    """A log2 x axis where the values span 8x or more (rate sweeps double), ticked at the values
    themselves when they are few; whether it is log."""
    values = sorted({float(v) for v in xs})
    log = len(values) >= 2 and values[0] > 0 and values[-1] / values[0] >= 8
    if log:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    if len(values) <= 10:
        ax.set_xticks(values, [f"{v:g}" for v in values])
    return log


#: The latencies a comparison overlays as CDFs: summary name and ``requests.csv`` column.
CDF_METRICS = (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("e2el", "e2el_ms"))


def latency_cdf_overlay(samples: Mapping[tuple[str, Any], Mapping[str, Sequence[float]]], path: str | Path,
                        xlabel: str, colour_of: Mapping[str, str] | None = None, caption: str | None = None) -> Path:
    """CDFs of TTFT, TPOT and E2EL (ms) across configurations: ``samples`` maps ``(label, x)`` to each latency's
    values (a configuration's repeats pooled); a row of panels per ``x`` (named by ``xlabel``), a line per label."""
    plt = _pyplot()
    labels = list(dict.fromkeys(label for label, _ in samples))
    colour_of = colour_of or colours(labels)
    xs = sorted({x for _, x in samples}, key=lambda v: (not _finite_number(v), v if _finite_number(v) else 0, str(v)))
    fig, axes = plt.subplots(len(xs), len(CDF_METRICS), figsize=(4.4 * len(CDF_METRICS), 3.0 * len(xs)),
                             squeeze=False, sharex="col")
    for col, (name, _) in enumerate(CDF_METRICS):
        values = [np.asarray(v.get(name, ()), dtype=np.float64) for v in samples.values()]
        positive = np.concatenate([v[v > 0] for v in values]) if values else np.empty(0)
        for row, x in enumerate(xs):
            ax = axes[row][col]
            for label in labels:
                v = np.asarray(samples.get((label, x), {}).get(name, ()), dtype=np.float64)
                if len(v):
                    ax.step(*cdf_points(v), where="post", color=colour_of[label], label=label, linewidth=1.3)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("fraction of requests")
                if x is not None:
                    ax.set_title(f"{xlabel} = {x:g}" if _finite_number(x) else f"{xlabel} = {x}", loc="left",
                                 fontsize=9)
            if row == len(xs) - 1:
                ax.set_xlabel(axis_label(name))
        # A tail hundreds of times the median (queueing at overload) squeezes the body into one pixel column.
        if len(positive) and positive.max() / positive.min() >= 100:
            axes[0][col].set_xscale("log")
        else:
            axes[0][col].locator_params(axis="x", nbins=5)
    fig.suptitle("Latency CDFs by configuration")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    return _save(fig, path, caption, ([handles[l] for l in labels if l in handles], [l for l in labels if l in handles]))


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: PNG resolution: sharp in slides; the PDF beside each PNG is vector, for papers.
PNG_DPI = 200


def _save(fig: Any, path: str | Path, caption: str | None = None,
          legend: tuple[list[Any], list[str]] | None = None) -> Path:
    """Lay ``fig`` out with ``legend`` (handles, labels) under its panels and ``caption`` under all, then write it to
    ``path`` as a PNG and beside it as a PDF; return the PNG's path."""
    import matplotlib.pyplot as plt

    path = Path(path).with_suffix(".png")
    width, height = fig.get_figwidth(), fig.get_figheight()
    caption_lines = textwrap.wrap(caption, int(width * 15)) if caption else []
    caption_h = 0.17 * len(caption_lines) + (0.1 if caption_lines else 0)
    legend_h = 0.0
    if legend and legend[1]:
        longest = max(len(label) for label in legend[1])
        ncol = max(1, min(len(legend[1]), int(width * 12 / (longest + 6))))
        legend_h = 0.24 * math.ceil(len(legend[1]) / ncol) + 0.15
    bottom = caption_h + legend_h
    fig.set_figheight(height + bottom)
    total = height + bottom
    if legend_h:
        fig.legend(*legend, loc="lower center", bbox_to_anchor=(0.5, caption_h / total), ncol=ncol, fontsize=8,
                   frameon=False)
    if caption_lines:
        fig.text(0.5, 0.05 / total, "\n".join(caption_lines), ha="center", va="bottom", fontsize=8, color="0.25")
    fig.tight_layout(rect=(0, bottom / total, 1, 1))
    fig.savefig(path, dpi=PNG_DPI)
    fig.savefig(path.with_suffix(".pdf"), metadata={"CreationDate": None})  # no date: the same figure, the same bytes
    plt.close(fig)
    return path
