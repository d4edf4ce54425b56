"""Async scheduling in the simulator: the same requests, tokens and finish reasons as a synchronous run, each
step's host time (the roofline's overheads) overlapped with the step before's device time."""
import pytest

from framework import LLM, EngineConfig, LLMEngine, SamplingParams
from framework.sim.cost_model import BatchShape
from framework.harness.workload import WorkloadRequest
from tests.framework.sim.support import RunCounter, chat_requests, serve_cluster


def run(async_scheduling, requests, **options):
    """Final outputs and per-step (duration, shape of the step launched) of a simulated run of ``requests``
    (arrivals ignored)."""
    llm = LLM(model="llama-3-8b", executor="sim", async_scheduling=async_scheduling, max_num_seqs=16,
              executor_options={"hardware": "h100-sxm", **options}, check_invariants=True)
    steps, shapes = [], []
    executor = llm.engine.executor
    for name in ("execute", "launch"):  # each step's shape as it runs (a callback sees it advanced)
        method = getattr(executor, name)
        setattr(executor, name, lambda out, method=method: (shapes.append(BatchShape.from_scheduler_output(out)),
                                                            method(out))[1])
    llm.engine.step_callbacks.append(lambda stats, out: steps.append((stats.duration, shapes[-1] if out.runs else None)))
    outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                        [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests])
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks - 1, "blocks leaked"
    return llm, outs, steps


def test_async_runs_the_requests_of_a_synchronous_run_in_less_time():
    requests = chat_requests(40, rate=4.0, seed=3)
    sync_llm, sync_outs, sync_steps = run(False, requests)
    async_llm, async_outs, async_steps = run(True, requests)
    assert async_llm.engine.async_scheduling and not sync_llm.engine.async_scheduling
    assert [(o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in async_outs] == \
        [(o.request_id, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync_outs]
    assert async_llm.engine.clock.now() < sync_llm.engine.clock.now()
    # A request finishing by length keeps its seat until its last token is known (vLLM's): a request waiting for
    # that seat is admitted a step later, at most once per finished request.
    sync_steps, async_steps = sync_llm.engine.executor.num_steps, async_llm.engine.executor.num_steps
    assert sync_steps <= async_steps <= sync_steps + len(requests)


def test_a_decode_step_lasts_the_longer_of_its_host_time_and_the_device_time_before_it():
    """Eight equal requests decoding together: once the pipeline is full each step takes max(host, device) of
    the steps around it, where a synchronous step takes host + device; with a large per-step overhead the host
    side is the longer, with none the device is."""
    requests = chat_requests(8, rate=1.0, seed=1, prompt_len={"dist": "fixed", "value": 64},
                             output_len={"dist": "fixed", "value": 24})
    for overhead in (0.0, 20000.0):
        options = {"cost_model": {"name": "roofline", "step_overhead_us": overhead}}
        llm, _, steps = run(True, requests, **options)
        _, _, sync_steps = run(False, requests, **options)
        cost = llm.engine.executor.cost_model
        decodes = [(d, shape) for d, shape in steps if shape and shape.is_pure_decode and shape.num_seqs == 8]
        assert len(decodes) > 10
        for (duration, shape), (_, before) in zip(decodes[2:], decodes[1:]):
            host = cost.host_time(shape)
            device = cost.step_time(before) - cost.host_time(before)
            assert duration == pytest.approx(max(host, device), rel=1e-9)
        sync_decodes = [d for d, shape in sync_steps if shape and shape.is_pure_decode and shape.num_seqs == 8]
        assert sync_decodes[2] == pytest.approx(cost.step_time(decodes[2][1]), rel=1e-9)
        assert (host > device) == (overhead > 0)


def test_a_cost_model_without_host_time_gives_the_synchronous_times():
    """The replay cost model has no host/device split: under async scheduling every step takes what it replays."""
    requests = chat_requests(6, rate=2.0, seed=2)
    _, _, sync_steps = run(False, requests, fast_forward=False)
    durations = [d for d, _ in sync_steps]
    replay = {"cost_model": {"name": "replay", "durations": durations + [0.0] * 4}, "fast_forward": False}
    llm, _, async_steps = run(True, requests, **replay)
    got = [d for d, _ in async_steps]
    # Step k of the async run collects step k-1's tokens: its duration is step k-1's device time.
    assert got[1:len(durations)] == pytest.approx(durations[: len(durations) - 1], rel=1e-9)


def test_async_scheduling_in_the_simulator_is_asked_for_and_needs_the_v1_preparer():
    assert not LLMEngine(EngineConfig(model="llama-3-8b", executor="sim")).async_scheduling  # auto: off
    with pytest.raises(ValueError, match=r"^async_scheduling=true cannot run with preparer=v0, which does not defer sampled tokens"):
        LLMEngine(EngineConfig(model="llama-3-8b", executor="sim", preparer="v0", async_scheduling=True))


def test_a_step_launched_on_an_idle_device_still_takes_its_device_time():
    # A request arriving a second after start: its prefill cannot have run on the device while it sat idle.
    late = [WorkloadRequest("0", list(range(3, 2003)), 8, arrival_time=1.0)]
    (sync,), _ = serve_cluster(late, fast_forward=False, async_scheduling=False)
    (overlapped,), _ = serve_cluster(late, fast_forward=False, async_scheduling=True)
    ttft, tpot = 2, 3
    assert overlapped[ttft] == sync[ttft]  # nothing ran before it to overlap with
    assert sync[tpot] > overlapped[tpot] > 0.5 * sync[tpot]  # only host time hidden behind the device's


def test_an_async_run_is_the_same_with_the_fast_path_on_or_off():
    # The fast path knows only synchronous timing, so it must step aside under async scheduling.
    requests = chat_requests(20, rate=4.0, seed=3)
    fast = serve_cluster(requests, fast_forward=True, callbacks=[RunCounter()], async_scheduling=True)
    assert fast == serve_cluster(requests, fast_forward=False, async_scheduling=True)
