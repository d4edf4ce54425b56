"""``ServerMetrics``: ``/metrics`` in Prometheus' text format, under vLLM's metric names where vLLM has one."""
from __future__ import annotations

import operator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from framework.engine.llm_engine import LLMEngine, StepStats
from framework.harness.metrics import RequestRecord
from framework.scheduling.output import SchedulerOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
# As vLLM: no ``*_created`` timestamp series beside each counter and histogram (process-wide in prometheus_client).
disable_created_metrics()


def _series(*values: float) -> list[float]:
    """1-2-5 steps over the decades of ``values`` (seconds or tokens)."""
    return sorted({m * 10 ** e for e in range(-3, 5) for m in (1, 2, 5) if values[0] <= m * 10 ** e <= values[1]})


#: Bucket bounds (the ``+Inf`` one is implicit).
LATENCY_BUCKETS = _series(0.001, 2000.0)
TOKEN_BUCKETS = _series(1, 50000)


class ServerMetrics:
    """A registry of its own (several servers may share a process, as tests do). Labels as vLLM's: ``model_name``
    and ``engine`` ("0"). Queue and KV gauges and the token and prefix-cache counters move each step (engine thread);
    the per-request histograms take each request when it finishes (``observe_finished``)."""

    def __init__(self, model_name: str, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.engine = engine
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def make(kind: type, name: str, doc: str, **kwargs: object):
            return kind(name, doc, names, registry=self.registry, **kwargs).labels(**labels)

        self.running = make(Gauge, "vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = make(Gauge, "servelab:num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage, the fraction of usable blocks held (1 = full).")
        self.prefix_queries = make(Counter, "vllm:prefix_cache_queries", "Prefix-cache lookups, in prompt tokens.")
        self.prefix_hits = make(Counter, "vllm:prefix_cache_hits", "Prefix-cache hits, in prompt tokens.")
        self.preemptions = make(Counter, "vllm:num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Output tokens generated.")
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.", [*names, "finished_reason"],
                                registry=self.registry)
        self._labels = labels
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds", "Time to first token (s).", buckets=LATENCY_BUCKETS)
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds", "Every gap between two output tokens (s).",
                        buckets=LATENCY_BUCKETS)
        self.tpot = make(Histogram, "vllm:request_time_per_output_token_seconds",
                         "Each request's mean time per output token after the first (s).", buckets=LATENCY_BUCKETS)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds", "Arrival to finish (s).", buckets=LATENCY_BUCKETS)
        self.queue = make(Histogram, "vllm:request_queue_time_seconds", "Arrival to first scheduled (s).",
                          buckets=LATENCY_BUCKETS)
        self.request_prompt = make(Histogram, "vllm:request_prompt_tokens", "Prompt tokens per request.",
                                   buckets=TOKEN_BUCKETS)
        self.request_generation = make(Histogram, "vllm:request_generation_tokens", "Output tokens per request.",
                                       buckets=TOKEN_BUCKETS)
        stats = engine.allocator.stats
        self._seen = (stats.prefix_hit_tokens, stats.prefix_query_tokens)
        self.update_queues()

    def __call__(self, stats: StepStats, _: SchedulerOutput) -> None:
        """A step callback (engine thread): queues, KV usage, preemptions and the prefix-cache counters."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_usage)
        self.preemptions.inc(stats.num_preempted)
        self._count_prefix_cache()

    def update_queues(self) -> None:
        """The gauges from the engine's state now (before any step, and after the last one)."""
        scheduler = self.engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.swapped.set(len(scheduler.swapped))
        self.kv_usage.set(self.engine.allocator.usage)

    def _count_prefix_cache(self) -> None:
        stats = self.engine.allocator.stats
        hits, queries = stats.prefix_hit_tokens, stats.prefix_query_tokens
        self.prefix_hits.inc(max(hits - self._seen[0], 0))
        self.prefix_queries.inc(max(queries - self._seen[1], 0))
        self._seen = (hits, queries)

    def count_generated(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def observe_finished(self, record: RequestRecord, finish_reason: str) -> None:
        """One finished request (engine thread): its latencies, sizes and finish reason."""
        self._success.labels(**self._labels, finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(record.prompt_len)
        self.request_prompt.observe(record.prompt_len)
        self.request_generation.observe(record.output_len)
        # A request of one token or none has no time per output token; vLLM counts it as 0, so that the histogram's
        # count is the finished requests' and a dashboard's mean counts them too.
        tpot = 0.0 if record.tpot is None else record.tpot
        for histogram, value in ((self.ttft, record.ttft), (self.tpot, tpot), (self.e2e, record.e2el),
                                 (self.queue, record.queueing_delay)):
            if value is not None:
                histogram.observe(value)
        times = record.token_times
        for gap in map(operator.sub, times[1:], times[:-1]):
            self.itl.observe(gap)

    def render(self) -> bytes:
        self.update_queues_if_idle()
        return generate_latest(self.registry)

    def update_queues_if_idle(self) -> None:
        """An idle engine takes no step, so the gauges would keep the last busy step's values."""
        if not self.engine.has_unfinished_requests():
            self.running.set(0)
            self.waiting.set(0)
            self.swapped.set(0)
            self.kv_usage.set(self.engine.allocator.usage)
