import re

import numpy as np
import pytest

from framework.common.sampling_params import RequestOutputKind, SamplingParams


@pytest.mark.parametrize("given, kind", [
    (None, RequestOutputKind.CUMULATIVE),  # the default, as vLLM's
    ("cumulative", RequestOutputKind.CUMULATIVE), ("delta", RequestOutputKind.DELTA),
    ("final_only", RequestOutputKind.FINAL_ONLY), ("DELTA", RequestOutputKind.DELTA),
    (RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY),
])
def test_output_kind_takes_the_enum_or_its_name(given, kind):
    params = SamplingParams() if given is None else SamplingParams(output_kind=given)
    assert params.output_kind is kind


@pytest.mark.parametrize("bad", ["streaming", "", 1, None])
def test_a_bad_output_kind_is_a_one_line_error_listing_the_kinds(bad):
    with pytest.raises(ValueError) as exc:
        SamplingParams(output_kind=bad)
    assert str(exc.value) == f"SamplingParams.output_kind must be one of cumulative, delta, final_only, got {bad!r}"


def test_max_tokens_and_stop_token_ids_take_none_as_vllm():
    # vLLM's max_tokens=None generates up to the context (Request.max_tokens resolves it), and
    # its stop_token_ids=None is no stop tokens.
    params = SamplingParams(max_tokens=None, stop_token_ids=None)
    assert params.max_tokens is None and params.stop_token_ids == []
    assert SamplingParams(stop_token_ids=None) == SamplingParams(stop_token_ids=[])
    with pytest.raises(ValueError, match=r"max_tokens must be None \(up to max_model_len\) or an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("option, value, message", [
    # 1e-300 was taken: 0 in the sampler's float32, it divided the logits into NaNs and yielded token 0.
    ("repetition_penalty", 1e-300, r"a finite number > 0 \(about 1.4e-45 to 3.4e38 in float32, the sampler's type\)"),
    ("repetition_penalty", 1e39, r"a finite number > 0 \(about 1.4e-45 to 3.4e38 in float32"),  # inf: 0 * inf = NaN
    ("temperature", 1e39, r"a finite number >= 0 \(at most 3.4e38 in float32"),
    ("top_p", 1e-300, r"in \(0, 1\] \(at least about 1.4e-45 in float32"),
])
def test_a_float_option_the_sampler_casts_out_of_its_range_is_refused(option, value, message):
    with pytest.raises(ValueError, match=rf"^SamplingParams.{option} must be {message}.*, got {re.escape(repr(value))}$"):
        SamplingParams(**{option: value})


@pytest.mark.parametrize("option", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"])
def test_an_int_past_floats_range_is_a_value_error_naming_the_option(option):
    """``math.isfinite`` of such an int raises OverflowError: the check names the option instead."""
    with pytest.raises(ValueError, match=rf"^SamplingParams.{option} must be "):
        SamplingParams(**{option: 10**400})


@pytest.mark.parametrize("option, value", [
    ("repetition_penalty", 1e-40), ("repetition_penalty", 3e38), ("temperature", 1e-300), ("temperature", 3e38),
    ("top_p", 1e-40), ("min_p", 1e-300), ("presence_penalty", -1e-300), ("frequency_penalty", 1e-300),
])
def test_values_that_float32_keeps_valid_are_taken(option, value):
    # A tiny temperature rounds to 0 (greedy) and a tiny min-p or penalty to 0 (off): still in range.
    assert getattr(SamplingParams(**{option: value}), option) == value


@pytest.mark.parametrize("option, value", [
    ("top_k", -1), ("min_p", 0.0), ("min_p", 1.0), ("presence_penalty", -2.0), ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0), ("frequency_penalty", 2.0), ("seed", -2**63), ("seed", 2**63 - 1),
    ("logprobs", 0), ("prompt_logprobs", 0),
])
def test_the_ends_of_each_valid_range_are_taken(option, value):
    SamplingParams(**{option: value})


@pytest.mark.parametrize("option, value", [
    ("top_k", -2), ("seed", 2**63), ("stop_token_ids", ""), ("detokenize", "no"), ("detokenize", None),
    ("ignore_eos", 1),
])
def test_values_just_outside_the_valid_ones_are_one_line_errors_naming_the_option(option, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams.{option} must be [^\n]*, got {re.escape(repr(value))}$"):
        SamplingParams(**{option: value})


def test_top_k_minus_one_is_the_same_as_zero():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_numpy_logprob_counts_become_ints():
    params = SamplingParams(logprobs=np.int64(3), prompt_logprobs=np.int32(2))
    assert (params.logprobs, params.prompt_logprobs) == (3, 2)
    assert type(params.logprobs) is int and type(params.prompt_logprobs) is int


@pytest.mark.parametrize("penalty, value", [("presence_penalty", 0.5), ("frequency_penalty", -0.5),
                                            ("repetition_penalty", 1.2)])
def test_any_one_penalty_on_makes_the_request_penalized(penalty, value):
    assert SamplingParams(**{penalty: value}).penalized
    assert not SamplingParams().penalized


def test_an_unknown_sampling_option_is_answered_with_the_nearest_and_every_option():
    with pytest.raises(TypeError, match=r"^SamplingParams has no option 'max_token' \(did you mean max_tokens\?\); "
                                        r"options: n, max_tokens, .*prompt_logprobs$"):
        SamplingParams(max_token=3)
    with pytest.raises(ValueError, match="max_tokens"):  # a known option's bad value keeps its own error
        SamplingParams(max_tokens=0)
