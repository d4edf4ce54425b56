"""Shared by the preparer tests: requests in a given state, scheduler outputs, and the request by
request comparison of two preparers' model inputs for the same scheduler output."""
from __future__ import annotations

import numpy as np

from framework.execution.input_preparer import ModelInput
from framework.execution.preparers.v0 import SequenceGroupPreparer
from framework.execution.preparers.v1 import FlatBatchPreparer
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams
from framework.scheduling.output import SchedulerOutput


def make_req(rid, num_tokens, block_ids, num_computed=0, num_outputs=0):
    """A running request of tokens 100, 101, ... (the last ``num_outputs`` of them sampled)."""
    tokens = list(range(100, 100 + num_tokens))
    r = Request(rid, tokens[: num_tokens - num_outputs], SamplingParams(temperature=0.0), arrival_time=0.0)
    r.token_ids = tokens
    r.block_ids = list(block_ids)
    r.num_computed_tokens = num_computed
    r.status = RequestStatus.RUNNING
    return r


def seed_000_requests():
    """Seed 000's three requests at step 1 (block size 2)."""
    return make_req("0", 3, [1, 2]), make_req("1", 2, [3]), make_req("2", 8, [4, 5, 6])


def seed_000_step_2(r0, r1, r2):
    """Seed 000's step 2: requests 0 and 1 decode their sampled tokens (500, 501), request 2
    finishes its prompt; blocks 7 and 8 are allocated to requests 1 and 2."""
    for r, n in ((r0, 3), (r1, 2), (r2, 5)):
        r.num_computed_tokens = n
    r0.token_ids.append(500)
    r1.token_ids.append(501)
    r1.block_ids.append(7)
    r2.block_ids.append(8)
    return schedule([r0, r1, r2], [1, 1, 3])


def preparer_pair(block_size, max_num_reqs=16, max_model_len=96, max_num_batched_tokens=4096):
    """A v0 and a v1 preparer of the same shape (v1 checks its rows against the requests)."""
    args = dict(max_num_reqs=max_num_reqs, max_model_len=max_model_len, block_size=block_size,
                max_num_batched_tokens=max_num_batched_tokens, check=True)
    return SequenceGroupPreparer(**args), FlatBatchPreparer(**args)


def record(prep, model_input, sampled: dict[str, int]) -> None:
    """What the model runner does after sampling: report the step's sampled tokens."""
    prep.record_sampled(model_input, np.array([sampled[rid] for rid in model_input.sample_req_ids], dtype=np.int64))


def schedule(reqs, counts, new=()):
    return SchedulerOutput(scheduled=list(reqs), num_scheduled_tokens={r.request_id: n for r, n in zip(reqs, counts)},
                           new_requests=list(new))


def rows_by_request(mi: ModelInput) -> dict[str, dict]:
    """Everything a model input says about each request, independent of the row order."""
    h, bs = mi.host, mi.attn_metadata.block_size
    qsl = h["query_start_loc"]
    rows = {}
    for i, rid in enumerate(mi.req_ids):
        a, b = int(qsl[i]), int(qsl[i + 1])
        seq_len = int(h["seq_lens"][i])
        table = h["block_table"][i]
        used = -(-seq_len // bs)
        assert not table[used:].any(), f"{rid}: block table padding past its blocks is not the null block"
        rows[rid] = dict(
            input_ids=h["input_ids"][a:b].tolist(), positions=h["positions"][a:b].tolist(),
            slot_mapping=h["slot_mapping"][a:b].tolist(), seq_len=seq_len,
            num_computed=int(h["num_computed_tokens"][i]), query_len=int(h["num_scheduled_tokens"][i]),
            blocks=table[:used].tolist())
        assert b - a == rows[rid]["query_len"] and seq_len == rows[rid]["num_computed"] + b - a
    return rows


def samples_by_request(mi: ModelInput) -> dict[str, tuple[str, int, float, object]]:
    """Sampled id -> (request whose hidden state is sampled, offset in its query span,
    temperature, generator)."""
    qsl = mi.host["query_start_loc"]
    out = {}
    temps = [0.0] * len(mi.sample_req_ids) if mi.sampling.all_greedy else mi.sampling.temperature.tolist()
    for j, (rid, idx) in enumerate(zip(mi.sample_req_ids, mi.logits_indices.tolist())):
        row = int(np.searchsorted(qsl, idx, side="right")) - 1
        assert rid not in out, f"{rid} sampled twice"
        out[rid] = (mi.req_ids[row], idx - int(qsl[row]), temps[j], mi.sampling.generators.get(j))
    return out


def penalties_by_request(mi: ModelInput) -> dict[str, tuple]:
    """Sampled id -> (min-p, then for a penalised sample its presence, frequency and repetition
    penalties, prompt tokens and output tokens so far)."""
    s, ids = mi.sampling, mi.sample_req_ids
    min_p = s.min_p.tolist() if s.min_p is not None else [0.0] * len(ids)
    out: dict[str, tuple] = {rid: (min_p[j],) for j, rid in enumerate(ids)}
    p = s.penalties
    if p is not None:
        for k, j in enumerate(p.rows.tolist()):
            tokens = p.token_ids[k].tolist()
            tokens = tokens[: tokens.index(-1)] if -1 in tokens else tokens
            m = int(p.num_prompt_tokens[k])
            pen = (p.presence_penalties[k].item(), p.frequency_penalties[k].item(), p.repetition_penalties[k].item())
            out[ids[j]] += (pen, tokens[:m], tokens[m:])
    return out


def assert_equivalent(mi_v0: ModelInput, mi_v1: ModelInput, forks: dict[str, str] | None = None) -> None:
    """Equal after mapping the request order. ``forks`` maps each parallel sample to its leader:
    v0 samples a fork's first token from its leader's row, v1 does not sample it there."""
    forks = forks or {}
    assert sorted(mi_v0.req_ids) == sorted(mi_v1.req_ids)
    r0, r1 = rows_by_request(mi_v0), rows_by_request(mi_v1)
    for rid in r1:
        assert r0[rid] == r1[rid], f"{rid}: v0 {r0[rid]} != v1 {r1[rid]}"
    s0, s1 = samples_by_request(mi_v0), samples_by_request(mi_v1)
    for rid, sample in s0.items():
        if rid in s1:
            assert sample == s1[rid], f"sample of {rid}: v0 {sample} != v1 {s1[rid]}"
        else:
            assert rid in forks, f"v0 samples {rid}, v1 does not"
            assert sample[:2] == s1[forks[rid]][:2], f"fork {rid} is not sampled from its leader's row"
    assert set(s1) <= set(s0)
    p0, p1 = penalties_by_request(mi_v0), penalties_by_request(mi_v1)
    for rid, sample in p0.items():
        assert sample == p1[rid if rid in p1 else forks[rid]], f"min-p or penalties of {rid}"
    m0, m1 = mi_v0.attn_metadata, mi_v1.attn_metadata
    for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "block_size"):
        assert getattr(m0, name) == getattr(m1, name), name
    for m in (m0, m1):
        assert m.num_prefill_tokens + m.num_decode_tokens == m.num_actual_tokens
    # v0 lays out prefills first; its decodes are one-token rows. v1 calls every one-token row a
    # decode, v0 a prompt-stage one-token row a prefill (seed 004's stage), so the counts agree
    # whenever no prompt chunk is a single token.
    q0 = mi_v0.host["num_scheduled_tokens"]
    assert (q0[m0.num_prefills:] == 1).all() and m0.num_decode_tokens == m0.num_reqs - m0.num_prefills
    if (q0[: m0.num_prefills] > 1).all():
        assert (m0.num_prefills, m0.num_prefill_tokens, m0.num_decode_tokens) == (
            m1.num_prefills, m1.num_prefill_tokens, m1.num_decode_tokens)
    assert np.array_equal(mi_v0.input_ids.numpy(), mi_v0.host["input_ids"])
    assert mi_v0.input_ids.dtype == mi_v1.input_ids.dtype == mi_v0.positions.dtype
    for name in ("query_start_loc", "seq_lens", "num_computed_tokens", "slot_mapping", "block_table"):
        assert getattr(m0, name).dtype == getattr(m1, name).dtype, name
    assert (mi_v0.sampling.top_k is None) == (mi_v1.sampling.top_k is None)
    assert (mi_v0.sampling.top_p is None) == (mi_v1.sampling.top_p is None)
