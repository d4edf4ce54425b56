"""``ServedRun``'s summary: the served span and the prefix-cache hits since the run started."""
from __future__ import annotations

import json

from framework.harness.metrics import RequestRecord
from framework.server.recording import ServedRun


def test_the_summary_covers_the_served_span_and_the_cache_lookups_since_the_start(engine, tmp_path):
    cache = engine.allocator.stats
    cache.prefix_query_tokens += 48  # the warm-up's lookups, all hits
    cache.prefix_hit_tokens += 48
    run = ServedRun(engine, tmp_path, {"workload": "served"})
    cache.prefix_query_tokens += 32
    cache.prefix_hit_tokens += 16
    for rid, arrival in (("a", 2.0), ("b", 3.0)):  # the first client came two seconds after the start
        run.records.append(RequestRecord(rid, "length", arrival_time=arrival, prompt_len=4, output_len=2,
                                         queueing_delay=0.0, ttft=0.5, tpot=0.5, e2el=1.0))
    summary = run.finish()
    assert summary["duration_s"] == 2.0 and summary["prefix_cache_hit_rate"] == 0.5
    assert json.loads((tmp_path / "summary.json").read_text())["duration_s"] == 2.0
