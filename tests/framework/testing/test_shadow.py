"""The shadow engine and its driver: a request that reads a wrong KV cache or a scheduler that breaks an invariant
fails its step, each request arrives and is aborted at its step, and a workload that runs too long fails."""
import pytest

from framework.common.sampling_params import SamplingParams
from framework.scheduling.policy import POLICIES
from framework.testing.registries import forget_registrations
from framework.testing.shadow import Arrival, drive, reference_output, shadow_engine
from policies.chunked import ChunkedPolicy

PROMPT = list(range(3, 12))


def engine_after_one_step():
    engine = shadow_engine("chunked", num_blocks=20)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    return engine, engine.scheduler.requests["a"].block_ids[1]


@pytest.mark.parametrize("slot, match", [(0, "reads a wrong KV cache"), (1, "reads wrong positions")])
def test_a_request_that_reads_a_wrong_kv_cache_fails_its_step(slot, match):
    engine, block = engine_after_one_step()
    engine.executor.runner.kv_cache[slot, 0, block, 2] = 30  # one token's id, or its position
    with pytest.raises(AssertionError, match=match):
        engine.step()
    engine.abort_request("a")


def test_a_scheduler_over_its_token_budget_fails_its_step(monkeypatch):
    forget_registrations(monkeypatch, POLICIES)

    @POLICIES.register("greedy")
    class Greedy(ChunkedPolicy):
        def schedule(self, scheduler, step):
            step.token_budget += 8
            super().schedule(scheduler, step)

    engine = shadow_engine("greedy", num_blocks=20, max_num_batched_tokens=8)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(AssertionError, match="max_num_batched_tokens"):
        engine.step()
    engine.abort_request("a")


def test_each_request_arrives_at_its_step_whatever_the_order_given():
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    run = drive(shadow_engine("chunked", num_blocks=20), [Arrival("late", 5, PROMPT, params),
                                                          Arrival("early", 0, PROMPT, params)], max_steps=50)
    assert [round(run.outputs[rid].metrics.arrival_time) for rid in ("early", "late")] == [0, 5]


@pytest.mark.parametrize("after", [0, 2])
def test_a_request_is_aborted_the_given_number_of_steps_after_it_arrives(after):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    run = drive(shadow_engine("chunked", num_blocks=20), [Arrival("a", 3, PROMPT, params, abort_after=after)],
                max_steps=50)
    out = run.outputs["a"].outputs[0]
    assert run.aborted == {"a"} and out.finish_reason == "abort"
    assert out.token_ids == reference_output(PROMPT, params, 64)[:after]  # one token a step


def test_a_workload_that_takes_more_steps_than_allowed_fails():
    arrivals = [Arrival("a", 0, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))]
    steps = len(drive(shadow_engine("chunked", num_blocks=20), arrivals, max_steps=50).steps)
    drive(shadow_engine("chunked", num_blocks=20), arrivals, max_steps=steps)
    with pytest.raises(AssertionError, match=f"not done after {steps - 1} steps"):
        drive(shadow_engine("chunked", num_blocks=20), arrivals, max_steps=steps - 1)
