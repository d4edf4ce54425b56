"""v0's ``check`` option: each scheduled sequence, once brought up to date, equals its request."""
import pytest

from framework.execution.preparers.v0 import SequenceGroupPreparer
from tests.framework.execution.preparers.support import make_req, schedule


def preparer(check):
    return SequenceGroupPreparer(max_num_reqs=4, max_model_len=16, block_size=4, max_num_batched_tokens=32,
                                 check=check)


@pytest.mark.parametrize("check", [True, False])
def test_check_catches_a_sequence_that_kept_a_token_its_request_changed(check):
    """v0 appends a request's new tokens to its sequence, so a changed earlier token stays in the sequence:
    the check says so, and without it the step feeds the stale token."""
    prep = preparer(check)
    a = make_req("a", 5, [1, 2])
    prep.prepare(schedule([a], [5], new=[a]))
    a.num_computed_tokens = 5
    a.token_ids.append(900)
    a.token_ids[4] = 555  # the request's last prompt token, changed after its sequence took it
    if check:
        with pytest.raises(AssertionError, match=r"^v0 sequence of a diverged from its request: 5 of 6 tokens "
                                                 r"computed, request 5 of 6, other token ids$"):
            prep.prepare(schedule([a], [1]))
    else:
        assert prep.prepare(schedule([a], [1])).host["input_ids"].tolist() == [900]
        assert prep.seqs["a"].data.get_token_ids()[4] == 104
