import numpy as np
import pytest

from framework.common.request import Request
from framework.common.sampling_params import SamplingParams


def make(prompt_len=4, max_model_len=None, **params):
    return Request("r", list(range(3, 3 + prompt_len)), SamplingParams(**params), arrival_time=0.0,
                   max_model_len=max_model_len)


def test_max_tokens_none_on_a_prompt_past_max_model_len_leaves_no_tokens_not_a_negative_count():
    assert make(prompt_len=10, max_model_len=8, max_tokens=None).max_tokens == 0
    assert make(prompt_len=5, max_model_len=8, max_tokens=None).max_tokens == 3


def test_the_first_token_time_is_the_first_tokens():
    req = make()
    req.append_output_token(7, now=1.0)
    req.append_output_token(8, now=2.5)
    assert req.first_token_time == 1.0 and req.token_times == [1.0, 2.5]


def test_a_request_with_one_token_left_to_compute_is_a_decode():
    req = make(prompt_len=4)
    assert req.is_prefill
    req.num_computed_tokens = 3
    assert not req.is_prefill


def test_a_second_placeholder_before_the_first_is_resolved_is_refused():
    req = make()
    req.append_placeholder()
    with pytest.raises(RuntimeError, match="already has a token in flight"):
        req.append_placeholder()
    req.resolve_placeholder(9, now=1.0)
    assert req.output_token_ids == [9]


def test_prompt_logprobs_are_needed_until_every_prompt_position_has_them():
    req = make(prompt_len=3, prompt_logprobs=1)
    assert req.needs_prompt_logprobs
    req.prompt_logprobs += [{}, {}]
    assert not req.needs_prompt_logprobs


@pytest.mark.parametrize("ignore_eos, status", [(False, "FINISHED_STOPPED"), (True, None)])
def test_ignore_eos_generates_past_the_eos_token(ignore_eos, status):
    req = Request("r", [3, 4], SamplingParams(max_tokens=8, ignore_eos=ignore_eos), arrival_time=0.0,
                  eos_token_ids=frozenset({2}))
    req.append_output_token(2, now=1.0)
    stopped = req.check_stop()
    assert (stopped.name if stopped else None) == status


def test_numpy_prompt_ids_become_python_ints():
    req = Request("r", np.array([3, 4, 5]), SamplingParams(), arrival_time=0.0)
    assert req.prompt_token_ids == [3, 4, 5] and all(type(t) is int for t in req.token_ids)
