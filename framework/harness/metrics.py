"""Serving metrics in ``vllm bench serve``'s vocabulary, computed from what the engine recorded.

Per request (``RequestRecord``): TTFT (arrival to first token), TPOT (mean gap between output
tokens after the first), ITL (every gap), E2EL (arrival to finish), queueing delay (arrival to
first scheduled), preemptions and swaps. Per run (``summarize``): request, output and total
token throughput over the run's duration; mean / median / std / p90 / p99 of each latency (numpy
definitions: population std, linearly interpolated percentiles; ITL pools every gap of every
request); goodput (completed requests per second meeting every SLO given); prefix-cache hit
rate; preemption and swap counts; and a per-priority breakdown when priorities differ.
Latencies are reported in milliseconds, like vLLM; records keep seconds. ``step_time_noise`` measures
the machine's timing noise from the steps themselves: how much steps of one shape vary.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

import numpy as np

from framework.common.config import is_finite_number
from framework.engine.llm_engine import StepStats
from framework.common.outputs import RequestOutput

LATENCIES = ("ttft", "tpot", "itl", "e2el", "queueing_delay")
PERCENTILES = (90, 99)


@dataclass
class RequestRecord:
    """One finished request; times in seconds, relative to the start of the run, except
    ``token_times`` (when each output token came, on the engine's clock: only their gaps, the
    ITLs, are used). ``token_times`` is the output's own list, shared rather than copied."""

    request_id: str
    status: str  # "length" / "stop" (completed), "ignored" (never fit), "abort"
    priority: int = 0
    arrival_time: float = 0.0
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    queueing_delay: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_swaps: int = 0
    message: str = ""

    @property
    def completed(self) -> bool:
        return self.status in ("length", "stop") and self.output_len > 0

    @classmethod
    def from_output(cls, out: RequestOutput, run_start: float = 0.0) -> RequestRecord:
        m = out.metrics
        reason = out.outputs[0].finish_reason if out.outputs else None
        status = "abort" if reason == "abort" else ("ignored" if out.status_message and not m.num_generated_tokens
                                                     else (reason or "unfinished"))
        return cls(out.request_id, status, out.priority, m.arrival_time - run_start, m.num_prompt_tokens,
                   m.num_generated_tokens, m.num_cached_tokens, m.time_in_queue, m.ttft, m.tpot, m.e2el,
                   m.token_times, m.num_preemptions, m.num_swaps, out.status_message or "")

    def row(self) -> dict[str, Any]:
        """A ``requests.csv`` row: latencies in ms. Of the ITLs only the longest (the worst stall
        the request saw) is kept, so a row's size does not grow with the output; the run's ITL
        statistics and CDF pool every gap."""
        return dict(zip(REQUEST_COLUMNS, self.values()))

    def values(self) -> list[Any]:
        """``row()``'s values, in ``REQUEST_COLUMNS`` order."""
        t = self.token_times
        return [self.request_id, self.status, self.priority, round(self.arrival_time, 6), self.prompt_len,
                self.output_len, self.cached_tokens, _ms(self.queueing_delay), _ms(self.ttft), _ms(self.tpot),
                _ms(self.e2el), _ms(max(map(operator.sub, islice(t, 1, None), t))) if len(t) > 1 else None,
                self.num_preemptions, self.num_swaps, self.message]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


REQUEST_COLUMNS = ["request_id", "status", "priority", "arrival_s", "prompt_len", "output_len", "cached_tokens",
                   "queueing_delay_ms", "ttft_ms", "tpot_ms", "e2el_ms", "max_itl_ms", "num_preemptions", "num_swaps",
                   "message"]
#: ``StepStats`` fields, the columns of the engine's per-step records.
STATS_COLUMNS = [f.name for f in dataclasses.fields(StepStats)]
#: ``steps.csv``: each step's start in seconds since the run began, then its ``StepStats``.
STEP_COLUMNS = ["time_s"] + STATS_COLUMNS


@dataclass
class StepTotals:
    """Run-level aggregates of the step records, kept as steps come: counts and sums, and each
    step's KV usage (8 bytes a step) so that its mean is exactly rounded whatever order or
    grouping the steps came in (a fast-forwarded run gives the step-by-step summary bit for bit)."""

    num_steps: int = 0
    kv_usage: array = field(default_factory=lambda: array("d"))
    max_kv_usage: float = 0.0
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0

    def add(self, num_steps: int, kv_usage: Sequence[float], scheduled_tokens: int, prefill_tokens: int,
            swapped_out_blocks: int, swapped_in_blocks: int) -> None:
        """``num_steps`` more steps: the KV usage after each, and their token and block sums."""
        if not num_steps:
            return
        self.num_steps += num_steps
        self.kv_usage.extend(kv_usage)
        self.max_kv_usage = max(self.max_kv_usage, max(kv_usage))
        self.scheduled_tokens += scheduled_tokens
        self.prefill_tokens += prefill_tokens
        self.swapped_out_blocks += swapped_out_blocks
        self.swapped_in_blocks += swapped_in_blocks

    def summary(self) -> dict[str, Any]:
        """Work done, independent of timing noise: recompute preemption shows up as extra
        prefill tokens, swapping as block copies, prefix caching as prefill tokens saved."""
        n = self.num_steps
        return {"num_steps": n, "mean_kv_usage": math.fsum(self.kv_usage) / n, "max_kv_usage": float(self.max_kv_usage),
                "mean_tokens_per_step": self.scheduled_tokens / n, "total_scheduled_tokens": self.scheduled_tokens,
                "total_prefill_tokens": self.prefill_tokens, "blocks_swapped_out": self.swapped_out_blocks,
                "blocks_swapped_in": self.swapped_in_blocks}


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in ms; None leaves that latency unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, name)
            # A bool is no number of milliseconds: slo.ttft_ms=true would be a 1 ms SLO.
            if v is not None and not (is_finite_number(v) and v > 0):
                raise ValueError(f"slo.{name} must be a positive number of milliseconds or null, got {v!r}")

    @property
    def configured(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met(self, r: RequestRecord) -> bool:
        """As vLLM: a request with a single output token has no TPOT and meets any TPOT SLO."""
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot or 0.0), (self.e2el_ms, r.e2el))
        return all(slo is None or (v is not None and 1000 * v <= slo) for slo, v in checks)


def latency_stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """``mean_/median_/std_/p90_/p99_{name}_ms`` of latencies given in seconds (None if empty)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{p}_{name}_ms" for p in PERCENTILES]
    if not len(values_s):
        return dict.fromkeys(keys)
    # Sorted, so the mean and std do not depend on the order the records came in (a simulated
    # cluster fast-forwarding delivers them in another order than stepping); percentiles cost no more.
    v = np.sort(np.asarray(values_s, dtype=np.float64) * 1000)
    median, *tails = np.percentile(v, [50, *PERCENTILES])
    stats = [v.mean(), median, v.std(), *tails]
    return {k: float(s) for k, s in zip(keys, stats)}


def latencies(records: Sequence[RequestRecord], name: str) -> Sequence[float]:
    """The ``name`` latency (seconds) of every record that has one; ``itl`` pools every gap."""
    if name == "itl":
        return itl_gaps(records)
    return [getattr(r, name) for r in records if getattr(r, name) is not None]


def itl_gaps(records: Sequence[RequestRecord]) -> np.ndarray:
    """Every inter-token gap of every record, in one array (computed in bulk: a long run has
    millions)."""
    times = [r.token_times for r in records if len(r.token_times) > 1]
    if not times:
        return np.empty(0)
    lengths = np.fromiter(map(len, times), dtype=np.int64, count=len(times))
    flat = np.fromiter(chain.from_iterable(times), dtype=np.float64, count=int(lengths.sum()))
    gaps = np.diff(flat)
    keep = np.ones(len(gaps), dtype=bool)
    keep[np.cumsum(lengths)[:-1] - 1] = False  # the gaps between one request's last token and the next's first
    return gaps[keep]


#: Steps of one shape it takes for their spread to count toward a run's timing noise.
NOISE_MIN_STEPS = 5


def step_time_noise(steps: Iterable[tuple[int, int, int, float]], min_steps: int = NOISE_MIN_STEPS) -> dict[str, Any]:
    """The machine's timing noise as a run saw it, from ``(requests, prefill tokens, decode tokens, duration)`` per
    step: the pooled coefficient of variation of the durations of steps of one shape (groups of ``min_steps`` or
    more), ``sqrt(sum (t / group mean - 1)^2 / sum (group size - 1))``; None when no group is that large."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for reqs, prefill, decode, duration in steps:
        groups.setdefault((reqs, prefill, decode), []).append(duration)
    squares, dof, counted, shapes = 0.0, 0, 0, 0
    for durations in groups.values():
        mean = math.fsum(durations) / len(durations)
        if len(durations) < min_steps or mean <= 0:
            continue
        squares += math.fsum((t / mean - 1) ** 2 for t in durations)
        dof += len(durations) - 1
        counted += len(durations)
        shapes += 1
    return {"step_time_noise_cv": math.sqrt(squares / dof) if dof else None, "step_time_noise_steps": counted,
            "step_time_noise_shapes": shapes}


_SIZES = re.compile(r"\b(prompt of|needs) \d+ (tokens|KV blocks)\b")


def failure_reasons(records: Sequence[RequestRecord]) -> dict[str, int]:
    """How many of ``records`` failed for each reason, most common first: the scheduler's message
    with the request's own sizes left out (``prompt of N tokens needs N KV blocks but ...``),
    else the status (``abort``, ``unfinished``)."""
    reasons = Counter(_SIZES.sub(r"\1 N \2", r.message) if r.message else r.status for r in records)
    return dict(reasons.most_common())


def summarize(records: Sequence[RequestRecord], duration: float, slo: SLO | None = None,
              steps: StepTotals | None = None, prefix_cache_hit_rate: float | None = None,
              preemptions: tuple[int, int] | None = None) -> dict[str, Any]:
    """Run-level metrics over ``duration`` seconds. Latencies and throughputs count completed
    requests only; ignored and aborted ones are counted as ``failed`` (the ignored, never run,
    also as ``num_ignored``). ``steps`` adds the step aggregates when it counted any step. ``preemptions``: the
    (preemptions, swap-outs) the engines counted, requests cut off unrecorded included; None: the records' sums."""
    slo = slo or SLO()
    done = [r for r in records if r.completed]
    dur = duration if duration > 0 else float("nan")
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "num_ignored": sum(r.status == "ignored" for r in records),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "request_goodput": sum(slo.met(r) for r in done) / dur if slo.configured else None,
    }
    for name in LATENCIES:
        summary.update(latency_stats(name, latencies(done, name)))
    if len(done) < len(records):  # a second pass over the records only when some failed
        summary["failure_reasons"] = failure_reasons([r for r in records if not r.completed])
    if preemptions is None:
        preemptions = sum(r.num_preemptions for r in records), sum(r.num_swaps for r in records)
    summary["num_preemptions"], summary["num_swaps"] = preemptions
    summary["prefix_cache_hit_rate"] = prefix_cache_hit_rate
    cached = sum(r.cached_tokens for r in done)
    summary["cached_prompt_fraction"] = cached / in_tokens if in_tokens else None
    if steps is not None and steps.num_steps:
        summary.update(steps.summary())
    # Every class that was sent, so one whose requests all failed still shows (with 0 completed).
    priorities = sorted({r.priority for r in records})
    if len(priorities) > 1:
        for p in priorities:
            group = [r for r in done if r.priority == p]
            summary[f"prio{p}_completed"] = len(group)
            for name in ("ttft", "tpot", "e2el"):
                stats = latency_stats(name, latencies(group, name))
                summary[f"prio{p}_mean_{name}_ms"] = stats[f"mean_{name}_ms"]
                summary[f"prio{p}_p99_{name}_ms"] = stats[f"p99_{name}_ms"]
    return summary
