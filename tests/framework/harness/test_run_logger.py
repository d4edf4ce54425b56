"""A logger that fails is switched off for the rest of the run, and never fails the run."""
from pathlib import Path

from framework.harness.run_logger import Guarded, RunLogger


class Unreachable(RunLogger):
    name = "unreachable"

    def __init__(self, fail_with: Exception) -> None:
        self.fail_with = fail_with
        self.calls: list[str] = []

    def start(self, config, run_dir, run_name, group=None):
        self.calls.append("start")
        raise self.fail_with

    def log_summary(self, summary):
        self.calls.append("log_summary")

    def finish(self, interrupted):
        self.calls.append("finish")


def test_a_logger_that_fails_gets_no_further_calls():
    inner = Unreachable(ConnectionError("api.wandb.ai unreachable"))
    guarded = Guarded(inner)
    assert guarded.implements("log_summary") and not guarded.implements("log_step")
    guarded.start({}, Path("run"), "run")
    guarded.log_summary({"status": "completed"})
    guarded.finish(False)
    assert inner.calls == ["start"]
    assert guarded.failed == "ConnectionError: api.wandb.ai unreachable"
    assert not guarded.implements("log_summary")


def test_any_error_of_a_logger_is_caught():
    for error in (ValueError("bad key"), TypeError("not a str"), OSError("disk full"), KeyError("run")):
        guarded = Guarded(Unreachable(error))
        guarded.start({}, Path("run"), "run")
        assert guarded.failed is not None and guarded.failed.startswith(type(error).__name__)
