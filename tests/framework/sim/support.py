"""Helpers of the simulator tests: requests of the ``chat`` workload (``conf/workload/chat.yaml``:
Poisson arrivals, lognormal prompts and outputs of a few hundred tokens, shared system prompts)
and a step callback that counts fast-forwarded steps."""
from pathlib import Path

import yaml

from framework.harness.workload import WorkloadContext, WorkloadRequest, create_workload

CHAT = yaml.safe_load((Path(__file__).resolve().parents[3] / "conf" / "workload" / "chat.yaml").read_text())


def chat_requests(num_requests: int, rate: float, seed: int = 0, vocab_size: int = 128256,
                  **options) -> list[WorkloadRequest]:
    """``options`` override the conf's keys (``prompt_len``, ``output_len``, ``shared_prefix``, ...)."""
    workload, _ = create_workload({**CHAT, "num_requests": num_requests, "rate": rate, "seed": seed, **options})
    return workload.generate(WorkloadContext(vocab_size))


class RunCounter:
    """A step callback that counts the steps an engine took in decode runs (taking runs, it
    leaves the fast path on)."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self, stats, out) -> None:
        pass

    def on_decode_run(self, run) -> None:
        self.steps += len(run.end_times)
