"""How a stopped or failed run's summary.json is marked, keeping what it measured."""
import json

from framework.harness.supervision import mark


def test_a_failure_after_an_interrupt_still_says_the_run_was_interrupted(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"status": "interrupted", "interrupted": True, "completed": 3}))
    mark(tmp_path, "failed", RuntimeError("the logger broke"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["interrupted"], summary["completed"]) == ("failed", True, 3)
    assert "the logger broke" in summary["error"]


def test_a_run_interrupted_before_any_metric_was_written_measured_nothing(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"status": "running", "interrupted": False, "num_requests": 6}))
    assert mark(tmp_path, "interrupted") is False
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["interrupted"], summary["num_requests"]) == ("interrupted", True, 6)
