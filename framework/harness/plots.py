"""PNG plots, drawn headless (Agg): a run's latency CDFs and step timeline, a comparison's metrics."""
from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from framework.harness.metrics import RequestRecord, latencies


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def latency_cdfs(records: Sequence[RequestRecord], path: str | Path) -> Path:
    """CDFs of TTFT, TPOT, ITL and E2EL (ms) of the completed requests, a line per priority
    when priorities differ."""
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
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"Latency CDFs ({len(done)} completed requests)")
    return _save(fig, path)


def timeline(steps: Mapping[str, Any], path: str | Path, max_points: int = MAX_POINTS,
             bins: int = TIMELINE_BINS) -> Path:
    """Against run time: tokens per step (prefill and decode), queue lengths and KV cache usage.

    ``steps`` holds ``steps.csv`` columns (``time_s``, ``duration``, ``num_prefill_tokens``,
    ``num_decode_tokens``, ``num_running``, ``num_waiting``, ``num_swapped``, ``kv_usage`` and,
    for a cluster, ``replica``). One replica with at most ``max_points`` steps is drawn step by
    step; otherwise the run is cut into ``bins`` time bins (``binned_timeline``)."""
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
        a.bar(t, col["num_prefill_tokens"], width=width, align="edge", label="prefill", color="tab:orange")
        a.bar(t, col["num_decode_tokens"], width=width, align="edge", bottom=col["num_prefill_tokens"],
              label="decode", color="tab:blue")
        a.set_ylabel("tokens per step")
        x, queues, kv = t, {k: col[k] for k in ("num_running", "num_waiting", "num_swapped")}, col["kv_usage"]
        title = f"Step timeline ({len(t)} steps)"
    else:
        edges, prefill, decode, queues, kv = binned_timeline(col, replicas, bins)
        x = edges[:-1]
        a.stairs(prefill, edges, fill=True, label="prefill", color="tab:orange")
        a.stairs(prefill + decode, edges, baseline=prefill, fill=True, label="decode", color="tab:blue")
        a.set_ylabel("tokens per second")
        title = (f"Timeline ({len(t)} steps" + (f" on {num_replicas} replicas" if num_replicas > 1 else "")
                 + f", {bins} time bins)")
    a.legend(fontsize=8)
    for key, label in (("num_running", "running"), ("num_waiting", "waiting"), ("num_swapped", "swapped")):
        b.step(x, queues[key], where="post", label=label)
    b.set_ylabel("requests" if num_replicas == 1 else "requests (all replicas)")
    b.legend(fontsize=8)
    c.step(x, 100 * kv, where="post", color="tab:green")
    c.set_ylabel("KV cache used (%)" if num_replicas == 1 else "KV cache used (%, mean of replicas)")
    c.set_ylim(0, 105)
    c.set_xlabel("time since start (s)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path)


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
                title: str, xlabel: str | None = None) -> Path:
    """One panel per ``(key, label)`` metric: a line per ``rows[i]['label']`` against ``x``
    (when some row has no finite numeric ``x``, a bar per row, named by its label and its ``x``:
    runs that share a label differ in ``x``, or are repeats). ``title`` names what is plotted."""
    plt = _pyplot()
    labels = list(dict.fromkeys(r["label"] for r in rows))
    # Lines only when every run has a place on the x axis: a run without one (a trace's rate of
    # None, rate=inf) would silently be missing from the figure.
    numeric = list(rows) if all(_finite_number(r.get(x)) for r in rows) else []
    names = [r["label"] if r.get(x) is None else f"{r['label']}, {xlabel or x}={r[x]}" for r in rows]
    lines = sum(len(textwrap.wrap(name, 48)) or 1 for name in names)
    height = 4 if numeric else 1.5 + 0.25 * lines + 0.15 * len(names)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), height), squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], metrics):
        if numeric:
            for label in labels:
                pts = sorted((r[x], r[key]) for r in numeric if r["label"] == label and r.get(key) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
            ax.set_xlabel(xlabel or x)
        else:  # horizontal bars, so long labels stay readable; a colour per label
            vals = [np.nan if r.get(key) is None else r[key] for r in rows]
            ax.barh(range(len(rows)), vals, color=[f"C{labels.index(r['label'])}" for r in rows])
            ticks = [textwrap.fill(name, 48) for name in names] if ax is axes[0][0] else [""] * len(names)
            ax.set_yticks(range(len(names)), ticks, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(ylabel)
            ax.grid(alpha=0.3)
            continue
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if numeric and len(labels) > 1:
        axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{title} against {xlabel or x}" if numeric else f"{title} by configuration")
    return _save(fig, path)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
