"""The shadow engine (``framework.testing``, re-exported for the tests here) and two helpers of these tests only:
a simulated engine stepped one step at a time, and a trace of each step's decisions."""
from __future__ import annotations

from framework import EngineConfig, LLMEngine
from framework.testing import (EOS, VOCAB, Arrival, Run, ShadowExecutor, drive, next_token,  # noqa: F401
                               reference_output, shadow_engine)


def sim_engine(policy_name: str, policy: object = None, mode: str = "recompute", **kw) -> LLMEngine:
    """A simulated ``llama-3-8b`` engine stepped one step at a time (no fast-forward) under
    ``policy_name`` with ``preemption_mode=mode``; ``policy``, an instance (a subclass under
    test), replaces the one the engine built. ``kw`` overrides the ``EngineConfig`` fields."""
    args = dict(model="llama-3-8b", executor="sim", policy=policy_name, block_size=16, max_model_len=512,
                swap_space=0.05, policy_options={"preemption_mode": mode}, executor_options={"fast_forward": False})
    args.update(kw)
    e = LLMEngine(EngineConfig(**args))
    if policy is not None:
        e.policy = e.scheduler.policy = policy
    return e


def schedule_trace(engine: LLMEngine) -> list[tuple[list[tuple[str, int]], list[str]]]:
    """What each step of ``engine`` decides from now on, filled in as it steps: the requests
    scheduled with their token counts, and the requests preempted, swapped out or swapped in."""
    steps: list[tuple[list[tuple[str, int]], list[str]]] = []
    engine.step_callbacks.append(lambda stats, out: steps.append((
        [(r.request_id, out.num_scheduled_tokens[r.request_id]) for r in out.scheduled],
        [r.request_id for r in out.preempted + out.swapped_out + out.swapped_in])))
    return steps
