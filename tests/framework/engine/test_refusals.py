"""What the Python API refuses or reports rather than serving wrongly: a ``time.time()`` arrival (read on the
engine's clock it gave TTFTs of -1.8e9 s), and a request it could never run (``LLM.generate`` warns)."""
import logging
import time

import pytest

from framework import LLM, EngineConfig, LLMEngine, SamplingParams
from framework.common.clock import VirtualClock

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def run(engine):
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


@pytest.mark.parametrize("executor", ["model", "sim"])
def test_a_time_time_arrival_is_refused_naming_the_engines_clock(executor):
    engine = LLMEngine(EngineConfig(model="tiny-llama", executor=executor, max_model_len=64, max_num_seqs=8))
    with pytest.raises(ValueError, match=r"^arrival_time=\d+\.\d+ is a time.time\(\) timestamp, not a time on the "
                                         r"engine's clock \(engine.clock.now\(\): [\d.e-]+ s since it started\): pass "
                                         r"None for now, or engine.clock.now\(\) - \(time.time\(\) - t\) for a "
                                         r"request that arrived at Unix time t$"):
        engine.add_request("r", [3, 4, 5], GREEDY, arrival_time=time.time())
    assert not engine.has_unfinished_requests()  # nothing queued
    # Times on the engine's clock are taken: now, earlier, a little ahead (a driver adding it just before).
    now = engine.clock.now()
    for rid, t in (("now", now), ("earlier", now - 5.0), ("ahead", now + 1.0)):
        engine.add_request(rid, [3, 4, 5], GREEDY, arrival_time=t)
    outs = run(engine)
    assert outs["earlier"].metrics.ttft >= 5.0 and outs["now"].metrics.ttft >= 0


def test_a_simulated_engine_far_into_its_run_still_takes_its_own_times():
    clock = VirtualClock()
    clock.advance(3600 * 24 * 365)  # a year of simulated time: still nowhere near a Unix timestamp
    engine = LLMEngine(EngineConfig(model="tiny-llama", executor="sim", max_model_len=64, max_num_seqs=8), clock=clock)
    engine.add_request("r", [3, 4, 5], GREEDY, arrival_time=clock.now() + 10.0)
    with pytest.raises(ValueError, match="is a time.time\\(\\) timestamp"):
        engine.add_request("s", [3, 4, 5], GREEDY, arrival_time=time.time())
    run(engine)


def test_generate_warns_once_for_each_request_it_could_not_run(caplog):
    llm = LLM(model="tiny-llama", max_model_len=32, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = [list(range(3, 43)), [5, 6, 7], list(range(3, 40)), [8, 9]]
    with caplog.at_level(logging.WARNING, logger="framework.engine.llm"):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [GREEDY, GREEDY, SamplingParams(n=2, max_tokens=4, ignore_eos=True), GREEDY])
    warned = [r.getMessage() for r in caplog.records if r.name == "framework.engine.llm"]
    assert warned == [f"request {outs[0].request_id} was not run: prompt of 40 tokens is longer than max_model_len=32",
                      f"request {outs[2].request_id} was not run: prompt of 37 tokens is longer than max_model_len=32"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [0, 4, 0, 4]
    caplog.clear()
    llm.generate([[5, 6, 7]], GREEDY)
    assert not [r for r in caplog.records if r.name == "framework.engine.llm"]
