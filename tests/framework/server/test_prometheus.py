"""``ServerMetrics`` over an engine of its own: the step callback's gauges and counters, and each finished request's
histograms, as ``/metrics`` renders them."""
from __future__ import annotations

import dataclasses
import re

from framework.common.sampling_params import SamplingParams
from framework.engine.llm_engine import StepStats
from framework.harness.metrics import RequestRecord
from framework.server.prometheus import ServerMetrics


def value(metrics: ServerMetrics, name: str, labels: str = "") -> float:
    found = re.search(rf'^{re.escape(name)}{{[^}}]*{labels}[^}}]*}} (\S+)$', metrics.render().decode(), re.M)
    assert found, name
    return float(found.group(1))


def stats(**values) -> StepStats:
    return StepStats(**{f.name: 0 for f in dataclasses.fields(StepStats)} | values)


def test_a_step_sets_the_queue_gauges_and_counts_preemptions(engine):
    metrics = ServerMetrics("m", engine)
    engine.add_request("busy", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    for _ in range(2):
        metrics(stats(num_running=2, num_waiting=3, num_swapped=1, kv_usage=0.5, num_preempted=2), None)
    assert value(metrics, "vllm:num_requests_running") == 2 and value(metrics, "vllm:num_requests_waiting") == 3
    assert value(metrics, "servelab:num_requests_swapped") == 1 and value(metrics, "vllm:kv_cache_usage_perc") == 0.5
    assert value(metrics, "vllm:num_preemptions_total") == 4


def test_an_idle_engine_shows_empty_queues(engine):
    metrics = ServerMetrics("m", engine)
    metrics(stats(num_running=2, num_waiting=3, num_swapped=1, kv_usage=0.5), None)  # the last busy step
    assert not engine.has_unfinished_requests()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "servelab:num_requests_swapped",
                 "vllm:kv_cache_usage_perc"):
        assert value(metrics, name) == 0, name


def test_a_finished_request_counts_in_every_histogram(engine):
    metrics = ServerMetrics("m", engine)
    record = RequestRecord("r", "length", prompt_len=7, output_len=4, queueing_delay=0.01, ttft=0.02, tpot=0.01,
                           e2el=0.05, token_times=[1.0, 1.01, 1.03, 1.04])
    metrics.observe_finished(record, "length")
    assert value(metrics, "vllm:request_success_total", 'finished_reason="length"') == 1
    assert value(metrics, "vllm:prompt_tokens_total") == 7
    assert value(metrics, "vllm:request_prompt_tokens_sum") == 7
    assert value(metrics, "vllm:request_generation_tokens_sum") == 4
    for name in ("time_to_first_token_seconds", "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert value(metrics, f"vllm:{name}_count") == 1, name
    assert value(metrics, "vllm:inter_token_latency_seconds_count") == 3
    assert abs(value(metrics, "vllm:inter_token_latency_seconds_sum") - 0.04) < 1e-9


def test_the_prefix_cache_counters_count_each_lookup_once(engine):
    metrics = ServerMetrics("m", engine)
    cache = engine.allocator.stats
    for queried, hit in ((48, 32), (16, 16)):
        cache.prefix_query_tokens += queried
        cache.prefix_hit_tokens += hit
        for _ in range(3):
            metrics(stats(), None)
    assert value(metrics, "vllm:prefix_cache_queries_total") == 64
    assert value(metrics, "vllm:prefix_cache_hits_total") == 48
