"""Synthetic workloads: determinism, shared prefixes and priority classes."""
import numpy as np
import pytest

from framework.harness.workload import WorkloadContext, create_workload, sampling_params

CTX = WorkloadContext(vocab_size=1024)


def generate(**options):
    workload, _ = create_workload({"name": "synthetic", **options})
    return workload.generate(CTX)


def test_same_seed_same_requests_other_seed_others():
    opts = dict(num_requests=20, rate=4.0, burstiness=0.5, prompt_len={"dist": "lognormal", "mean": 40, "std": 20},
                output_len=[4, 16], shared_prefix={"fraction": 0.5, "num_prefixes": 2, "prefix_len": 8},
                priority_classes=[{"priority": 0, "share": 1}, {"priority": 1, "share": 2}])
    assert generate(**opts, seed=1) == generate(**opts, seed=1)
    assert generate(**opts, seed=1) != generate(**opts, seed=2)


def test_requests_are_well_formed():
    reqs = generate(num_requests=50, rate=10.0, prompt_len=[1, 30], output_len=[1, 5])
    assert len({r.request_id for r in reqs}) == 50
    assert all(r.prompt_token_ids.dtype == np.int32 and r.prompt_token_ids.ndim == 1 for r in reqs)
    with pytest.raises(ValueError, match="read-only"):  # prompts share one draw: no edits in place
        reqs[0].prompt_token_ids[0] = 7
    assert all(1 <= r.prompt_len <= 30 and 1 <= r.output_len <= 5 for r in reqs)
    assert all(3 <= t < 1024 for r in reqs for t in r.prompt_token_ids)
    times = [r.arrival_time for r in reqs]
    assert times == sorted(times) and times[0] > 0


def test_changing_the_rate_changes_only_the_times():
    slow, fast = generate(num_requests=30, rate=2.0), generate(num_requests=30, rate=6.0)
    assert [r.prompt_token_ids.tolist() for r in slow] == [r.prompt_token_ids.tolist() for r in fast]
    assert [r.output_len for r in slow] == [r.output_len for r in fast]
    assert np.allclose([r.arrival_time for r in slow], [3 * r.arrival_time for r in fast])
    assert all(r.arrival_time == 0 for r in generate(num_requests=5, rate=None))


def test_a_rate_sweep_including_null_changes_only_the_times_of_priority_classes():
    # All at once used to mix the classes by a draw of its own: other priorities, prompts and
    # lengths per request than at any rate.
    classes = [{"priority": 0, "share": 1, "prompt_len": [4, 8]}, {"priority": 1, "share": 5, "prompt_len": [40, 80]}]
    runs = [generate(num_requests=200, rate=rate, priority_classes=classes) for rate in (None, 6.0, 12.0)]
    for other in runs[1:]:
        assert [(r.priority, r.prompt_token_ids.tolist(), r.output_len) for r in runs[0]] == \
               [(r.priority, r.prompt_token_ids.tolist(), r.output_len) for r in other]
    assert all(r.arrival_time == 0 for r in runs[0])


def test_an_infinite_rate_is_all_at_once_as_null_is_priority_classes_included():
    # vllm bench serve's --request-rate inf; an infinite rate used to give every request to the
    # first class (its stream's zeros sorted first).
    classes = [{"priority": 0, "share": 1}, {"priority": 1, "share": 5}]
    null, inf = (generate(num_requests=60, rate=rate, priority_classes=classes) for rate in (None, float("inf")))
    assert inf == null and {r.priority for r in inf} == {0, 1}


def test_no_prompt_takes_a_special_token_id_shared_prefixes_included():
    reqs = generate(num_requests=200, prompt_len=4, shared_prefix={"fraction": 1.0, "num_prefixes": 50, "prefix_len": 64})
    ids = np.concatenate([r.prompt_token_ids for r in reqs])
    assert ids.min() == CTX.first_token_id and ids.max() == CTX.vocab_size - 1


def test_random_prompts_draw_every_id_from_the_first_regular_one_to_the_last():
    ctx = WorkloadContext(vocab_size=8)
    reqs = create_workload({"name": "synthetic", "num_requests": 50, "prompt_len": 20})[0].generate(ctx)
    assert set(np.concatenate([r.prompt_token_ids for r in reqs]).tolist()) == set(range(ctx.first_token_id, 8))


def test_shared_prefix_fraction_and_length():
    n, prefix_len = 40, 32
    reqs = generate(num_requests=n, prompt_len=[5, 10], seed=3,
                    shared_prefix={"fraction": 0.75, "num_prefixes": 3, "prefix_len": prefix_len})
    heads = [tuple(r.prompt_token_ids[:prefix_len]) for r in reqs]
    counts = {h: heads.count(h) for h in set(heads)}
    shared = {h for h, c in counts.items() if c > 1}
    assert len(shared) <= 3
    assert sum(counts[h] for h in shared) == 30  # exactly round(0.75 * 40) requests share a prefix
    for r, h in zip(reqs, heads):
        own = r.prompt_len - (prefix_len if h in shared else 0)
        assert 5 <= own <= 10  # the prefix comes on top of the request's own prompt_len


def test_a_shared_prefix_fraction_of_zero_gives_no_request_a_prefix():
    reqs = generate(num_requests=20, prompt_len=5, shared_prefix={"fraction": 0.0, "num_prefixes": 2, "prefix_len": 8})
    assert {r.prompt_len for r in reqs} == {5}


def test_priority_classes_have_their_own_rates():
    n = 6000
    reqs = generate(num_requests=n, rate=8.0, prompt_len=4, output_len=2,
                    priority_classes=[{"priority": 0, "share": 1, "output_len": 7}, {"priority": 2, "share": 3}])
    horizon = reqs[-1].arrival_time
    by_class = {p: [r for r in reqs if r.priority == p] for p in (0, 2)}
    # Superposed Poisson streams at 2 and 6 requests/s over the same horizon.
    assert len(by_class[0]) / horizon == pytest.approx(2.0, rel=0.06)
    assert len(by_class[2]) / horizon == pytest.approx(6.0, rel=0.04)
    assert {r.output_len for r in by_class[0]} == {7} and {r.output_len for r in by_class[2]} == {2}
    gaps = np.diff([r.arrival_time for r in by_class[0]])
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # each class is itself Poisson


def test_explicit_class_rates_and_all_at_once_mix():
    reqs = generate(num_requests=3000, rate=None, prompt_len=4, output_len=2,
                    priority_classes=[{"priority": 0, "rate": 1.0}, {"priority": 1, "rate": 4.0}])
    share0 = sum(r.priority == 0 for r in reqs) / len(reqs)
    assert share0 == pytest.approx(0.2, abs=0.03)
    mixed = generate(num_requests=3000, rate=None, prompt_len=4, output_len=2,
                     priority_classes=[{"priority": 0, "share": 1}, {"priority": 1, "share": 1}])
    assert all(r.arrival_time == 0 for r in mixed)
    assert sum(r.priority == 0 for r in mixed) / 3000 == pytest.approx(0.5, abs=0.04)


@pytest.mark.parametrize("options, match", [
    ({"num_requests": 0}, "num_requests"),
    ({"rate": -1}, "rate"),
    ({"rate": 0}, "rate must be a positive number"),
    ({"burstiness": 0}, "burstiness"),
    ({"shared_prefix": {"fraction": 2, "num_prefixes": 1, "prefix_len": 4}}, "fraction"),
    ({"shared_prefix": {"fraction": 0.5, "prefix_len": 4, "length": 3}}, "unknown key"),
    # These used to be a TypeError, a ValueError naming no option, or silently truncated.
    ({"shared_prefix": {"num_prefixes": None, "prefix_len": 4}}, r"shared_prefix\.num_prefixes must be an integer"),
    ({"shared_prefix": {"fraction": "x", "prefix_len": 4}}, r"shared_prefix\.fraction must be a number"),
    ({"shared_prefix": {"num_prefixes": 1.5, "prefix_len": 4}}, r"shared_prefix\.num_prefixes must be an integer"),
    ({"shared_prefix": {"prefix_len": True}}, r"shared_prefix\.prefix_len must be an integer"),
    ({"shared_prefix": {"fraction": 0.5}}, r"shared_prefix\.prefix_len must be an integer >= 1"),
    ({"shared_prefix": True}, r"shared_prefix must be a mapping \{fraction, num_prefixes, prefix_len\} or null, got True"),
    ({"shared_prefix": 0.9}, r"shared_prefix must be a mapping .* got 0\.9"),
    ({"shared_prefix": "abc"}, r"shared_prefix must be a mapping .* got 'abc'"),
    ({"priority_classes": [{"share": 1}]}, r"priority_classes\[0\]: needs a 'priority'"),
    ({"priority_classes": [{"priority": 0, "rate": 1.0}, {"priority": 1}]}, "every class a rate, or none"),
    ({"rate": 4.0, "priority_classes": [{"priority": 0, "rate": 1.0}]}, "set the workload's rate to null"),
    ({"colour": "red"}, "workload 'synthetic'.*colour"),
    ({"priority_classes": "abc"}, "priority_classes must be a list of"),
    ({"priority_classes": [5]}, r"priority_classes\[0\] must be a mapping"),
    ({"priority_classes": [{"priority": "high"}]}, r"priority_classes\[0\]\.priority must be an integer"),
    ({"priority_classes": [{"priority": 1.5}]}, r"priority_classes\[0\]\.priority must be an integer"),
    ({"priority_classes": [{"priority": 0, "share": "abc"}]}, r"priority_classes\[0\]\.share must be a finite"),
    ({"priority_classes": [{"priority": 0, "share": float("inf")}]}, r"\[0\]\.share must be a finite"),
])
def test_bad_options_name_the_problem(options, match):
    with pytest.raises(ValueError, match=match):
        generate(**options)


def test_unknown_workload_lists_the_registered_ones():
    with pytest.raises(ValueError, match="registered workloads: .*sharegpt.*synthetic.*trace"):
        create_workload({"name": "nope"})


def test_sampling_keys_are_split_off():
    workload, sampling = create_workload({"name": "synthetic", "num_requests": 2, "temperature": 0.7, "ignore_eos": False})
    params = sampling_params(workload.generate(CTX)[0], sampling)
    assert params.temperature == 0.7 and not params.ignore_eos
    assert params.max_tokens == workload.generate(CTX)[0].output_len


def test_penalties_and_min_p_are_sampling_keys():
    options = {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1}
    workload, sampling = create_workload({"name": "synthetic", "num_requests": 2, **options})
    params = sampling_params(workload.generate(CTX)[0], sampling)
    assert {k: getattr(params, k) for k in options} == options
    with pytest.raises(ValueError, match=r"^workload.repetition_penalty must be a finite number > 0, got 0$"):
        create_workload({"name": "synthetic", "repetition_penalty": 0})


@pytest.mark.parametrize("options", [
    {"name": "synthetic"}, {"name": "trace", "path": "conf/workload/samples/trace.jsonl"},
    {"name": "sharegpt", "path": "conf/workload/samples/sharegpt.json"}])
@pytest.mark.parametrize("seed", ["abc", -1, 1.5, True])
def test_a_bad_seed_is_a_configuration_error(options, seed):
    # It used to fail at generation, as numpy's TypeError ("SeedSequence expects int ...") or a
    # ValueError naming no option, after the engine was built.
    with pytest.raises(ValueError, match=rf"workload.seed must be an integer in \[0, 2\*\*63\), got {seed!r}"):
        create_workload({**options, "seed": seed})


@pytest.mark.parametrize("name, options", [
    ("synthetic", {}), ("trace", {"path": "conf/workload/samples/trace.jsonl"}),
    ("sharegpt", {"path": "conf/workload/samples/sharegpt.json"})])
def test_a_misspelt_sampling_key_is_answered_with_the_sampling_keys(name, options):
    # The sampling keys are split off before the workload is built: its list of options alone
    # would leave out the very key a user misspelt (+workload.repetiton_penalty=1.1).
    with pytest.raises(ValueError) as info:
        create_workload({"name": name, **options, "repetiton_penalty": 1.1})
    message = str(info.value)
    assert "repetiton_penalty" in message and "\n" not in message
    for key in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "ignore_eos"):
        assert key in message
