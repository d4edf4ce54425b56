"""The discrete-event driver: events in time order, idle replicas jumping to arrivals, replicas
that never interfere, and routing that sees the cluster as of each arrival."""
import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.chat_workload import ChatWorkload
from framework.cluster import Arrival, Cluster
from framework.cost_model import BatchShape

CONFIG = EngineConfig(model="llama-3-8b", executor="sim", max_num_seqs=32, max_num_batched_tokens=4096)


def arrival(t, rid, n=64, out=4):
    return Arrival(t, rid, [7 + int(rid.strip("r")) % 50] * n, SamplingParams(max_tokens=out, ignore_eos=True))


def test_a_lone_request_waits_for_nothing_and_takes_the_cost_models_times():
    cluster = Cluster.build(CONFIG)
    (_, out), = cluster.run([arrival(10.0, "r1", n=100, out=2)])
    cost = cluster.engines[0].executor.cost_model
    prefill = cost.step_time(BatchShape(num_seqs=1, num_tokens=100, num_sampled=1, num_prefill_seqs=1,
                                        prefill_tokens=100, prefill_context=100, prefill_pairs=5050))
    assert out.metrics.first_scheduled_time == 10.0  # the idle clock jumped to the arrival
    assert out.metrics.token_times == [10.0 + prefill, 10.0 + prefill + cost.decode_step_time(1, 101)]


def test_an_arrival_at_a_step_boundary_joins_that_step():
    first = arrival(0.0, "r1", out=3)
    (_, a), = Cluster.build(CONFIG).run([first])
    boundary = a.metrics.token_times[0]  # the second step starts here
    outs = dict((o.request_id, o) for _, o in Cluster.build(CONFIG).run([first, arrival(boundary, "r2")]))
    assert outs["r2"].metrics.first_scheduled_time == boundary
    late = dict((o.request_id, o) for _, o in Cluster.build(CONFIG).run([first, arrival(boundary + 1e-9, "r2")]))
    assert late["r2"].metrics.first_scheduled_time > boundary + 1e-9


def test_replicas_behind_round_robin_serve_exactly_what_alone_they_would():
    arrivals = list(ChatWorkload(num_requests=120, rate=20.0, seed=2, vocab_size=128256))
    pair = Cluster.build(CONFIG, num_replicas=2, router="round_robin")
    together = {o.request_id: (i, o.metrics.token_times) for i, o in pair.run(arrivals)}
    for replica in (0, 1):
        alone = Cluster.build(CONFIG).run(arrivals[replica::2])
        assert {o.request_id: (replica, o.metrics.token_times) for _, o in alone} == \
            {rid: v for rid, v in together.items() if v[0] == replica}
    assert pair.replicas[0].num_routed == pair.replicas[1].num_routed == 60


def test_least_outstanding_counts_requests_unfinished_at_the_arrival_time():
    cluster = Cluster.build(CONFIG, num_replicas=2, router="least_outstanding")
    long = arrival(0.0, "r1", out=50)
    (_, alone), = Cluster.build(CONFIG).run([long])
    done = alone.metrics.finished_time
    routed = {}
    cluster.run([long, arrival(0.001, "r2", out=2), arrival(done - 1e-6, "r3", out=2), arrival(done, "r4", out=2)],
                on_output=lambda i, o: routed.__setitem__(o.request_id, i))
    # r2 avoids busy replica 0. r3 arrives just before r1 finishes, after the step that finishes it
    # was simulated: replica 0 still counts r1 (replica 1 is idle). r4 arrives as r1 finishes:
    # replica 0 is free again while r3 still runs on replica 1.
    assert routed == {"r1": 0, "r2": 1, "r3": 1, "r4": 0}


def test_prefix_aware_routing_follows_the_cache_until_load_says_otherwise():
    shared = list(range(100, 400))
    def req(t, rid, prefix=shared):
        return Arrival(t, rid, prefix + [5, int(rid[1:])], SamplingParams(max_tokens=200, ignore_eos=True))
    routed = {}
    cluster = Cluster.build(CONFIG, num_replicas=3, router="prefix_aware", router_options={"max_imbalance": 2})
    cluster.run([req(0.0, "r0", list(range(1000, 1300))), req(1.0, "r1"), req(2.0, "r2"), req(2.1, "r3"),
                 req(2.2, "r4"), req(2.3, "r5")], on_output=lambda i, o: routed.__setitem__(o.request_id, i))
    # r0 takes replica 0; r1 (no hit anywhere) the least loaded, replica 1; r2-r4 follow r1's
    # cached prefix to replica 1 until it has 2 more outstanding than the idle replica 2.
    assert routed["r0"] == 0 and routed["r1"] == 1
    assert [routed[r] for r in ("r2", "r3", "r4", "r5")] == [1, 1, 2, 2]


def test_bad_setups_are_refused():
    model_engine = LLMEngine(EngineConfig(model="tiny-llama", max_model_len=128))
    with pytest.raises(ValueError, match="several replicas .* simulated time"):
        Cluster([model_engine, model_engine])
    sim = LLMEngine(CONFIG)
    with pytest.raises(ValueError, match="own clock"):
        Cluster([sim, LLMEngine(CONFIG, clock=sim.clock)])
    with pytest.raises(ValueError, match="num_replicas must be a positive integer"):
        Cluster.build(CONFIG, num_replicas=0)
    with pytest.raises(ValueError, match="unknown router 'nope'.*least_outstanding, prefix_aware, round_robin"):
        Cluster.build(CONFIG, num_replicas=2, router="nope")
    with pytest.raises(ValueError, match="in time order"):
        Cluster.build(CONFIG).run([arrival(1.0, "r1"), arrival(0.5, "r2")])


@pytest.mark.parametrize("router", ["least_outstanding", "prefix_aware"])
def test_lazy_decode_runs_route_and_serve_exactly_like_stepping(router):
    arrivals = list(ChatWorkload(num_requests=150, rate=30.0, seed=4, vocab_size=128256))
    results = []
    for fast in (True, False):
        config = EngineConfig(model="llama-3-8b", executor="sim", max_num_seqs=32, max_num_batched_tokens=4096,
                              num_gpu_blocks_override=400, max_model_len=2048, executor_options={"fast_forward": fast})
        cluster = Cluster.build(config, num_replicas=3, router=router, router_options={})
        results.append(sorted((o.request_id, i, tuple(o.metrics.token_times), o.metrics.num_cached_tokens)
                              for i, o in cluster.run(arrivals)))
    assert results[0] == results[1]
    assert len({r[1] for r in results[0]}) == 3 and any(r[3] for r in results[0])
