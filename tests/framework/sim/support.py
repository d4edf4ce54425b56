"""Helpers of the simulator tests: requests of the ``chat`` workload (``conf/workload/chat.yaml``:
Poisson arrivals, lognormal prompts and outputs of a few hundred tokens, shared system prompts)
and a step callback that counts fast-forwarded steps."""
from pathlib import Path

import yaml

from framework import EngineConfig
from framework.harness.cluster import Cluster
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


def serve_cluster(requests: list[WorkloadRequest], fast_forward: bool, callbacks=(), **config) -> tuple[list, float]:
    """A simulated ``llama-3-8b`` on an H100 serving ``requests`` through ``Cluster.run`` (as a run does): each
    request's (id, tokens, TTFT, TPOT, finish reason), sorted, and the clock at the end."""
    cluster = Cluster.build(EngineConfig(model="llama-3-8b", executor="sim", **config,
                                         executor_options={"hardware": "h100-sxm", "fast_forward": fast_forward}))
    for engine in cluster.engines:
        engine.step_callbacks.extend(callbacks)
    outputs = cluster.run(requests, {"ignore_eos": True, "temperature": 0.0}).outputs
    return sorted((o.request_id, len(o.outputs[0].token_ids), o.metrics.ttft, o.metrics.tpot,
                   o.outputs[0].finish_reason) for _, o in outputs), max(e.clock.now() for e in cluster.engines)
