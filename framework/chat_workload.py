"""A Poisson stream of chat requests with shared prefixes: the simulator's test and benchmark
workload (a stand-in for the experiments' workload generators; any iterable of ``Arrival`` in
time order drives ``Cluster.run``).

Requests arrive as a Poisson process of ``rate`` per second. Each starts a new conversation
(probability ``1 / mean_turns``) or continues an open one: its prompt is one of a few system
prompts, the conversation so far (earlier user turns and the replies the client received, as
random tokens of the replies' lengths) and a new user turn, so later turns share long prefixes
with earlier ones. Turn and reply lengths are log-normal. Replies are ``max_tokens`` long
(``ignore_eos``): the output lengths are the workload's, not the model's.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from framework.cluster import Arrival
from framework.sampling_params import SamplingParams


@dataclass
class ChatWorkload:
    num_requests: int = 1000
    rate: float = 4.0
    seed: int = 0
    vocab_size: int = 32000
    num_system_prompts: int = 4
    system_prompt_len: int = 96
    user_len_median: float = 100.0
    output_len_median: float = 200.0
    len_sigma: float = 0.6
    mean_turns: float = 2.0
    min_len: int = 4
    max_prompt_len: int = 1536
    max_output_len: int = 1024
    max_open_conversations: int = 256
    num_token_ids: int = 4096
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.num_requests < 0 or not self.rate > 0:
            raise ValueError(f"need num_requests >= 0 and rate > 0, got {self.num_requests!r}, {self.rate!r}")
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns!r}")
        if not 3 < self.vocab_size:
            raise ValueError(f"vocab_size must be > 3, got {self.vocab_size!r}")
        if self.max_prompt_len < self.system_prompt_len + self.min_len:
            raise ValueError("max_prompt_len must leave room for a system prompt and a user turn")

    def __iter__(self) -> Iterator[Arrival]:
        rng = random.Random(self.seed)
        tok_rng = np.random.default_rng(self.seed)
        # Tokens are drawn from ``num_token_ids`` distinct ids spread over the vocabulary (0-2,
        # BOS/EOS/PAD in most vocabularies, left out), all one table of int objects: a million
        # prompt tokens then cost a million pointers into a cache-sized table, not a million
        # separate ints scattered over memory (which makes every pass over a prompt slow).
        # Which ids a prompt holds matters only to the prefix cache, which compares whole blocks.
        distinct = min(self.num_token_ids, self.vocab_size - 3)
        ids = sorted(tok_rng.choice(np.arange(3, self.vocab_size), distinct, replace=False).tolist())
        table = np.empty(distinct, dtype=object)
        table[:] = ids
        pool: list[int] = []
        pos = 0

        def tokens(n: int) -> list[int]:
            nonlocal pool, pos
            if pos + n > len(pool):
                pool = table[tok_rng.integers(0, distinct, max(n, 1 << 16))].tolist()
                pos = 0
            pos += n
            return pool[pos - n:pos]

        def length(median: float, cap: int) -> int:
            return max(self.min_len, min(cap, round(rng.lognormvariate(math.log(median), self.len_sigma))))

        systems = [tokens(self.system_prompt_len) for _ in range(self.num_system_prompts)]
        open_convs: list[list[int]] = []
        t = 0.0
        for i in range(self.num_requests):
            t += rng.expovariate(self.rate)
            user = length(self.user_len_median, self.max_prompt_len)
            out = length(self.output_len_median, self.max_output_len)
            history = None
            if open_convs and rng.random() >= 1.0 / self.mean_turns:
                k = rng.randrange(len(open_convs))
                if len(open_convs[k]) + user <= self.max_prompt_len:
                    history = open_convs[k]
                    open_convs[k] = open_convs[-1]
                    open_convs.pop()
            if history is None:
                history = systems[rng.randrange(len(systems))]
                user = min(user, self.max_prompt_len - len(history))
            prompt = history + tokens(user)
            if len(prompt) + out <= self.max_prompt_len:
                open_convs.append(prompt + tokens(out))
                if len(open_convs) > self.max_open_conversations:
                    open_convs.pop(rng.randrange(len(open_convs)))
            params = SamplingParams(max_tokens=out, temperature=self.temperature, ignore_eos=True)
            yield Arrival(t, str(i), prompt, params)
