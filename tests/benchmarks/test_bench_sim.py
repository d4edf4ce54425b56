"""Speed of the simulator (``make bench``; in the default test run each body runs once, untimed).

Read the ratio between the cases: a decode-run fast-forward against stepping one by one, on the
same Poisson chat workload (the scale figures are in experiments/bench_sim_scale.py).
"""
import pytest

from framework import EngineConfig
from framework.chat_workload import ChatWorkload
from framework.cluster import Cluster


@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast_forward", "step_by_step"])
def test_simulate_chat_workload(benchmark, fast_forward):
    config = EngineConfig(model="llama-3-8b", executor="sim", max_num_seqs=256, max_num_batched_tokens=8192,
                          executor_options={"hardware": "a100-80gb", "fast_forward": fast_forward})
    arrivals = list(ChatWorkload(num_requests=300, rate=4.0, seed=0, vocab_size=128256))

    def serve():
        return Cluster.build(config).run(arrivals, on_output=lambda i, o: None)

    benchmark.pedantic(serve, rounds=3 if benchmark.enabled else 1, iterations=1)
