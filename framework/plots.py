"""PNG plots of one run (latency CDFs, step timeline) and of a comparison (metrics against
request rate, one line per configuration). Headless: matplotlib's Agg backend."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from framework.metrics import RequestRecord, latencies


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
            v = np.sort(np.asarray(latencies(group, name), dtype=np.float64) * 1000)
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post",
                        label="all" if prio is None else f"priority {prio}")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(groups) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"Latency CDFs ({len(done)} completed requests)")
    return _save(fig, path)


def timeline(steps: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Per step against run time: prefill and decode tokens, queue lengths, KV cache usage."""
    plt = _pyplot()
    t = np.array([s["time_s"] for s in steps], dtype=np.float64)
    col = lambda k: np.array([s[k] for s in steps], dtype=np.float64)  # noqa: E731
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    # A bar spans its step; a step of zero duration (a virtual clock) still gets a visible width.
    span = float(t[-1] - t[0]) if len(t) > 1 else 1.0
    width = np.maximum(col("duration"), span / max(len(t), 1) / 2)
    a.bar(t, col("num_prefill_tokens"), width=width, align="edge", label="prefill", color="tab:orange")
    a.bar(t, col("num_decode_tokens"), width=width, align="edge", bottom=col("num_prefill_tokens"),
          label="decode", color="tab:blue")
    a.set_ylabel("tokens per step")
    a.legend(fontsize=8)
    for key, label in (("num_running", "running"), ("num_waiting", "waiting"), ("num_swapped", "swapped")):
        b.step(t, col(key), where="post", label=label)
    b.set_ylabel("requests")
    b.legend(fontsize=8)
    c.step(t, 100 * col("kv_usage"), where="post", color="tab:green")
    c.set_ylabel("KV cache used (%)")
    c.set_ylim(0, 105)
    c.set_xlabel("time since start (s)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.suptitle(f"Step timeline ({len(steps)} steps)")
    return _save(fig, path)


def metric_vs_x(rows: Sequence[dict[str, Any]], x: str, metrics: Sequence[tuple[str, str]], path: str | Path,
                title: str, xlabel: str | None = None) -> Path:
    """One panel per ``(key, label)`` metric: a line per ``rows[i]['label']`` against ``x``
    (bars per label when no row has a numeric ``x``). ``title`` names what is plotted."""
    plt = _pyplot()
    labels = list(dict.fromkeys(r["label"] for r in rows))
    numeric = [r for r in rows if isinstance(r.get(x), (int, float)) and not isinstance(r.get(x), bool)]
    height = 4 if numeric else 1.5 + 0.4 * len(labels)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), height), squeeze=False)
    for ax, (key, ylabel) in zip(axes[0], metrics):
        if numeric:
            for label in labels:
                pts = sorted((r[x], r[key]) for r in numeric if r["label"] == label and r.get(key) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
            ax.set_xlabel(xlabel or x)
        else:  # horizontal bars, so long labels stay readable
            vals = [next((r[key] for r in rows if r["label"] == lb and r.get(key) is not None), np.nan) for lb in labels]
            ax.barh(range(len(labels)), vals, color=[f"C{i}" for i in range(len(labels))])
            ax.set_yticks(range(len(labels)), labels if ax is axes[0][0] else [""] * len(labels), fontsize=8)
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


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
