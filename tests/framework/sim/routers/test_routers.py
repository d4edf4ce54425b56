"""Each router's choice on hand-made replica states."""
import pytest

from framework import SamplingParams
from framework.common.request import Request
from framework.sim.router import ROUTERS


class FakeReplica:
    def __init__(self, index, outstanding, routed=0, prefix=0):
        self.index, self.num_outstanding, self.num_routed, self._prefix = index, outstanding, routed, prefix

    def prefix_tokens(self, request):
        return self._prefix


REQ = Request("r", [1, 2, 3], SamplingParams(), 0.0)


def test_round_robin_cycles_whatever_the_load():
    router = ROUTERS.create("round_robin")
    replicas = [FakeReplica(0, 9), FakeReplica(1, 0), FakeReplica(2, 0)]
    assert [router.route(REQ, replicas) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_outstanding_breaks_ties_by_fewest_routed_then_index():
    router = ROUTERS.create("least_outstanding")
    assert router.route(REQ, [FakeReplica(0, 3), FakeReplica(1, 1, 5), FakeReplica(2, 1, 2)]) == 2
    assert router.route(REQ, [FakeReplica(0, 0, 1), FakeReplica(1, 0, 1)]) == 0


@pytest.mark.parametrize("replicas, max_imbalance, expected", [
    ([(0, 0, 0), (1, 5, 32), (2, 1, 16)], 16, 1),      # most cached tokens wins
    ([(0, 0, 0), (1, 5, 32), (2, 1, 16)], 4, 0),       # ... unless it is too far above the lightest
    ([(0, 2, 32), (1, 1, 32), (2, 0, 0)], 16, 1),      # equal hits: the less loaded
    ([(0, 2, 0), (1, 1, 0), (2, 3, 0)], 16, 1),        # no hits anywhere: least loaded
    ([(0, 9, 48), (1, 0, 0)], None, 0),                # no balancing
])
def test_prefix_aware(replicas, max_imbalance, expected):
    router = ROUTERS.create("prefix_aware", max_imbalance=max_imbalance)
    assert router.route(REQ, [FakeReplica(i, load, prefix=hit) for i, load, hit in replicas]) == expected


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_imbalance must be an integer >= 0"):
        ROUTERS.create("prefix_aware", max_imbalance=-1)
    # A string failed with TypeError: '<' not supported; NaN and True were taken (NaN: no balancing).
    for bad in ("abc", float("nan"), True, 2.5):
        with pytest.raises(ValueError, match=f"max_imbalance must be an integer >= 0 or None .*got {bad!r}"):
            ROUTERS.create("prefix_aware", max_imbalance=bad)
    with pytest.raises(TypeError):
        ROUTERS.create("round_robin", bogus=1)
