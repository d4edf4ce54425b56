"""torch_paged's step planner: how it groups the non-decode requests (its numerics are checked
against the float64 reference in test_agreement.py)."""
import numpy as np
import pytest
import torch

from backends.torch_paged import prefill_groups
from framework import BACKENDS
from tests.backends.batches import random_batch
from tests.backends.test_agreement import check, run


def padded_and_real(groups, q, n):
    padded = sum(len(g) * q[g].max() * n[g].max() for g in groups)
    return padded, int((q * n).sum())


@pytest.mark.parametrize("seed", range(3))
def test_groups_partition_the_requests_and_trade_padding_for_calls(seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(2, 300, size=40)
    n = q + rng.integers(0, 300, size=40)
    one = prefill_groups(q, n, group_cost=10**12)
    assert len(one) == 1 and sorted(one[0]) == list(range(40))
    exact = prefill_groups(q, n, group_cost=0)
    assert sorted(np.concatenate(exact)) == list(range(40))
    assert padded_and_real(exact, q, n)[0] == padded_and_real(exact, q, n)[1], "free calls: no padding at all"
    middle = prefill_groups(q, n, group_cost=16384)
    padded, real = padded_and_real(middle, q, n)
    assert sorted(np.concatenate(middle)) == list(range(40))
    assert 1 < len(middle) < 40 and real <= padded < padded_and_real(one, q, n)[0]
    # The planner's choice is optimal for its cost model, so no worse than either extreme.
    cost = padded + 16384 * len(middle)
    assert cost <= padded_and_real(one, q, n)[0] + 16384 and cost <= real + 16384 * len(exact)


def test_decodes_run_as_one_group_whatever_their_number():
    specs = [(int(c), 1) for c in np.random.default_rng(0).integers(0, 200, size=50)] + [(0, 30), (64, 20)]
    batch = random_batch(specs, 4, 2, 16, 16, torch.float32, seed=0)
    backend = BACKENDS.create("torch_paged", num_heads=4, num_kv_heads=2, head_dim=16, scale=batch.scale,
                              block_size=16, dtype=torch.float32, device="cpu")
    groups = backend.build_metadata(batch.meta).groups
    assert [g.num_reqs for g in groups][0] == 50 and groups[0].q_len == 1
    assert sum(g.num_reqs for g in groups) == 52


def test_a_lone_full_prefill_runs_causal_without_a_mask():
    batch = random_batch([(0, 37)], 4, 2, 16, 16, torch.float32, seed=0)
    backend = BACKENDS.create("torch_paged", num_heads=4, num_kv_heads=2, head_dim=16, scale=batch.scale,
                              block_size=16, dtype=torch.float32, device="cpu")
    (group,) = backend.build_metadata(batch.meta).groups
    assert group.mask is None
    before = batch.kv_cache.clone()
    check(run("torch_paged", batch, 4, 2, 16, 16, torch.float32, "cpu"), batch, before, torch.float32)


def test_a_backend_used_under_inference_mode_still_runs_outside_it():
    """The engine runs under torch.inference_mode; the gather workspace it leaves behind must not
    make a later call outside that mode (a script, a benchmark under no_grad) fail."""
    backend = BACKENDS.create("torch_paged", num_heads=4, num_kv_heads=2, head_dim=16, scale=16 ** -0.5,
                              block_size=16, dtype=torch.float32, device="cpu")
    for seed, mode in enumerate([torch.inference_mode, torch.no_grad, torch.inference_mode]):
        batch = random_batch([(20, 1), (0, 5), (40, 7)], 4, 2, 16, 16, torch.float32, seed=seed)
        before = batch.kv_cache.clone()
        with mode():
            out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, backend.build_metadata(batch.meta))
        check(out, batch, before, torch.float32)
