"""The shipped policies' per-step promises (``POLICY_CHECKS``) hold what each policy promises, no more."""
from types import SimpleNamespace

import pytest

from framework.common.request import Request
from framework.common.sampling_params import SamplingParams
from framework.testing.properties import sjf_checks


def request(rid, prompt_len, arrival):
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(), arrival_time=arrival)


def test_sjf_promises_the_order_of_admissions_not_of_swapped_requests_coming_back():
    # chunked, and so sjf, brings a swapped request back before admitting anyone, however long it is.
    longer, shorter = request("long", 20, 0.0), request("short", 3, 1.0)
    scheduler = SimpleNamespace(waiting=[shorter])
    swapped_back = SimpleNamespace(new_requests=[], resumed_requests=[longer], swapped_in=[longer])
    sjf_checks({}, swapped_back, scheduler)
    admitted = SimpleNamespace(new_requests=[longer], resumed_requests=[], swapped_in=[])
    with pytest.raises(AssertionError):
        sjf_checks({}, admitted, scheduler)
