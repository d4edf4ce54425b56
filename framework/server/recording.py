"""``ServedRun``: the run's usual files (``requests.csv``, ``steps.csv``, ``summary.json``) for what the server served."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from framework.common.outputs import RequestOutput
from framework.engine.llm_engine import LLMEngine
from framework.harness.metrics import SLO, RequestRecord, summarize
from framework.harness.recorder import RunRecorder


class ServedRun:
    """Records one engine's steps and finished requests as ``framework.run`` does, in ``run_dir``. ``on_output``
    takes the engine's (delta) outputs on the engine thread; ``finish`` writes the summary. Times count from
    ``start`` on the engine's clock (after the warm-up)."""

    def __init__(self, engine: LLMEngine, run_dir: str | Path, meta: dict[str, Any], slo: SLO | None = None,
                 keep_timeline: bool = False) -> None:
        self.engine = engine
        self.meta = meta
        self.slo = slo or SLO()
        self.recorder = RunRecorder(run_dir, keep_timeline=keep_timeline)
        self.start = engine.clock.now()
        self.records: list[RequestRecord] = []
        self._token_times: dict[str, list[float]] = {}  # a delta output carries only its new tokens' times
        allocator = engine.allocator.stats
        self._hits0 = (allocator.prefix_hit_tokens, allocator.prefix_query_tokens)
        self._step_log = self.recorder.step_log(0, self.start)
        engine.step_callbacks.append(self._step_log)
        self._wall_start = time.perf_counter()
        self.recorder.write_summary({"status": "running", "interrupted": False, **meta})

    def on_output(self, out: RequestOutput) -> RequestRecord | None:
        """Keep ``out``'s token times; for a finished request, its ``requests.csv`` row (returned)."""
        times = self._token_times.setdefault(out.request_id, [])
        times.extend(out.metrics.token_times)
        if not out.finished:
            return None
        del self._token_times[out.request_id]
        if len(out.outputs) > 1:  # n > 1: one time per step that gave any sample a token, as the engine counts
            times = sorted(set(times))
        whole = dataclasses.replace(out, metrics=dataclasses.replace(out.metrics, token_times=times))
        record = RequestRecord.from_output(whole, self.start)
        self.records.append(record)
        self.recorder.add_request(record)
        return record

    def finish(self, status: str = "completed") -> dict[str, Any]:
        """Close the files and write ``summary.json``: ``vllm bench serve``'s metrics over the served span (first
        arrival to last finish), the step aggregates and the prefix-cache hit rate since the warm-up."""
        if self._step_log in self.engine.step_callbacks:
            self.engine.step_callbacks.remove(self._step_log)
        self.recorder.close()
        stats = self.engine.allocator.stats
        queries = stats.prefix_query_tokens - self._hits0[1]
        hit_rate = (stats.prefix_hit_tokens - self._hits0[0]) / queries if queries else None
        records = self.records
        duration = 0.0
        if records:
            ends = [r.arrival_time + r.e2el for r in records if r.e2el is not None]
            duration = max(ends, default=0.0) - min(r.arrival_time for r in records)
        summary = {"status": status, "interrupted": False, **self.meta, "num_requests": len(records),
                   "num_sent": len(records), "num_unfinished": 0, "wall_time_s": time.perf_counter() - self._wall_start,
                   **summarize(records, duration, self.slo, self.recorder.step_totals, hit_rate)}
        self.recorder.write_summary(summary)
        return summary
