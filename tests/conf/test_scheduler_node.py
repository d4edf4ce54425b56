"""``scheduler.check_invariants`` in Hydra turns on the per-step invariant checks."""
import pytest

from framework import SamplingParams
from framework.engine.llm_engine import LLMEngine
from framework.run import engine_config
from tests.conf.test_compose import compose_with


def test_check_invariants_is_off_by_default_and_on_with_the_scheduler_key():
    assert engine_config(compose_with([])).check_invariants is False
    config = engine_config(compose_with(["+policy=priority_swap", "scheduler.check_invariants=true"]))
    config.max_model_len, config.num_gpu_blocks_override = 128, 16
    engine = LLMEngine(config)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.scheduler.max_num_seqs = 0  # break a budget: the next step's check must notice
    with pytest.raises(AssertionError, match="1 seats taken > max_num_seqs"):
        engine.step()
    engine.abort_request("r")
