import torch

from framework.input_preparer import SamplingMetadata
from framework.sampler import Sampler, apply_top_k, apply_top_p


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0]), all_greedy=False)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert out[0].item() == 1


def test_top_k_and_top_p_masks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    assert torch.isinf(apply_top_k(logits, torch.tensor([2]))).tolist() == [[True, False, False, True]]
    assert not torch.isinf(apply_top_k(logits, torch.tensor([0]))).any()
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = ~torch.isinf(apply_top_p(probs, torch.tensor([0.7])))
    assert kept.tolist() == [[True, True, False, False]]
    kept = ~torch.isinf(apply_top_p(probs, torch.tensor([0.1])))
    assert kept.tolist() == [[True, False, False, False]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(20000, 1)
    meta = SamplingMetadata(temperature=torch.ones(20000), all_greedy=False)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    freq = torch.bincount(out, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    # Top-k 1 is greedy whatever the noise.
    meta = SamplingMetadata(temperature=torch.ones(20000), top_k=torch.ones(20000, dtype=torch.long), all_greedy=False)
    assert (Sampler(torch.Generator().manual_seed(0))(logits, meta) == 0).all()


def test_top_p_of_one_keeps_every_token():
    """A row with top-p off keeps its whole vocabulary when another row of its batch uses top-p:
    the float32 running sum of a 32k-token softmax reaches 1 before its least likely tokens."""
    torch.manual_seed(0)
    logits = torch.randn(8, 32000) * 3
    kept = torch.isfinite(apply_top_p(logits, torch.tensor([1.0] * 7 + [0.5])))
    assert kept[:7].all()
    assert kept[7].sum() < 32000


def test_tiny_temperature_samples_the_most_likely_token():
    """A positive temperature far below 1 is as good as greedy, not an overflow to NaN: logits
    divided by 1e-40 (a float32 subnormal) used to give inf - inf in the softmax and token 0."""
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    for t in (1e-6, 1e-38, 1e-40):
        meta = SamplingMetadata(temperature=torch.full((4,), t), all_greedy=False)
        out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
        assert out.tolist() == logits.argmax(dim=-1).tolist(), t
