"""vLLM v0's parallel sampling: a request of n samples prefills one leader, and forks the others."""
from __future__ import annotations

from collections.abc import Iterable

from framework.common.request import Request
from framework.execution.executor import ExecutorOutput
from framework.scheduling.scheduler import Scheduler


class SampleForks:
    """The leaders whose samples (``leader.forks``) wait to be forked from them: each forks its
    samples once it samples its first token (``fork``), or takes them with it when it finishes
    before that (``settle``). Used when the preparer forks parallel samples."""

    def __init__(self, scheduler: Scheduler, preparer: str) -> None:
        self.scheduler = scheduler
        self.preparer = preparer
        self.leaders: dict[str, Request] = {}

    def add(self, leader: Request, samples: list[Request]) -> None:
        """``leader`` is queued for its request; ``samples`` wait to be forked from it."""
        leader.forks = samples
        self.leaders[leader.request_id] = leader

    def fork(self, result: ExecutorOutput, now: float) -> list[Request]:
        """Fork the samples of every leader that sampled its first token in ``result``, each with
        its own first token timed ``now``; returns them, in fork order."""
        sampled = result.sampled
        forked = []
        for rid in [rid for rid in self.leaders if rid in sampled]:
            leader = self.leaders.pop(rid)
            for child in leader.forks:
                token = sampled.get(child.request_id)
                if token is None:
                    raise RuntimeError(f"preparer {self.preparer!r} sampled no first token for "
                                       f"{child.request_id}, a parallel sample of {rid}")
                self.scheduler.fork(leader, child, token, now)
                forked.append(child)
            leader.forks = []
        return forked

    def settle(self, finished: Iterable[Request]) -> None:
        """A leader among ``finished`` (requests that finished before sampling: ignored, aborted)
        takes its forks with it; left waiting for a fork that never comes, they would keep the
        request unfinished forever."""
        for leader in finished:
            for child in leader.forks:
                child.status = leader.status
                child.status_message = leader.status_message
                child.finished_time = leader.finished_time
            if leader.forks:
                leader.forks = []
                self.leaders.pop(leader.request_id, None)
