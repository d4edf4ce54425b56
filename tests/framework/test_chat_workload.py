import statistics

import pytest

from framework.chat_workload import ChatWorkload


def test_deterministic_poisson_stream_of_chats_with_shared_prefixes():
    w = ChatWorkload(num_requests=3000, rate=4.0, seed=7, vocab_size=128256)
    arrivals = list(w)
    assert [a.request_id for a in arrivals] == [a.request_id for a in ChatWorkload(num_requests=3000, rate=4.0, seed=7,
                                                                                    vocab_size=128256)]
    assert [a.prompt_token_ids for a in arrivals[:50]] == [a.prompt_token_ids for a in list(w)[:50]]
    times = [a.time for a in arrivals]
    assert times == sorted(times)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert statistics.mean(gaps) == pytest.approx(1 / 4.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 4.0, rel=0.1)  # exponential gaps
    prompts = [a.prompt_token_ids for a in arrivals]
    assert all(w.min_len <= len(p) <= w.max_prompt_len and min(p) >= 3 and max(p) < 128256 for p in prompts)
    outs = [a.params.max_tokens for a in arrivals]
    assert 150 < statistics.median(outs) < 250 and all(a.params.ignore_eos for a in arrivals)
    # Later turns extend earlier prompts; every prompt starts with one of the system prompts.
    starts = {tuple(p[:w.system_prompt_len]) for p in prompts}
    assert len(starts) == w.num_system_prompts
    firsts = {tuple(p) for p in prompts}
    extended = sum(1 for p in prompts if any(tuple(p[:n]) in firsts for n in range(w.system_prompt_len + 1, len(p))))
    assert extended > len(prompts) / 4


def test_bad_parameters():
    with pytest.raises(ValueError, match="rate > 0"):
        ChatWorkload(rate=0)
    with pytest.raises(ValueError, match="mean_turns"):
        ChatWorkload(mean_turns=0.5)
    with pytest.raises(ValueError, match="max_prompt_len"):
        ChatWorkload(max_prompt_len=10)
