"""Speed of the simulator (``make bench``; in the default test run each body runs once, untimed).

Read the ratio between the cases: a decode-run fast-forward against stepping one by one, on the
same Poisson chat workload, served alone and with the run's recorder writing its files (the
scale figures, through the whole run path, are in experiments/bench_sim_scale.py).
"""
import pytest

from framework import EngineConfig
from framework.harness.cluster import Cluster
from framework.harness.metrics import RequestRecord
from framework.harness.recorder import RunRecorder
from tests.framework.sim.support import chat_requests


@pytest.mark.parametrize("recorded", [False, True], ids=["served", "served_and_recorded"])
@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast_forward", "step_by_step"])
def test_simulate_chat_workload(benchmark, tmp_path, fast_forward, recorded):
    config = EngineConfig(model="llama-3-8b", executor="sim", max_num_seqs=256, max_num_batched_tokens=8192,
                          executor_options={"hardware": "a100-80gb", "fast_forward": fast_forward})
    requests = chat_requests(300, rate=4.0)

    def serve():
        cluster = Cluster.build(config)
        if not recorded:
            return cluster.run(requests, on_output=lambda i, o: None)
        recorder = RunRecorder(tmp_path)
        cluster.engines[0].step_callbacks.append(recorder.step_log())
        result = cluster.run(requests, on_output=lambda i, o: recorder.add_request(RequestRecord.from_output(o), i))
        recorder.close()
        return result

    benchmark.pedantic(serve, rounds=3 if benchmark.enabled else 1, iterations=1)
