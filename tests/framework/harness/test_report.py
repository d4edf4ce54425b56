"""The summary table a run prints, laid out like ``vllm bench serve``'s."""
from framework.harness.report import format_summary


def lines_of(summary):
    return [" ".join(line.split()) for line in format_summary(summary).splitlines()]


def test_counts_of_zero_are_shown_not_left_out():
    lines = lines_of({"status": "completed", "completed": 6, "failed": 0, "num_preemptions": 0, "num_swaps": 0,
                      "duration_s": 1.5})
    assert "Failed requests: 0" in lines and "Preemptions: 0" in lines and "Swaps: 0" in lines
    assert "Successful requests: 6" in lines


def test_requests_never_run_are_counted_under_the_failed_ones():
    lines = lines_of({"status": "completed", "completed": 4, "failed": 2, "num_ignored": 2})
    assert lines.index("of which never run (ignored): 2") == lines.index("Failed requests: 2") + 1


def test_a_latency_without_statistics_leaves_out_its_block_only():
    # No inter-token latencies (a run compared from its CSVs keeps none): the blocks after ITL still show.
    summary = {"status": "completed", "completed": 2, "mean_ttft_ms": 10.0, "mean_e2el_ms": 50.0, "median_e2el_ms": 40.0,
               "mean_queueing_delay_ms": 1.0}
    text = format_summary(summary)
    assert "Inter-token Latency" not in text
    assert "End-to-end Latency" in text and "Queueing Delay" in text
    assert "Mean E2EL (ms): 50.00" in lines_of(summary)
