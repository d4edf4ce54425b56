"""Everything above the executor is the same code in both modes: serving one workload with the
real forward pass, on simulated time advanced by each step's measured duration, and with the
simulated executor replaying those durations gives the same scheduler outputs, step for step
(which requests, how many tokens, preemptions, swaps, prefix hits) and the same token times."""
import time

import pytest

from framework import EngineConfig, LLMEngine
from framework.common.clock import VirtualClock
from framework.harness.cluster import Cluster
from framework.execution.executor import EXECUTORS
from framework.execution.executors.model import ModelExecutor
from tests.framework.sim.support import chat_requests


@EXECUTORS.register("test_measured_model")
class MeasuredModelExecutor(ModelExecutor):
    """The real forward pass; simulated time advances by each step's measured duration."""

    @classmethod
    def make_clock(cls):
        return VirtualClock()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.durations = []

    def execute(self, out):
        start = time.perf_counter()
        result = super().execute(out)
        self.durations.append(time.perf_counter() - start)
        self.clock.advance(self.durations[-1])
        return result


def record(steps):
    def callback(stats, out):
        steps.append({
            "scheduled": [(r.request_id, out.num_scheduled_tokens[r.request_id]) for r in out.scheduled],
            "new": [(r.request_id, r.num_cached_tokens) for r in out.new_requests],
            "resumed": [r.request_id for r in out.resumed_requests],
            "preempted": [r.request_id for r in out.preempted],
            "swapped_out": [r.request_id for r in out.swapped_out],
            "swapped_in": [r.request_id for r in out.swapped_in],
            "block_ops": (len(out.blocks_to_swap_out), len(out.blocks_to_swap_in), len(out.blocks_to_copy)),
            "finished_rows": sorted(out.finished_req_ids),
            "ignored": [r.request_id for r in out.ignored],
            "times": (stats.start_time, stats.duration), "kv_blocks_used": stats.kv_blocks_used,
        })
    return callback


def serve(executor, executor_options, sampling=None, **engine):
    config = EngineConfig(model="tiny-llama", executor=executor, executor_options=executor_options, max_model_len=256,
                          max_num_seqs=16, max_num_batched_tokens=512, num_gpu_blocks_override=40, swap_space=0.01,
                          **engine)
    cluster = Cluster([LLMEngine(config)])
    steps = []
    cluster.engines[0].step_callbacks.append(record(steps))  # a plain callback: no decode runs
    requests = chat_requests(30, rate=60.0, seed=5, vocab_size=1024,
                             prompt_len={"dist": "lognormal", "mean": 60, "std": 40, "min": 4, "max": 160},
                             output_len={"dist": "lognormal", "mean": 24, "std": 12, "min": 2, "max": 48},
                             shared_prefix={"fraction": 0.8, "num_prefixes": 2, "prefix_len": 32})
    outs = sorted((o.request_id, o.metrics.token_times, o.metrics.num_cached_tokens, o.metrics.num_preemptions,
                   o.metrics.num_swaps, tuple(len(c.token_ids) for c in o.outputs)) for _, o in cluster.run(requests, sampling).outputs)
    return steps, outs, cluster.engines[0]


@pytest.mark.parametrize("engine", [{}, {"policy": "fcfs", "policy_options": {"preemption_mode": "swap"}}],
                         ids=["recompute", "swap"])
def test_sim_replaying_measured_step_times_makes_the_same_decisions(engine):
    real_steps, real_outs, sim_steps, sim_outs = serve_both(**engine)
    # The workload exercised what the check is about.
    assert any(s["new"] and s["new"][0][1] for s in real_steps), "no prefix hits"
    assert sum(len(s["preempted"]) + len(s["swapped_out"]) for s in real_steps) > 0, "no preemptions"
    if engine:
        assert any(s["swapped_in"] for s in real_steps), "no swaps"
    assert len({s["times"][0] for s in real_steps}) == len(real_steps)  # arrivals spread over the run


def serve_both(sampling=None, **engine):
    """Serve the workload on the real executor, then on the simulator replaying its step times;
    both must make the same decisions."""
    real_steps, real_outs, real = serve("test_measured_model", {}, sampling, **engine)
    durations = real.executor.durations
    sim_steps, sim_outs, sim = serve("sim", {"hardware": "cpu", "fast_forward": False,
                                            "cost_model": {"name": "replay", "durations": durations}},
                                     sampling, **engine)
    assert sim.executor.cost_model.num_replayed == len(durations)
    assert sim_steps == real_steps
    assert sim_outs == real_outs
    return real_steps, real_outs, sim_steps, sim_outs


def test_sim_forks_parallel_samples_as_the_model_executor_does_under_v0():
    """Under preparer v0 an n > 1 request prefills once and its samples are forked from it,
    sharing its blocks until copy-on-write. The simulator used to run the samples as n
    independent requests whatever the preparer (so did any executor not named ``model``, such
    as this file's measured one): more prefill work, no shared blocks, another schedule."""
    real_steps, real_outs, _, _ = serve_both({"n": 2}, preparer="v0")
    assert all(len(o[5]) == 2 for o in real_outs)
    # Only a forked pair shares a partial block: its first decode copies it.
    assert any(s["block_ops"][2] for s in real_steps), "no copy-on-write: the samples were not forked"
    # A leader prefills alone: its sample never appears among the first step's new requests.
    first = {rid for rid, _ in real_steps[0]["new"]}
    assert first and not any(rid.endswith("#1") for rid in first)
