"""``Workload.check_lengths``: a length no request within ``max_model_len`` can have is refused before anything
is drawn (``workload.prompt_len=100000000`` would build a 23 GB workload first), and the longest prompt a
workload sends is known before it is generated (a prefill-first policy's budget is checked against it)."""
import json

import pytest

from framework.harness import workloads
from framework.harness.workload import Workload, WorkloadContext, create_workload
from framework.harness.workloads.lengths import LengthDist
from framework.harness.workloads.trace import TraceError

CTX = WorkloadContext(vocab_size=1024)


def workload(**options):
    return create_workload({"name": "synthetic", **options})[0]


def never_drawn(monkeypatch):
    """Fails if a length is drawn or a trace entry made a request: a huge bound is refused from what is stated."""
    def refuse(*args, **kwargs):
        raise AssertionError("drew a length or a prompt")
    monkeypatch.setattr(LengthDist, "sample", refuse)
    monkeypatch.setattr(workloads.trace, "parse_entry", refuse)


@pytest.mark.parametrize("options, message", [
    ({"prompt_len": 100_000_000}, r"^workload.prompt_len=100000000 is beyond max_model_len=1024: lower it or raise "
                                  r"engine.max_model_len$"),
    ({"output_len": 1024}, r"^workload.output_len=1024 is beyond 1023, the most output max_model_len=1024 leaves after "
                           r"a 1-token prompt"),
    ({"prompt_len": [1, 100_000_000]}, r"^workload.prompt_len: max=100000000 is beyond max_model_len=1024"),
    ({"prompt_len": {"dist": "zipf", "a": 1.2, "max": 100_000_000}}, r"^workload.prompt_len: max=100000000 is beyond"),
    ({"prompt_len": {"dist": "normal", "mean": 64, "std": 8, "max": 2000}}, r"^workload.prompt_len: max=2000 is "),
    ({"prompt_len": [16, 800], "shared_prefix": {"fraction": 0.5, "num_prefixes": 2, "prefix_len": 256}},
     r"^workload.prompt_len: max=800 is beyond 768, what max_model_len=1024 leaves after the shared prefix of 256"),
    ({"shared_prefix": {"prefix_len": 1024}}, r"^workload.shared_prefix.prefix_len=1024 leaves no room within "
                                              r"max_model_len=1024"),
    ({"priority_classes": [{"priority": 0, "prompt_len": [16, 48]}, {"priority": 1, "output_len": [8, 5000]}]},
     r"^workload.priority_classes\[1\].output_len: max=5000 is beyond 1023"),
    ({"priority_classes": [{"priority": 0}, {"priority": 1}], "prompt_len": [8, 2048]},
     r"^workload.prompt_len: max=2048 is beyond"),  # named as the option that gives it
])
def test_a_bound_beyond_max_model_len_is_refused_before_anything_is_drawn(monkeypatch, options, message):
    w = workload(**options)
    never_drawn(monkeypatch)
    with pytest.raises(ValueError, match=message):
        w.check_lengths(1024)


@pytest.mark.parametrize("options, message", [
    ({"prompt_len": [900, 1000], "output_len": [100, 200]},
     r"^workload.prompt_len and workload.output_len reach 1200 tokens together, beyond max_model_len=1024: the "
     r"longest requests would stop short of their output length; lower them or raise engine.max_model_len$"),
    ({"prompt_len": [16, 600], "output_len": 300, "shared_prefix": {"fraction": 0.5, "prefix_len": 200}},
     r"^workload.prompt_len and workload.output_len reach 900 tokens together after the shared prefix of 200, "),
    ({"priority_classes": [{"priority": 0}, {"priority": 1, "prompt_len": 1000, "output_len": [1, 30]}]},
     r"^workload.priority_classes\[1\].prompt_len and workload.priority_classes\[1\].output_len reach 1030 "),
])
def test_a_prompt_and_output_that_reach_past_max_model_len_together_are_refused(monkeypatch, options, message):
    """Each within the limit, together beyond it: the longest requests would be cut short, and a run would
    count them successful with part of the output tokens asked for."""
    w = workload(**options)
    never_drawn(monkeypatch)
    with pytest.raises(ValueError, match=message):
        w.check_lengths(1024)
    assert workload(**{**options, "output_len": 1}).check_lengths(1024 + 1000) > 0


def test_unbounded_prompt_and_output_lengths_are_checked_together_by_what_they_draw():
    w = workload(num_requests=64, prompt_len={"dist": "normal", "mean": 600, "std": 10},
                 output_len={"dist": "normal", "mean": 600, "std": 10})
    with pytest.raises(ValueError, match=r"^workload.prompt_len and workload.output_len reach 1\d{3} tokens together"):
        w.check_lengths(1024)
    assert w.check_lengths(2048) > 0


def test_a_distribution_without_a_bound_is_checked_by_what_it_draws():
    huge = workload(prompt_len={"dist": "lognormal", "mean": 1e8, "std": 10})
    with pytest.raises(ValueError, match=r"^workload.prompt_len: dist lognormal without a max drew \d{9}, beyond "
                                         r"max_model_len=1024: give it a max or raise engine.max_model_len$"):
        huge.check_lengths(1024)
    long_outputs = workload(output_len={"dist": "normal", "mean": 2000, "std": 10})
    with pytest.raises(ValueError, match=r"^workload.output_len: dist normal without a max drew \d+, beyond 1023"):
        long_outputs.check_lengths(1024)


UNBOUNDED = {"dist": "lognormal", "mean": 200, "std": 90}


@pytest.mark.parametrize("options, longest", [
    ({}, 128),  # a bound: what the config allows, which a prefill-first policy's budget must hold
    ({"prompt_len": {"dist": "normal", "mean": 64, "std": 32, "max": 100},
      "shared_prefix": {"fraction": 0.5, "prefix_len": 30}}, 130),
    ({"prompt_len": UNBOUNDED}, None),  # no bound: the longest drawn
    ({"priority_classes": [{"priority": 0, "prompt_len": [16, 48]}, {"priority": 1, "share": 5,
                                                                     "prompt_len": UNBOUNDED}]}, None),
])
def test_the_longest_prompt_is_known_before_generating(options, longest):
    w = workload(num_requests=64, **options)
    found = w.check_lengths(1024)
    prompts = [r.prompt_len for r in w.generate(CTX)]
    assert found == (max(prompts) if longest is None else longest) and found >= max(prompts)
    assert w.generate(CTX) == workload(num_requests=64, **options).generate(CTX)  # checking took none of its draws


def trace(tmp_path, entries):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return create_workload({"name": "trace", "path": str(path)})[0], path


def test_a_trace_length_beyond_max_model_len_is_refused_naming_its_line(tmp_path, monkeypatch):
    w, path = trace(tmp_path, [{"prompt_len": 8, "output_len": 4}, {"prompt_len": 100_000_000, "output_len": 4}])
    never_drawn(monkeypatch)
    with pytest.raises(TraceError, match=rf"^{path}:2: prompt_len 100000000 is beyond max_model_len=1024: lower it"):
        w.check_lengths(1024)
    w, _ = trace(tmp_path, [{"prompt_len": 1e8, "output_len": 4}])  # JSON's 1e8 is a float
    with pytest.raises(TraceError, match=r":1: prompt_len 100000000.0 is beyond max_model_len=1024"):
        w.check_lengths(1024)
    w, _ = trace(tmp_path, [{"prompt_len": 8, "output_len": 1024}])
    with pytest.raises(TraceError, match=r":1: output_len 1024 is beyond 1023, the most output max_model_len=1024"):
        w.check_lengths(1024)
    w, _ = trace(tmp_path, [{"prompt_len": 8, "output_len": 4}, {"prompt_token_ids": [5] * 1000, "output_len": 30}])
    with pytest.raises(TraceError, match=r":2: a prompt of 1000 tokens and output_len 30 reach 1030, beyond "
                                         r"max_model_len=1024: the request would stop short of its output length"):
        w.check_lengths(1024)


def test_trace_lengths_that_just_fit_max_model_len_are_taken(tmp_path):
    w, _ = trace(tmp_path, [{"prompt_len": 1023, "output_len": 1}, {"prompt_len": 1, "output_len": 1023},
                            {"prompt_token_ids": [5] * 1000, "output_len": 24}])
    assert w.check_lengths(1024) == 1023


def test_a_trace_prompt_given_as_ids_is_sent_as_given_and_the_longest_prompt_is_known(tmp_path):
    long_ids = [7] * 2000  # data, not a length to draw: sent, and the engine refuses it
    w, _ = trace(tmp_path, [{"prompt_len": 300, "output_len": 4}, {"prompt_token_ids": [5] * 40, "output_len": 4},
                            {"prompt_token_ids": long_ids, "output_len": 4}])
    assert w.check_lengths(1024) == 300  # the longest the engine takes
    assert [r.prompt_len for r in w.generate(CTX)] == [300, 40, 2000]
    w, _ = trace(tmp_path, [{"prompt_len": 30, "output_len": 4}, {"prompt": "some words", "output_len": 4}])
    assert w.check_lengths(1024) is None  # text: its length is known once tokenised


def test_a_trace_entry_beyond_max_requests_is_not_sent_and_not_checked(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"arrival_time": 2.0, "prompt_len": 100_000_000, "output_len": 4}) + "\n"
                    + json.dumps({"arrival_time": 1.0, "prompt_len": 12, "output_len": 4}) + "\n")
    w = create_workload({"name": "trace", "path": str(path), "max_requests": 1})[0]
    assert w.check_lengths(1024) == 12
    assert [r.prompt_len for r in w.generate(CTX)] == [12]


def test_a_sharegpt_output_len_that_leaves_no_room_for_a_prompt_is_refused():
    options = {"name": "sharegpt", "path": "conf/workload/samples/sharegpt.json"}
    w = create_workload({**options, "output_len": 1021})[0]
    with pytest.raises(ValueError, match=r"^workload.output_len=1021 leaves no room within max_model_len=1024 for a "
                                         r"prompt of min_len=4 tokens"):
        w.check_lengths(1024)
    assert create_workload({**options, "output_len": 1020})[0].check_lengths(1024) is None  # text: known later


def test_a_workload_that_states_no_lengths_checks_nothing():
    class Given(Workload):  # a plugin's, written before check_lengths
        def generate(self, ctx):
            return []

    assert Given().check_lengths(16) is None
