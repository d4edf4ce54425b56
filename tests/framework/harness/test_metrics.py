"""Serving metrics on hand-made timelines whose TTFT / TPOT / ITL / E2EL / goodput are known."""
import math

import pytest

from framework.harness.metrics import SLO, RequestRecord, StepTotals, itl_gaps, latency_stats, summarize
from framework.common.outputs import CompletionOutput, RequestMetrics, RequestOutput
from framework.harness.report import format_summary


def output(rid, arrival, scheduled, token_times, prompt_len=10, priority=0, reason="length", message=None,
           preemptions=0, swaps=0, cached=0):
    m = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled,
                       first_token_time=token_times[0] if token_times else None,
                       last_token_time=token_times[-1] if token_times else None,
                       finished_time=token_times[-1] if token_times else scheduled or arrival,
                       token_times=list(token_times), num_prompt_tokens=prompt_len,
                       num_generated_tokens=len(token_times), num_cached_tokens=cached,
                       num_preemptions=preemptions, num_swaps=swaps)
    return RequestOutput(rid, None, [1] * prompt_len, [CompletionOutput(0, "", [5] * len(token_times), reason)],
                         True, m, cached, message, priority)


# Run starts at t=100 s. Request a: arrives 100.0, scheduled 100.05, tokens at 100.1, 100.2, 100.4
#   TTFT 100 ms, TPOT (0.4-0.1)/2 = 150 ms, ITLs 100 and 200 ms, E2EL 400 ms, queue 50 ms.
# Request b: arrives 100.5, scheduled 100.5, tokens at 100.7, 100.8: TTFT 200, TPOT 100, ITL 100,
#   E2EL 300, queue 0.
# Request c: arrives 101.0, scheduled 101.3, one token at 101.4: TTFT 400, no TPOT, E2EL 400, queue 300.
TIMELINE = [
    output("a", 100.0, 100.05, [100.1, 100.2, 100.4], prompt_len=10, preemptions=1, swaps=1, cached=4),
    output("b", 100.5, 100.5, [100.7, 100.8], prompt_len=20, priority=1),
    output("c", 101.0, 101.3, [101.4], prompt_len=30, reason="stop"),
]


def records():
    return [RequestRecord.from_output(o, run_start=100.0) for o in TIMELINE]


def test_per_request_latencies():
    a, b, c = records()
    assert a.arrival_time == pytest.approx(0.0) and c.arrival_time == pytest.approx(1.0)
    assert (a.ttft, a.tpot, a.e2el, a.queueing_delay) == pytest.approx((0.1, 0.15, 0.4, 0.05))
    assert itl_gaps([a]) == pytest.approx([0.1, 0.2])
    assert (b.ttft, b.tpot, b.e2el, b.queueing_delay) == pytest.approx((0.2, 0.1, 0.3, 0.0))
    assert c.ttft == pytest.approx(0.4) and c.tpot is None and len(itl_gaps([c])) == 0 and c.e2el == pytest.approx(0.4)
    assert (a.num_preemptions, a.num_swaps, a.cached_tokens) == (1, 1, 4)
    assert [r.status for r in (a, b, c)] == ["length", "length", "stop"]
    row = a.row()
    assert row["ttft_ms"] == pytest.approx(100.0) and row["max_itl_ms"] == pytest.approx(200.0)
    assert c.row()["max_itl_ms"] is None


def test_run_summary_throughputs_and_latency_statistics():
    s = summarize(records(), duration=2.0)
    assert s["completed"] == 3 and s["failed"] == 0
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(33.0)
    # TTFT 100, 200, 400 ms: mean 233.3, median 200, population std, linear percentiles.
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2) / 3))
    assert s["p90_ttft_ms"] == pytest.approx(200 + 0.8 * 200)
    assert s["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 200)
    # TPOT only for requests with two or more tokens: 150 and 100.
    assert s["mean_tpot_ms"] == pytest.approx(125) and s["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 50)
    # ITL pools every gap: 100, 200 (a) and 100 (b).
    assert s["mean_itl_ms"] == pytest.approx(400 / 3) and s["median_itl_ms"] == pytest.approx(100)
    assert s["mean_e2el_ms"] == pytest.approx(1100 / 3)
    assert s["mean_queueing_delay_ms"] == pytest.approx(350 / 3)
    assert s["num_preemptions"] == 1 and s["num_swaps"] == 1
    assert s["request_goodput"] is None  # no SLO given
    assert s["cached_prompt_fraction"] == pytest.approx(4 / 60)


def test_goodput_counts_requests_meeting_every_slo():
    recs = records()
    # TTFT <= 250 ms keeps a and b; adding TPOT <= 120 drops a (150 ms); c has no TPOT and meets
    # any TPOT SLO but fails the TTFT one.
    assert summarize(recs, 2.0, SLO(ttft_ms=250))["request_goodput"] == pytest.approx(2 / 2.0)
    assert summarize(recs, 2.0, SLO(ttft_ms=250, tpot_ms=120))["request_goodput"] == pytest.approx(1 / 2.0)
    assert summarize(recs, 2.0, SLO(tpot_ms=120))["request_goodput"] == pytest.approx(2 / 2.0)
    assert summarize(recs, 2.0, SLO(e2el_ms=350))["request_goodput"] == pytest.approx(1 / 2.0)
    assert summarize(recs, 4.0, SLO(ttft_ms=1000, tpot_ms=1000, e2el_ms=1000))["request_goodput"] == pytest.approx(0.75)
    # A latency at the SLO meets it, as in vLLM (latencies exact in binary).
    at = RequestRecord("t", "length", output_len=2, ttft=0.125, tpot=0.25, e2el=0.5)
    assert SLO(ttft_ms=125, tpot_ms=250, e2el_ms=500).met(at)
    assert not SLO(ttft_ms=124.99).met(at) and not SLO(tpot_ms=249.99).met(at) and not SLO(e2el_ms=499.99).met(at)


def test_failed_requests_are_counted_but_not_in_latencies():
    ignored = output("x", 100.2, None, [], prompt_len=5000, message="prompt of 5000 tokens is longer than max_model_len")
    recs = records() + [RequestRecord.from_output(ignored, 100.0)]
    assert recs[-1].status == "ignored" and not recs[-1].completed
    s = summarize(recs, 2.0)
    assert s["completed"] == 3 and s["failed"] == 1 and s["total_input_tokens"] == 60
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3)


def test_a_finished_output_with_tokens_is_completed_whatever_its_message_and_one_without_is_not():
    # Only a request that never ran (no tokens, a message saying why) is ignored.
    with_message = RequestRecord.from_output(output("m", 100.0, 100.0, [100.1, 100.2], message="a note"), 100.0)
    assert with_message.status == "length" and with_message.completed
    assert not RequestRecord("z", "length", output_len=0).completed


def test_the_cached_fraction_is_of_completed_requests_prompts_only():
    # Its denominator counts completed requests' prompt tokens: a failed request's hits stay out of both.
    aborted = RequestRecord("w", "abort", prompt_len=50, cached_tokens=40)
    assert summarize([*records(), aborted], 2.0)["cached_prompt_fraction"] == pytest.approx(4 / 60)


def test_step_totals_take_no_steps_as_nothing_and_keep_the_largest_usage():
    steps = StepTotals()
    steps.add(0, [], 0, 0, 0, 0)  # a fast-forward that advanced no step
    assert steps.num_steps == 0
    steps.add(1, [0.9], 1, 1, 0, 0)
    steps.add(2, [0.2, 0.3], 2, 0, 0, 0)
    assert steps.summary()["max_kv_usage"] == 0.9 and steps.summary()["num_steps"] == 3


def test_per_priority_breakdown_and_step_statistics():
    steps = StepTotals()
    steps.add(1, [0.25], scheduled_tokens=30, prefill_tokens=30, swapped_out_blocks=0, swapped_in_blocks=3)
    steps.add(1, [0.75], scheduled_tokens=2, prefill_tokens=0, swapped_out_blocks=3, swapped_in_blocks=0)
    s = summarize(records(), 2.0, steps=steps, prefix_cache_hit_rate=0.5)
    assert s["prio0_completed"] == 2 and s["prio1_completed"] == 1
    assert s["prio0_mean_ttft_ms"] == pytest.approx(250) and s["prio1_mean_ttft_ms"] == pytest.approx(200)
    assert s["prio1_p99_e2el_ms"] == pytest.approx(300)
    assert (s["num_steps"], s["mean_kv_usage"], s["max_kv_usage"], s["mean_tokens_per_step"]) == (2, 0.5, 0.75, 16.0)
    assert (s["total_scheduled_tokens"], s["total_prefill_tokens"], s["blocks_swapped_out"], s["blocks_swapped_in"]) == \
        (32, 30, 3, 3)
    assert s["prefix_cache_hit_rate"] == 0.5
    assert "prio0_completed" not in summarize(records()[:1], 1.0)
    # A class whose every request failed still has its line: 0 completed, no latencies.
    ignored = RequestRecord.from_output(output("d", 101.0, None, [], priority=2, message="prompt too long"), 100.0)
    s = summarize([*records(), ignored], 2.0)
    assert (s["prio2_completed"], s["prio2_mean_ttft_ms"], s["prio1_completed"]) == (0, None, 1)
    assert "num_steps" not in summarize(records(), 2.0, steps=StepTotals())


def test_pooled_itls_leave_out_the_gaps_between_requests():
    gaps = itl_gaps(records())
    assert gaps.tolist() == pytest.approx([0.1, 0.2, 0.1])  # c has a single token: no gap
    assert itl_gaps([]).size == 0


def test_empty_statistics_and_bad_slo():
    assert latency_stats("ttft", []) == {k: None for k in latency_stats("ttft", [1.0])}
    for bad in (-1, 0):
        with pytest.raises(ValueError, match="slo.ttft_ms must be a positive number"):
            SLO(ttft_ms=bad)


def test_a_bool_slo_is_refused():
    # slo.ttft_ms=true was taken as an SLO of 1 ms.
    for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
        with pytest.raises(ValueError, match=f"slo.{name} must be a positive number of milliseconds or null, got True"):
            SLO(**{name: True})


def test_failed_requests_are_counted_by_reason():
    failed = [
        RequestRecord("x", "ignored", prompt_len=612, message="prompt of 612 tokens is longer than max_model_len=512"),
        RequestRecord("y", "ignored", prompt_len=900, message="prompt of 900 tokens is longer than max_model_len=512"),
        RequestRecord("z", "ignored", prompt_len=40, message="prompt of 40 tokens needs 3 KV blocks but the cache has 2"),
        RequestRecord("v", "ignored", prompt_len=70, message="prompt of 70 tokens needs 5 KV blocks but the cache has 2"),
        RequestRecord("w", "abort"),
    ]
    s = summarize([*records(), *failed], duration=2.0)
    assert s["failed"] == 5
    assert s["failure_reasons"] == {"prompt of N tokens is longer than max_model_len=512": 2,
                                    "prompt of N tokens needs N KV blocks but the cache has 2": 2, "abort": 1}
    assert list(s["failure_reasons"].values()) == [2, 2, 1]  # most common first
    assert "failure_reasons" not in summarize(records(), duration=2.0)
    report = format_summary(s)
    assert "  2 x prompt of N tokens is longer than max_model_len=512" in report and "  1 x abort" in report
    assert "Unfinished" not in report
    stopped = format_summary({**s, "status": "interrupted", "num_unfinished": 40})
    assert "Unfinished (the run stopped):" + " " * 19 + "40" in stopped.splitlines()


def test_latency_statistics_do_not_depend_on_the_order_of_the_values():
    """Means and deviations summed in the order given differed in the last digits when the same
    latencies came in another order (a simulated cluster's records, fast-forwarded or stepped)."""
    import random

    rng = random.Random(0)
    values = [rng.lognormvariate(-3.0, 1.0) for _ in range(1000)]
    shuffled = values[:]
    rng.shuffle(shuffled)
    assert latency_stats("ttft", shuffled) == latency_stats("ttft", values) == latency_stats("ttft", sorted(values))
    mean = math.fsum(values) / len(values)  # exactly rounded: the sorted sum is within a few ulps of it
    assert latency_stats("ttft", values)["mean_ttft_ms"] == pytest.approx(1000 * mean, rel=1e-13)


def test_ignored_requests_finish_when_ignored_and_stay_out_of_the_latencies():
    # From a real engine: a prompt that can never fit finishes, ignored, when it is added (as
    # vLLM), not before its arrival; the summary counts it failed and keeps it out of every latency.
    from framework import EngineConfig, LLMEngine, SamplingParams
    from framework.common.clock import VirtualClock

    clock = VirtualClock()
    clock.advance(2.0)
    engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=32), clock=clock)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("ok", [5, 6, 7], params)
    engine.add_request("long", list(range(3, 43)), params)
    engine.add_request("ahead", list(range(3, 43)), params, arrival_time=3.0)  # added before it arrives
    outs = {}
    while engine.has_unfinished_requests():
        clock.advance(0.25)
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["long"].metrics.finished_time == 2.0 and outs["long"].metrics.e2el == 0.0
    assert outs["ahead"].metrics.finished_time == 3.0 and outs["ahead"].metrics.e2el == 0.0
    assert outs["ok"].metrics.e2el == 0.75  # three steps of 0.25 s
    records = [RequestRecord.from_output(outs[rid], 2.0) for rid in ("ok", "long", "ahead")]
    assert [r.status for r in records] == ["length", "ignored", "ignored"]
    s = summarize(records, 1.0)
    assert s["completed"] == 1 and s["failed"] == 2
    assert s["failure_reasons"] == {"prompt of N tokens is longer than max_model_len=32": 2}
    for stat in ("mean", "median", "p90", "p99"):
        assert s[f"{stat}_e2el_ms"] == 750.0 and s[f"{stat}_queueing_delay_ms"] == 250.0
    assert s["total_input_tokens"] == 3 and s["request_throughput"] == 1.0


def test_step_time_noise_is_the_pooled_spread_of_steps_of_one_shape():
    from framework.harness.metrics import step_time_noise

    # Shape (1, 0, 1): 1.0, 1.2, 0.8, 1.0, 1.0 (mean 1.0); shape (2, 0, 2): 2.0 x4 and 2.5 x1 (mean 2.1);
    # shape (1, 64, 0) only twice, too few to count; a decode of another batch size once.
    steps = [(1, 0, 1, t) for t in (1.0, 1.2, 0.8, 1.0, 1.0)] + [(2, 0, 2, t) for t in (2.0, 2.0, 2.5, 2.0, 2.0)]
    steps += [(1, 64, 0, 5.0), (1, 64, 0, 50.0), (3, 0, 3, 9.0)]
    noise = step_time_noise(steps)
    squares = (0.2 ** 2 + 0.2 ** 2) + 4 * (2.0 / 2.1 - 1) ** 2 + (2.5 / 2.1 - 1) ** 2
    assert noise["step_time_noise_cv"] == pytest.approx(math.sqrt(squares / (4 + 4)))
    assert (noise["step_time_noise_steps"], noise["step_time_noise_shapes"]) == (10, 2)
    # Identical steps: no noise; no shape repeated often enough: unknown.
    assert step_time_noise([(1, 0, 1, 0.5)] * 6)["step_time_noise_cv"] == 0.0
    assert step_time_noise(steps[10:]) == {"step_time_noise_cv": None, "step_time_noise_steps": 0,
                                           "step_time_noise_shapes": 0}


def test_a_real_runs_noise_comes_from_its_steps_csv_and_a_simulated_run_has_none(tmp_path):
    from framework.harness.experiment import timing_noise

    path = tmp_path / "steps.csv"
    rows = ["num_scheduled_reqs,num_prefill_tokens,num_decode_tokens,duration"]
    rows += [f"4,0,4,{t}" for t in (0.01, 0.01, 0.01, 0.01, 0.03)]
    path.write_text("\n".join(rows) + "\n")
    measured = timing_noise(path, simulated=False)
    assert measured["step_time_noise_cv"] == pytest.approx(math.sqrt((4 * (1 / 1.4 - 1) ** 2 + (3 / 1.4 - 1) ** 2) / 4))
    assert timing_noise(path, simulated=True)["step_time_noise_cv"] is None
