"""FCFS with preemption_mode=swap: victims go to the swap space and come back, outputs intact."""
import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.common.request import RequestStatus
from tests.policies.harness import Arrival, drive, reference_output, shadow_engine


def run(mode, prompts, max_tokens, **kw):
    args = dict(model="tiny-llama", max_model_len=32, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                num_gpu_blocks_override=10, check_invariants=True, policy_options={"preemption_mode": mode})
    e = LLMEngine(EngineConfig(**{**args, **kw}))
    steps, outputs = [], {}
    e.step_callbacks.append(lambda stats, out: steps.append(out))
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outputs[o.request_id] = o
    return e, steps, outputs


def test_swapped_requests_come_back_and_match_recompute():
    # 9 usable blocks of 4 tokens: three 10-token prompts fit, their decodes do not.
    prompts = [list(range(3 + i, 13 + i)) for i in range(3)]
    _, _, reference = run("recompute", prompts, 12)
    e, steps, outputs = run("swap", prompts, 12)
    swapped_out = [r.request_id for out in steps for r in out.swapped_out]
    swapped_in = [r.request_id for out in steps for r in out.swapped_in]
    assert swapped_out and sorted(swapped_in) == sorted(swapped_out)
    assert all(out.blocks_to_swap_in for out in steps if out.swapped_in)
    assert {k: o.outputs[0].token_ids for k, o in outputs.items()} == \
        {k: o.outputs[0].token_ids for k, o in reference.items()}
    assert all(o.metrics.num_swaps >= 1 for k, o in outputs.items() if k in swapped_out)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs.values())
    assert not e.has_unfinished_requests() and e.scheduler.num_swap_outs == len(swapped_out)


def test_no_prompt_is_admitted_while_requests_are_swapped():
    prompts = [list(range(3 + i, 13 + i)) for i in range(5)]
    e, steps, outputs = run("swap", prompts, 12)
    swapped = set()
    for out in steps:
        if swapped:
            assert not out.new_requests, "a new prompt was admitted while a request sat in swap"
        swapped |= {r.request_id for r in out.swapped_out}
        swapped -= {r.request_id for r in out.swapped_in}
    assert len(outputs) == 5 and all(len(o.outputs[0].token_ids) == 12 for o in outputs.values())
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for out in steps for r in out.scheduled if r.is_finished)


@pytest.mark.parametrize("policy", ["fcfs", "chunked"])
def test_swapped_requests_come_back_oldest_first(policy):
    """As vLLM v0 sorts its swapped queue by arrival. Victims leave newest first, so bringing
    them back in the order they left let a newer request return while an older one stayed out."""
    # 9 usable blocks of 4: a, b, c (10-token prompts) fill them; c leaves first, then b. When a
    # frees enough for one of them, it must be b, the older.
    e = shadow_engine(policy, num_blocks=10, num_cpu_blocks=20, policy_options={"preemption_mode": "swap"},
                      max_model_len=32)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {rid: list(range(3 + i, 13 + i)) for i, rid in enumerate("abc")}
    run = drive(e, [Arrival(rid, 0, p, params) for rid, p in prompts.items()], max_steps=100)
    left = [r.request_id for out in run.steps for r in out.swapped_out]
    assert left[:2] == ["c", "b"], "the scenario: the newest leaves first"
    arrival = {rid: i for i, rid in enumerate(prompts)}
    swapped: set = set()
    for out in run.steps:
        swapped |= {r.request_id for r in out.swapped_out}
        back = {r.request_id for r in out.swapped_in}
        swapped -= back
        for rid in back:
            assert all(arrival[other] > arrival[rid] for other in swapped), (
                f"{rid} came back while older {sorted(swapped)} stayed out")
    assert {rid: o.outputs[0].token_ids for rid, o in run.outputs.items()} == \
        {rid: reference_output(p, params, 32) for rid, p in prompts.items()}
