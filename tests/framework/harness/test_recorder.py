"""The run directory's files: step rows equal the engine's step stats whether steps come one by
one or as fast-forwarded decode runs, replica columns, totals, and rows flushed as the run goes; the
run's claim on its folder."""

import threading

import pytest

from framework import EngineConfig, LLMEngine, SamplingParams
from framework.harness.cluster import Cluster
from framework.harness.metrics import STATS_COLUMNS, STEP_COLUMNS, RequestRecord
from framework.harness.recorder import RunRecorder, claim_run_dir
from tests.framework.sim.support import chat_requests
from tests.hydra_support import read_csv


def test_step_rows_are_the_step_stats_with_the_time_since_the_run_start(tmp_path):
    engine = LLMEngine(EngineConfig(model="llama-3-8b", executor="sim", executor_options={"fast_forward": False}))
    recorder = RunRecorder(tmp_path)
    stats = []
    engine.step_callbacks += [recorder.step_log(0, run_start=0.25), lambda s, out: stats.append(s)]
    engine.clock.wait_until(0.25)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    recorder.close()
    rows = read_csv(tmp_path / "steps.csv")
    assert list(rows[0]) == STEP_COLUMNS and len(rows) == len(stats) == 4
    assert [float(r["time_s"]) for r in rows] == pytest.approx([s.start_time - 0.25 for s in stats], abs=1e-6)
    for row, s in zip(rows, stats):
        for name in STATS_COLUMNS:
            assert float(row[name]) == pytest.approx(getattr(s, name), rel=1e-5), name  # kv_usage: 6 digits
    assert [int(r["num_prefill_tokens"]) for r in rows] == [37, 0, 0, 0] and rows[-1]["num_finished"] == "1"
    totals = recorder.step_totals
    assert (totals.num_steps, totals.scheduled_tokens, totals.prefill_tokens) == (4, 40, 37)
    assert totals.max_kv_usage == max(s.kv_usage for s in stats)


def serve_and_record(tmp_path, fast_forward, **engine):
    """A chat workload on two simulated replicas, recorded as a cluster run."""
    config = EngineConfig(model="llama-3-8b", executor="sim", max_num_seqs=64, max_num_batched_tokens=4096,
                          executor_options={"fast_forward": fast_forward}, **{"max_model_len": 4096, **engine})
    cluster = Cluster.build(config, num_replicas=2, router="least_outstanding")
    recorder = RunRecorder(tmp_path, replica_column=True)
    logs = [recorder.step_log(i) for i in range(2)]
    for engine_, log in zip(cluster.engines, logs):
        engine_.step_callbacks.append(log)
    cluster.run(chat_requests(150, rate=8.0, seed=3, vocab_size=2000),
                on_output=lambda i, out: recorder.add_request(RequestRecord.from_output(out), i))
    recorder.close()
    return cluster, recorder


@pytest.mark.parametrize("engine", [{}, {"num_gpu_blocks_override": 300, "max_model_len": 2048}],
                         ids=["plenty of blocks", "preemptions"])
def test_fast_forwarded_runs_write_the_same_files_as_stepping(tmp_path, engine):
    slow_cluster, slow = serve_and_record(tmp_path / "slow", False, **engine)
    fast_cluster, fast = serve_and_record(tmp_path / "fast", True, **engine)
    assert fast_cluster.engines[0].executor.fast_forward  # and the recorder kept the fast path on:
    assert sum(e.executor.num_steps for e in fast_cluster.engines) == fast.step_totals.num_steps
    # Rows come in chunks per replica; each replica's rows are the same, in the same order.
    def per_replica(path):
        rows = read_csv(path / "steps.csv")
        return {r: [row for row in rows if row["replica"] == r] for r in ("0", "1")}
    assert per_replica(tmp_path / "fast") == per_replica(tmp_path / "slow")
    assert (tmp_path / "fast" / "requests.csv").read_bytes() == (tmp_path / "slow" / "requests.csv").read_bytes()
    assert fast.step_totals.summary() == slow.step_totals.summary()  # exactly: mean KV usage too
    if engine:
        assert sum(e.scheduler.num_preemptions for e in fast_cluster.engines) > 0


def test_replica_columns_and_the_timeline(tmp_path):
    cluster, recorder = serve_and_record(tmp_path, True)
    requests = read_csv(tmp_path / "requests.csv")
    assert list(requests[0])[:2] == ["request_id", "replica"] and {r["replica"] for r in requests} == {"0", "1"}
    assert len(requests) == 150 and all(r["max_itl_ms"] for r in requests)
    steps = read_csv(tmp_path / "steps.csv")
    assert list(steps[0])[:2] == ["replica", "time_s"]
    for i, engine in enumerate(cluster.engines):
        mine = [int(r["step"]) for r in steps if r["replica"] == str(i)]
        assert mine == sorted(mine) and len(mine) == engine.executor.num_steps
    timeline = recorder.timeline()
    assert len(timeline["time_s"]) == len(steps) and set(timeline["replica"].tolist()) == {0, 1}


def test_rows_reach_the_disk_as_the_run_goes(tmp_path):
    recorder = RunRecorder(tmp_path, flush_interval=0.0)
    engine = LLMEngine(EngineConfig(model="llama-3-8b", executor="sim"))
    engine.step_callbacks.append(recorder.step_log())
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert len(read_csv(tmp_path / "steps.csv")) == 1  # before close
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                recorder.add_request(RequestRecord.from_output(out))
    assert [r["request_id"] for r in read_csv(tmp_path / "requests.csv")] == ["a"]
    recorder.close()


def test_a_request_of_max_tokens_none_round_trips_through_workload_jsonl_and_replays(tmp_path):
    # output_len None (max_tokens=None): written as null, read back as None, and served up to
    # max_model_len, fast-forwarded over two routed replicas.
    from framework.harness.workload import WorkloadContext, WorkloadRequest
    from framework.harness.workloads.trace import load_trace

    reqs = [WorkloadRequest("a", list(range(3, 10)), None, 0.0), WorkloadRequest("b", list(range(3, 20)), 5, 0.1)]
    recorder = RunRecorder(tmp_path)
    recorder.write_workload(reqs)
    recorder.close()
    back = load_trace(tmp_path / "workload.jsonl", WorkloadContext(vocab_size=1000))
    assert back == reqs
    config = EngineConfig(model="tiny-llama", executor="sim", max_model_len=48, max_num_batched_tokens=64, max_num_seqs=8)
    cluster = Cluster.build(config, num_replicas=2)
    outs = [o for _, o in cluster.run(back).outputs]
    assert {o.request_id: (len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs} == {
        "a": (41, "length"), "b": (5, "length")}
    for engine in cluster.engines:
        assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks


def test_a_claimed_run_dir_is_free_to_its_own_thread_and_refused_to_another_until_released(tmp_path):
    refused = []

    def claim_elsewhere():
        try:
            with claim_run_dir(tmp_path):
                pass
        except ValueError as exc:
            refused.append(str(exc))

    with claim_run_dir(tmp_path):
        with claim_run_dir(tmp_path):  # framework.run's job, then run_experiment in it
            pass
        thread = threading.Thread(target=claim_elsewhere)
        thread.start()
        thread.join()
    assert refused == [f"run directory {tmp_path} is in use by another run; give each concurrent run its own "
                       f"hydra.run.dir"]
    thread = threading.Thread(target=claim_elsewhere)
    thread.start()
    thread.join()
    assert len(refused) == 1


def test_a_run_dir_the_claim_made_goes_again_only_if_left_empty(tmp_path):
    with claim_run_dir(tmp_path / "refused"):  # a run stopped by a configuration error
        assert (tmp_path / "refused").is_dir()
    with claim_run_dir(tmp_path / "ran"):
        (tmp_path / "ran" / "steps.csv").write_text("")
    with claim_run_dir(tmp_path):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran"]


def test_a_claim_that_opened_a_folder_another_claim_then_removed_holds_the_new_folder(tmp_path, monkeypatch):
    """Run A made the folder and, stopped early, removes it empty; B opened it just before. B must hold the folder
    now at the path (not the removed one), so that a third run C is refused while B lives."""
    import framework.harness.recorder as recorder

    path = tmp_path / "run"
    real_lock = recorder._lock
    a_gone, b_holds, b_done = threading.Event(), threading.Event(), threading.Event()
    waited = []

    def lock_after_a_is_gone(fd, where, setting):
        if not waited:  # B's first lock: on the folder A is about to remove
            waited.append(True)
            assert a_gone.wait(10)
        return real_lock(fd, where, setting)

    def run_b():
        with claim_run_dir(path):
            b_holds.set()
            assert b_done.wait(10)

    outcomes = []

    def run_c():
        try:
            with claim_run_dir(path):
                outcomes.append("C claimed it too")
        except ValueError:
            outcomes.append("C refused")

    claim_a = claim_run_dir(path)
    claim_a.__enter__()
    monkeypatch.setattr(recorder, "_lock", lock_after_a_is_gone)
    b = threading.Thread(target=run_b)
    b.start()
    while not waited:  # B has opened A's folder and waits to lock it
        threading.Event().wait(0.01)
    claim_a.__exit__(None, None, None)  # A made it and left it empty: removed
    a_gone.set()
    assert b_holds.wait(10)
    assert path.is_dir()
    c = threading.Thread(target=run_c)
    c.start()
    c.join()
    b_done.set()
    b.join()
    assert outcomes == ["C refused"]
