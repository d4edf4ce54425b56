"""experiments/vllm_fidelity.py: usage errors come before any case runs, this side's traces are whole
schedules, and the comparison finds the first step and kind at which two traces differ."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "vllm_fidelity", Path(__file__).resolve().parents[2] / "experiments" / "vllm_fidelity.py")
vllm_fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_fidelity)


@pytest.mark.parametrize("argv, match", [
    (["--cases", "0"], "--cases must be at least 1, got 0"),
    (["--policy-option", "reserve_full_prompt"], "--policy-option takes KEY=VALUE, got 'reserve_full_prompt'"),
    (["--policy-option", "reserve_full_prompt=maybe"], "reserve_full_prompt must be true or false, got 'maybe'"),
    (["--policy-option", "colour=red"], "'colour'"),
    (["--allocator-option", "promote_duplicate=middle"], "promote_duplicate must be one of 'oldest', 'newest'"),
    (["--vllm-python", "/nonexistent/python"], "no vLLM venv at /nonexistent/python: run with --setup first"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys, monkeypatch):
    monkeypatch.setattr(vllm_fidelity, "run", lambda *a: pytest.fail("ran despite a bad argument"))
    with pytest.raises(SystemExit) as exit_info:
        vllm_fidelity.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.parametrize("options", [{}, vllm_fidelity.EARLIER_OPTIONS])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_this_sides_trace_serves_every_request_of_a_case_within_its_limits(options, async_scheduling):
    for seed in range(12):
        case = vllm_fidelity.make_case(seed)
        trace = vllm_fidelity.servelab_trace(case, options, {}, async_scheduling)
        assert len(trace) < vllm_fidelity.MAX_STEPS
        computed: dict[str, int] = {}
        for step in trace:
            assert sum(n for _, n in step["schedule"]) <= case["max_num_batched_tokens"]
            assert len(step["schedule"]) <= case["max_num_seqs"]
            for rid in step["preemption"]:
                computed[rid] = 0  # recomputed from its prefix hit on readmission
            for rid, hit in step["prefix hit"].items():
                computed[rid] = hit
            for rid, n in step["schedule"]:
                computed[rid] = computed.get(rid, 0) + n
        # Each request computed its prompt and all its sampled tokens but the last.
        assert computed == {r["id"]: len(r["prompt"]) + r["max_tokens"] - 1 for r in case["requests"]}


def test_the_first_divergence_names_its_step_and_kinds():
    case = vllm_fidelity.make_case(3)
    ours = vllm_fidelity.servelab_trace(case, {}, {})
    assert vllm_fidelity.first_divergence(ours, [dict(s) for s in ours]) is None
    theirs = [dict(s) for s in ours]
    theirs[2] = {**theirs[2], "preemption": ["x"], "schedule": []}
    assert vllm_fidelity.first_divergence(ours, theirs) == (2, ["schedule", "preemption"])
    assert vllm_fidelity.first_divergence(ours, ours[:-1]) == (len(ours) - 1, ["steps"])
    tally = vllm_fidelity.Tally()
    tally.add(case, ours, ours)
    tally.add(case, ours, theirs)
    assert (tally.cases, tally.identical, tally.steps_identical) == (2, 1, len(ours) + 2)
    assert tally.diverged == {"schedule": 1, "preemption": 1}
    assert tally.first["preemption"].startswith("seed 3, step 2 ")


def test_full_prompt_admission_preempts_less_on_tight_caches():
    # vLLM 0.32's default against the behaviour before it, on this side alone: the issue's 2.5-12.6x.
    tight = [c for c in map(vllm_fidelity.make_case, range(60)) if c["tight"]]
    preemptions = [sum(vllm_fidelity.side_totals(vllm_fidelity.servelab_trace(c, options, {}))[0] for c in tight)
                   for options in ({}, {"reserve_full_prompt": False})]
    assert preemptions[0] < preemptions[1]



def test_the_prefix_counts_leave_out_requests_that_read_no_cache():
    """The cases hold salted requests and requests asking for prompt logprobs; the counts each step records are
    the hit rate's terms, which count no lookup for a request that reads no cache (as vLLM's)."""
    cases = [vllm_fidelity.make_case(seed) for seed in range(40)]
    requests = [r for c in cases for r in c["requests"]]
    assert any(r["salt"] for r in requests) and any(r["prompt_logprobs"] for r in requests)
    case = next(c for c in cases if c["prefix_caching"] and any(r["prompt_logprobs"] for r in c["requests"]))
    trace = vllm_fidelity.servelab_trace(case, {}, {})
    reading = [r for r in case["requests"] if r["prompt_logprobs"] is None]
    # A first admission looks up the prompt (a re-admission after a preemption counts apart).
    assert trace[-1]["prefix counts"][0] == sum(len(r["prompt"]) for r in reading)
    admissions = [(rid, hit) for step in trace for rid, hit in step["prefix hit"].items()]
    assert all(hit == 0 for rid, hit in admissions if rid not in {r["id"] for r in reading})
