"""The summary table a run prints, laid out like ``vllm bench serve``'s result block."""
from __future__ import annotations

from typing import Any

from framework.harness.metrics import LATENCIES, PERCENTILES

_STATS = [("mean", "Mean"), ("median", "Median"), ("std", "Std")] + [(f"p{p}", f"P{p}") for p in PERCENTILES]

_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency", "queueing_delay": "Queueing Delay"}
WIDTH = 50


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    lines = [f"{' ' + title + ' ':=^{WIDTH}}"]

    def row(label: str, key: str, fmt: str = "{:.2f}") -> None:
        value = summary.get(key)
        if value is not None:
            lines.append(f"{label:<40}{fmt.format(value) if not isinstance(value, str) else value:>10}")

    row("Status:", "status", "{}")
    row("Successful requests:", "completed", "{}")
    row("Failed requests:", "failed", "{}")
    if summary.get("num_ignored"):  # never run (a prompt the engine cannot take): not to be missed
        row("  of which never run (ignored):", "num_ignored", "{}")
    for reason, count in (summary.get("failure_reasons") or {}).items():
        lines.append(f"  {count} x {reason}")
    if summary.get("num_unfinished"):  # a stopped run's requests still in flight: neither counted above
        row("Unfinished (the run stopped):", "num_unfinished", "{}")
    row("Benchmark duration (s):", "duration_s")
    row("Total input tokens:", "total_input_tokens", "{}")
    row("Total generated tokens:", "total_output_tokens", "{}")
    row("Request throughput (req/s):", "request_throughput")
    row("Request goodput (req/s):", "request_goodput")
    row("Output token throughput (tok/s):", "output_throughput")
    row("Total token throughput (tok/s):", "total_token_throughput")
    row("Prefix cache hit rate:", "prefix_cache_hit_rate", "{:.3f}")
    row("Preemptions:", "num_preemptions", "{}")
    row("Swaps:", "num_swaps", "{}")
    row("Max KV cache usage:", "max_kv_usage", "{:.3f}")
    row("Step-time noise (CV, same shape):", "step_time_noise_cv", "{:.1%}")
    for name in LATENCIES:
        if summary.get(f"mean_{name}_ms") is None:
            continue
        lines.append(f"{' ' + _TITLES[name] + ' ':-^{WIDTH}}")
        for stat, label in _STATS:
            row(f"{label} {name.upper() if name != 'queueing_delay' else 'queueing delay'} (ms):", f"{stat}_{name}_ms")
    lines.append("=" * WIDTH)
    return "\n".join(lines)
