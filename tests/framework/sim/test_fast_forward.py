"""A simulated engine that advances pure-decode runs at once ends up exactly where stepping one
by one does: same steps, same token times, same blocks, same prefix cache."""
import pytest

from framework import ALLOCATORS, EXECUTORS, EngineConfig, LLMEngine, SamplingParams
from framework.kv.allocators.paged import PagedBlockAllocator
from framework.harness.cluster import Cluster
from framework.sim.executor import SimExecutor
from framework.sim.fast_forward import advance, declares_steady_decode, replay_decode_run
from framework.harness.recorder import RunRecorder
from framework.common.request import Request, RequestStatus
from framework.harness.workload import WorkloadRequest
from framework.testing.registries import forget_registrations
from policies.fcfs import FCFSPolicy
from tests.framework.sim.support import RunCounter, chat_requests, serve_cluster



def serve(fast, run_dir, num_requests=150, rate=6.0, n=1, **engine):
    config = EngineConfig(model="llama-3-8b", executor="sim", max_num_seqs=64, max_num_batched_tokens=4096,
                          executor_options={"fast_forward": fast}, **{"max_model_len": 4096, **engine})
    cluster = Cluster.build(config)
    engine_ = cluster.engines[0]
    recorder, counter = RunRecorder(run_dir), RunCounter()
    engine_.step_callbacks += [recorder.step_log(), counter]
    requests = chat_requests(num_requests, rate, seed=3, vocab_size=2000,
                             prompt_len={"dist": "lognormal", "mean": 200, "std": 150, "min": 4, "max": 800},
                             output_len={"dist": "lognormal", "mean": 120, "std": 80, "min": 4, "max": 400})
    outs = cluster.run(requests, {"n": n} if n > 1 else None).outputs
    recorder.close()
    requests = sorted((o.request_id, tuple(o.metrics.token_times), o.metrics.first_scheduled_time, o.metrics.num_cached_tokens,
                       o.metrics.num_preemptions, o.metrics.num_swaps, tuple(len(c.token_ids) for c in o.outputs),
                       tuple(c.finish_reason for c in o.outputs)) for _, o in outs)
    alloc = engine_.allocator
    state = (list(alloc._free), dict(alloc._hash_to_block), [(b.ref_count, b.hash, b.token_ids) for b in alloc._blocks],
             alloc.stats.to_dict(), engine_.scheduler.num_preemptions, engine_.scheduler.num_swap_outs,
             engine_.num_steps, engine_.clock.now())
    return (run_dir / "steps.csv").read_text(), requests, state, counter.steps


SCENARIOS = {
    "plenty of blocks": {},
    "recompute preemptions": dict(num_gpu_blocks_override=260, max_model_len=1024),
    "swap preemptions": dict(num_gpu_blocks_override=260, max_model_len=1024, policy="fcfs",
                             policy_options={"preemption_mode": "swap"}, swap_space=0.05),
    "block size 1": dict(block_size=1, num_gpu_blocks_override=3000, max_model_len=1024),
    "no prefix caching, length cap": dict(enable_prefix_caching=False, block_size=32, max_model_len=700),
    "chunked prefill": dict(policy="chunked", policy_options={"long_prefill_token_threshold": 256}),
    "chunked, recompute preemptions": dict(num_gpu_blocks_override=260, max_model_len=1024, policy="chunked"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_decode_runs_equal_stepping_one_by_one(scenario, tmp_path):
    steps, requests, state, _ = serve(False, tmp_path / "slow", **SCENARIOS[scenario])
    fast_steps, fast_requests, fast_state, runs = serve(True, tmp_path / "fast", **SCENARIOS[scenario])
    # The fast path took a good share of the steps (most, unless preemptions keep requests waiting)
    # with the run's recorder attached: steps.csv is byte for byte the step-by-step one.
    num_steps = state[6]
    assert runs > (0.8 if scenario == "plenty of blocks" else 0.1) * num_steps
    assert fast_steps == steps and steps.count("\n") == num_steps + 1
    assert fast_requests == requests
    assert fast_state == state


def test_parallel_sampling_requests_too(tmp_path):
    slow, fast = serve(False, tmp_path / "slow", num_requests=80, n=2), serve(True, tmp_path / "fast", num_requests=80, n=2)
    assert fast[0] == slow[0] and fast[1] == slow[1] and fast[2] == slow[2]
    assert all(len(r[6]) == 2 for r in fast[1]) and fast[3] > 0


def test_scenarios_exercise_what_they_claim(tmp_path):
    _, requests, state, _ = serve(True, tmp_path / "swap", **SCENARIOS["swap preemptions"])
    assert state[5] > 0 and any(r[5] for r in requests)  # swaps
    _, requests, state, _ = serve(True, tmp_path / "recompute", **SCENARIOS["recompute preemptions"])
    assert state[4] > 0 and state[3]["prefix_hit_tokens"] > 0 and state[3]["evictions"] > 0


def test_only_the_class_defining_schedule_can_promise_steady_decode():
    class Inherits(FCFSPolicy):
        def waiting_order(self, waiting):
            return sorted(waiting, key=lambda r: r.num_prompt_tokens)

    class Overrides(FCFSPolicy):
        def schedule(self, scheduler, step):
            super().schedule(scheduler, step)

    class OverridesAndPromises(Overrides):
        steady_decode = True

    assert declares_steady_decode(FCFSPolicy()) and declares_steady_decode(Inherits())
    assert not declares_steady_decode(Overrides()) and declares_steady_decode(OverridesAndPromises())


def test_paged_decode_run_allocation_equals_replaying_allocate_slots():
    def setup():
        alloc = PagedBlockAllocator(num_blocks=200, block_size=4)
        reqs = []
        for i, n in enumerate([5, 8, 11, 3, 16]):
            req = Request(str(i), [i * 100 + t for t in range(n)], SamplingParams(), 0.0)
            hit = alloc.find_prefix(req)
            assert alloc.allocate_slots(req, n - hit.num_tokens, hit)
            req.num_computed_tokens = n
            req.status = RequestStatus.RUNNING
            req.token_ids.append(7)  # the token sampled by the prefill
            reqs.append(req)
        for req in reqs:
            req.token_ids.extend([9] * 13)  # the run's tokens, appended before allocating
        return alloc, reqs

    fast, fast_reqs = setup()
    replayed, replay_reqs = setup()
    used = fast.allocate_decode_run(fast_reqs, 13, track=True)
    expected = replay_decode_run(replayed, replay_reqs, 13, track=True)
    assert used == expected and len(used) == 13
    assert [r.block_ids for r in fast_reqs] == [r.block_ids for r in replay_reqs]
    assert list(fast._free) == list(replayed._free) and fast._hash_to_block == replayed._hash_to_block
    assert [r.num_computed_tokens for r in fast_reqs] == [5, 8, 11, 3, 16]
    fast.check_invariants(fast_reqs)
    for req in fast_reqs:
        fast.free(req)
    for req in replay_reqs:
        replayed.free(req)


def test_forked_blocks_end_the_promise():
    alloc = PagedBlockAllocator(num_blocks=50, block_size=4)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(), 0.0)
    child = Request("c", [1, 2, 3, 4, 5, 6], SamplingParams(), 0.0)
    assert alloc.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    alloc.fork(parent, child)
    child.num_computed_tokens = 6
    assert alloc.decode_run_blocks([parent], 3) is None  # its partial block is shared: copy-on-write
    alloc.free(parent)
    alloc.free(child)


def test_parallel_samples_finishing_on_different_steps_of_a_run(tmp_path):
    """Under preemption the sequences of an n > 1 request fall out of step and finish on different
    steps of one decode run. The request's output belonged to its first sequence's step: steps.csv
    counted it finished early and requests.csv listed it before requests that finished sooner."""
    options = dict(num_requests=60, n=3, preparer="v0", num_gpu_blocks_override=300, max_model_len=1024)
    slow, fast = serve(False, tmp_path / "slow", **options), serve(True, tmp_path / "fast", **options)
    assert fast[0] == slow[0] and fast[1] == slow[1] and fast[2] == slow[2] and fast[3] > 0
    assert fast[2][4] > 0  # preemptions: what puts the sequences out of step


@pytest.mark.parametrize("fast", [True, False])
def test_a_request_ignored_on_arrival_comes_before_the_next_steps_finishes(fast):
    """A request ignored on arrival finishes at once, and its output comes with the engine's next
    step. When a request finished on that step too, stepping wrote the two rows of requests.csv
    in one order and a decode run in the other; now both in finish order, the ignored one first."""
    config = EngineConfig(model="llama-3-8b", executor="sim", max_model_len=128, executor_options={"fast_forward": fast})
    first = WorkloadRequest("r1", [7] * 64, 3, 0.0)
    (_, alone), = Cluster.build(config).run([first]).outputs
    t1, t2, t3 = alone.metrics.token_times
    seen = []
    Cluster.build(config).run([first, WorkloadRequest("r2", [8] * 200, 3, (t1 + t2) / 2)],
                              on_output=lambda i, out: seen.append((out.request_id, out.metrics.finished_time)))
    assert seen == [("r2", t2), ("r1", t3)]


class SimWithOverhead(SimExecutor):
    """A researcher's simulator: every step also pays 5 ms of host overhead."""

    def execute(self, out):
        self.clock.advance(0.005)
        return super().execute(out)


class Watermark(PagedBlockAllocator):
    """A researcher's allocator: keeps 8 blocks free (vLLM v0's watermark, for every allocation)."""

    def allocate_slots(self, request, num_new_tokens, prefix=None):
        if self._new_blocks(request, num_new_tokens, prefix) > self.num_free_blocks - 8:
            return False
        return super().allocate_slots(request, num_new_tokens, prefix)


class Unchanged(PagedBlockAllocator):
    pass


@pytest.mark.parametrize("part, cls", [("executor", SimWithOverhead), ("allocator", Watermark),
                                       ("allocator", Unchanged)])
def test_a_subclass_overriding_how_steps_run_is_not_fast_forwarded_as_its_base(part, cls, monkeypatch):
    """Decode runs were planned by the base class's code: the executor's extra time and the
    allocator's refusals were skipped on the fast path (0 preemptions instead of 27)."""
    registry = EXECUTORS if part == "executor" else ALLOCATORS
    forget_registrations(monkeypatch, registry)
    registry.register(f"test_{cls.__name__.lower()}")(cls)
    requests = [WorkloadRequest(str(i), list(range(10 + i, 110 + i)), 200) for i in range(4)]
    results = []
    for fast in (True, False):
        config = EngineConfig(model="llama-3-8b", executor="sim", executor_options={"fast_forward": fast},
                              num_gpu_blocks_override=80, max_model_len=1024)
        setattr(config, part, f"test_{cls.__name__.lower()}")
        cluster = Cluster.build(config)
        counter = RunCounter()
        cluster.engines[0].step_callbacks.append(counter)
        outs = cluster.run(requests).outputs
        results.append((sorted((o.request_id, tuple(o.metrics.token_times)) for _, o in outs),
                        cluster.engines[0].scheduler.num_preemptions, counter.steps))
    assert results[0][:2] == results[1][:2]
    assert (results[0][2] > 0) == (cls is Unchanged)  # a subclass changing nothing keeps the fast path


def test_a_v0_leader_completing_its_prompt_in_a_decode_shaped_step_forks_its_samples():
    """Under preparer v0 the simulator forks an n > 1 request's samples from its leader when the
    leader samples its first token. A chunked prompt can leave the leader one token to compute,
    a step that looks like a decode: a decode run took it, and the samples were never forked
    (the request never finished)."""
    config = EngineConfig(model="llama-3-8b", executor="sim", preparer="v0", policy="chunked", block_size=16,
                          max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128,
                          executor_options={"fast_forward": True})
    engine = Cluster.build(config).engines[0]
    engine.add_request("a", list(range(5, 22)), SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    outputs = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        outputs += advance(engine)
    (out,) = outputs
    assert [len(c.token_ids) for c in out.outputs] == [4, 4] and len(out.metrics.token_times) == 4
    assert engine.allocator.stats.cow_copies == 1  # the samples shared the prompt's partial block


@pytest.mark.parametrize("fast", [True, False])
def test_a_v0_request_of_several_samples_aborted_before_its_first_token_finishes(fast):
    """Aborting a v0 request with n > 1 before its leader sampled (its other samples not forked
    yet) while another request decodes: a decode run handed back the aborted leader without taking
    its samples along, so they waited for a fork forever and the engine never ran out of work."""
    engine = LLMEngine(EngineConfig(model="llama-3-8b", executor="sim", preparer="v0",
                                    executor_options={"fast_forward": fast}))
    engine.add_request("a", {"prompt_token_ids": list(range(10))}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.add_request("b", {"prompt_token_ids": list(range(20, 30))}, SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    engine.abort_request("b")
    outs = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        outs += advance(engine)
    assert not engine.has_unfinished_requests()
    finished = {o.request_id: [c.finish_reason for c in o.outputs] for o in outs}
    assert finished == {"b": ["abort", "abort"], "a": ["length"]}
    assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks


def test_a_plain_step_callback_sees_every_step_and_the_run_is_unchanged():
    requests, seen = chat_requests(10, rate=4.0, seed=3), []
    outs, end = serve_cluster(requests, fast_forward=True, callbacks=[lambda stats, out: seen.append(out)])
    assert (outs, end) == serve_cluster(requests, fast_forward=False)
    assert len(seen) > 100


def test_a_first_token_computed_in_a_decode_shaped_step_gets_its_time():
    # 513 prompt tokens in chunks of 512: the last prompt token is a one-token step, which the fast path may take.
    requests = [WorkloadRequest("0", list(range(3, 516)), 20, arrival_time=0.5)]
    fast = serve_cluster(requests, fast_forward=True, policy="chunked", max_num_batched_tokens=512)
    assert fast == serve_cluster(requests, fast_forward=False, policy="chunked", max_num_batched_tokens=512)


def test_requests_capped_by_max_model_len_in_a_decode_run_stop_where_stepping_stops():
    # Request 1 asks for one token more than max_model_len leaves it room for.
    requests = [WorkloadRequest("0", list(range(3, 503)), None, arrival_time=0.1),
                WorkloadRequest("1", list(range(3, 403)), 201, arrival_time=0.1),
                WorkloadRequest("2", list(range(3, 303)), 400, arrival_time=0.1)]
    fast = serve_cluster(requests, fast_forward=True, max_model_len=600)
    assert fast == serve_cluster(requests, fast_forward=False, max_model_len=600)
    assert [length for _, length, *_ in fast[0]] == [100, 200, 300]


def test_an_arrival_exactly_at_a_decode_steps_end_joins_the_next_step_as_when_stepping():
    first = WorkloadRequest("0", list(range(3, 203)), 60, arrival_time=0.0)
    cluster = Cluster.build(EngineConfig(model="llama-3-8b", executor="sim",
                                         executor_options={"hardware": "h100-sxm", "fast_forward": False}))
    ends = []
    cluster.engines[0].step_callbacks.append(lambda stats, out: ends.append(cluster.engines[0].clock.now()))
    cluster.run([first], {"ignore_eos": True})
    requests = [first, WorkloadRequest("1", list(range(500, 600)), 10, arrival_time=ends[20])]
    assert serve_cluster(requests, fast_forward=True) == serve_cluster(requests, fast_forward=False)
