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
