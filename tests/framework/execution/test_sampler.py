import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from framework.execution.input_preparer import Penalties, SamplingMetadata
from framework.execution.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k, apply_top_p


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


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_at_a_temperature_follows_the_scaled_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(40000, 1)
    meta = SamplingMetadata(temperature=torch.full((40000,), temperature), all_greedy=False)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    freq = torch.bincount(out, minlength=4).double() / 40000
    assert torch.allclose(freq, (logits[0].double() / temperature).softmax(-1), atol=0.01)


def test_filters_on_tied_probabilities_keep_what_transformers_keeps():
    tied = torch.zeros(1, 4)  # four tokens of 0.25: p=0.5 is reached by two of them
    assert torch.isfinite(apply_top_p(tied, torch.tensor([0.5]))).sum() == 2
    assert torch.isfinite(TopPLogitsWarper(0.5)(None, tied.clone())).sum() == 2
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    assert torch.isfinite(apply_top_k(logits, torch.tensor([4]))).all()  # top-k of the whole vocabulary
    assert torch.isfinite(TopKLogitsWarper(4)(None, logits.clone())).all()


def test_a_tied_tokens_rank_counts_every_token_as_likely():
    # As vLLM: the rank is how many tokens have a logprob at least the token's.
    logits = torch.tensor([[2.0, 2.0, 0.0]]).log_softmax(dim=-1)
    out = Sampler().sample(logits, logprob_meta([0.0], [1]))
    assert out.logprobs.ranks.tolist() == [2]


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


def penalties(rows, token_lists, prompt_lens, presence, frequency, repetition):
    """A ``Penalties`` for ``rows`` from plain lists (tokens padded with -1, as the preparers do)."""
    width = max(map(len, token_lists))
    ids = torch.tensor([t + [-1] * (width - len(t)) for t in token_lists], dtype=torch.long)
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    return Penalties(torch.tensor(rows), ids, torch.tensor(prompt_lens), f32(presence), f32(frequency),
                     f32(repetition))


def test_repetition_penalty_matches_transformers():
    """Each penalised row equals transformers' RepetitionPenaltyLogitsProcessor over its prompt
    and output tokens (repeats, negative and positive logits); the other rows are untouched."""
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(5, vocab, generator=gen) * 3
    tokens = {1: [3, 7, 7, 20, 49, 0], 3: [4], 4: torch.randint(0, vocab, (40,), generator=gen).tolist()}
    prompt_lens = {1: 2, 3: 1, 4: 25}
    penalty = {1: 1.3, 3: 0.7, 4: 2.0}
    rows = sorted(tokens)
    meta = penalties(rows, [tokens[r] for r in rows], [prompt_lens[r] for r in rows], [0.0] * 3, [0.0] * 3,
                     [penalty[r] for r in rows])
    got = apply_penalties(logits, meta)
    for r in range(5):
        want = logits[r:r + 1]
        if r in tokens:
            want = RepetitionPenaltyLogitsProcessor(penalty[r])(torch.tensor([tokens[r]]), want.clone())
        assert torch.equal(got[r:r + 1], want), r


def test_presence_and_frequency_penalties_match_a_float64_computation():
    """OpenAI's definition, over the output tokens only: logit -= frequency * count + presence *
    (count > 0); with a repetition penalty, that applies first, over prompt and output."""
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    logits = torch.randn(4, vocab, generator=gen) * 2
    rows = [0, 2, 3]
    tokens = [[5, 6, 7, 7, 9, 9, 9, 5], [1, 2, 3], [30, 31, 31, 30, 39]]
    prompt_lens = [3, 3, 1]  # row 2 has no output yet
    presence, frequency, repetition = [0.5, -1.0, 2.0], [0.25, 2.0, -0.75], [1.0, 1.0, 1.2]
    got = apply_penalties(logits, penalties(rows, tokens, prompt_lens, presence, frequency, repetition))
    want = logits.double().clone()
    for k, row in enumerate(rows):
        for t in set(tokens[k]):
            x = want[row, t].item()
            want[row, t] = x / repetition[k] if x > 0 else x * repetition[k]
        output = tokens[k][prompt_lens[k]:]
        for t in set(output):
            want[row, t] -= frequency[k] * output.count(t) + presence[k]
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


def test_min_p_matches_transformers():
    """After temperature, min-p drops the tokens transformers' MinPLogitsWarper drops."""
    from transformers import MinPLogitsWarper

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 200, generator=gen) * 4
    min_ps = [0.0, 0.05, 0.1, 0.3, 0.9, 1.0]
    temperature = torch.tensor([1.0, 0.5, 1.5, 1.0, 2.0, 0.7])
    scaled = logits / temperature.unsqueeze(1)
    got = apply_min_p(scaled, torch.tensor(min_ps))
    for r, p in enumerate(min_ps):
        want = scaled[r:r + 1] if p == 0 else MinPLogitsWarper(p)(None, scaled[r:r + 1].clone())
        assert torch.equal(got[r:r + 1], want), p
    kept = torch.isfinite(got).sum(dim=-1)
    assert kept[0] == 200 and kept[-1] == 1 and (kept[1:] < 200).all()


def test_sampler_applies_penalties_to_greedy_rows_and_min_p_before_sampling():
    # The argmax (token 1) is in the prompt: a repetition penalty of 3 makes token 2 win, also
    # on the all-greedy path.
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0], [0.0, 3.0, 2.0, -1.0]])
    pen = penalties([0], [[1]], [1], [0.0], [0.0], [3.0])
    meta = SamplingMetadata(temperature=torch.zeros(2), penalties=pen)
    assert Sampler()(logits, meta).tolist() == [2, 1]
    # A presence penalty on an output token: the same, through the mixed greedy / random path.
    pen = penalties([1], [[7, 1]], [1], [2.0], [0.0], [1.0])
    meta = SamplingMetadata(temperature=torch.tensor([1.0, 0.0]), all_greedy=False, penalties=pen)
    assert Sampler(torch.Generator().manual_seed(0))(logits, meta)[1].item() == 2
    # min-p 0.5 keeps only token 1 (token 2 is e^-1 = 0.37 times as likely): always sampled.
    probs = logits[:1].repeat(2000, 1)
    meta = SamplingMetadata(temperature=torch.ones(2000), all_greedy=False, min_p=torch.full((2000,), 0.5))
    assert (Sampler(torch.Generator().manual_seed(0))(probs, meta) == 1).all()
    meta = SamplingMetadata(temperature=torch.ones(2000), all_greedy=False, min_p=torch.full((2000,), 0.3))
    assert set(Sampler(torch.Generator().manual_seed(0))(probs, meta).tolist()) == {1, 2}
def logprob_meta(temperature, num_logprobs, **kwargs):
    """Sampling metadata for rows with ``temperature`` and ``SamplingParams.logprobs`` (None: off)."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    return SamplingMetadata(temperature=torch.tensor(temperature), all_greedy=not any(temperature),
                            logprob_rows=torch.tensor(rows) if rows else None,
                            logprob_rows_cpu=np.array(rows) if rows else None,
                            num_logprobs=[num_logprobs[i] for i in rows] if rows else None, **kwargs)


def test_logprobs_are_the_raw_distribution_of_the_rows_that_ask():
    """Against a float64 log_softmax of the unprocessed logits: temperature, top-k and top-p change
    what is sampled, not the logprobs; each row gets the sampled token first, then its own k."""
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    meta = logprob_meta([0.0, 0.5, 1.3, 0.0, 2.0], [3, None, 0, 5, 20], top_k=torch.tensor([0, 0, 4, 0, 2]),
                        top_p=torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5]))
    out = Sampler(torch.Generator().manual_seed(0)).sample(logits.clone(), meta)
    assert out.sampled.tolist() == Sampler(torch.Generator().manual_seed(0))(logits.clone(), meta).tolist()
    dicts = out.logprobs.to_dicts(meta.num_logprobs)
    want = logits.double().log_softmax(dim=-1)
    for row, k, entry in zip(meta.logprob_rows_cpu.tolist(), meta.num_logprobs, dicts):
        token = out.sampled[row].item()
        assert next(iter(entry)) == token
        order = want[row].argsort(descending=True).tolist()
        top = order[:k]
        assert set(entry) == {token, *top} and len(entry) == k + (token not in top)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(want[row, t].item(), abs=1e-5)
            assert lp.rank == order.index(t) + 1
            assert lp.decoded_token is None


def test_sampled_token_outside_the_top_k_gets_its_own_rank():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(dim=-1)
    out = Sampler().sample(logits, logprob_meta([1.0], [1], top_k=torch.tensor([0])))
    sampled = out.sampled.item()
    # Rank how many tokens are at least as likely, whichever token the noise picked.
    tokens = [0, 1, 2, 3, 4]
    entry = out.logprobs.to_dicts([1])[0]
    assert entry[sampled].rank == tokens.index(sampled) + 1 and entry[0].rank == 1
    meta = logprob_meta([1.0], [1], top_k=torch.tensor([0]))
    logits = torch.tensor([[0.0, 100.0, 0.0]])  # token 1 always; with k=1 it is the top token too
    assert list(Sampler().sample(logits, meta).logprobs.to_dicts([1])[0]) == [1]


def test_no_row_asking_for_logprobs_computes_none(monkeypatch):
    """The hot path: without logprob rows, ``sample`` only samples (no log_softmax at all)."""
    called = []
    monkeypatch.setattr(torch.Tensor, "log_softmax", lambda *a, **k: called.append(1))
    logits = torch.randn(3, 50)
    out = Sampler().sample(logits, SamplingMetadata(temperature=torch.zeros(3)))
    assert out.logprobs is None and out.sampled.tolist() == logits.argmax(dim=-1).tolist() and not called


def test_a_repetition_penalty_that_overflows_still_favours_its_token():
    """A tiny repetition penalty divides a positive logit past float32's range: random rows sample the favoured
    token as greedy rows take it (an inf logit made the row NaN after the shift by its maximum: token 0)."""
    logits = torch.tensor([[0.5, 1.0, 2.0, 3.0]]).repeat(2, 1)
    pen = penalties([0, 1], [[2], [2]], [1, 1], [0.0, 0.0], [0.0, 0.0], [1e-40, 1e-40])
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0]), all_greedy=False, penalties=pen)
    assert Sampler(torch.Generator().manual_seed(0))(logits, meta).tolist() == [2, 2]
