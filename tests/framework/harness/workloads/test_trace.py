"""Trace replay: round trips, the entry forms, rescaling, and errors that name the line."""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from framework.common.sampling_params import SamplingParams
from framework.harness.workload import WorkloadContext, WorkloadRequest, create_workload, sampling_params
from framework.harness.workloads.synthetic import SyntheticWorkload
from framework.harness.workloads.trace import TraceError, load_trace, save_trace
from framework.harness.workloads.text import tokenize

CTX = WorkloadContext(vocab_size=1024)


def write_jsonl(path, entries):
    path.write_text("\n".join(e if isinstance(e, str) else json.dumps(e) for e in entries) + "\n")
    return path


def test_round_trip(tmp_path):
    reqs = SyntheticWorkload(num_requests=25, rate=5.0, priority_classes=[{"priority": 0}, {"priority": 3}]).generate(CTX)
    save_trace(tmp_path / "t.jsonl", reqs)
    assert load_trace(tmp_path / "t.jsonl", CTX) == reqs


def test_sampling_round_trips_per_request(tmp_path):
    """A run whose requests sampled differently (the workload's keys, some requests' own) saves
    what each was sent with; a replay under trace.yaml's config (greedy, ignore_eos) sends the same."""
    reqs = [WorkloadRequest("plain", [5, 6], 3),
            WorkloadRequest("warm", [5, 7], 3, 0.1, sampling={"temperature": 0.8, "top_p": 0.9}),
            WorkloadRequest("topk", [5, 8], 3, 0.2, sampling={"top_k": 5, "ignore_eos": False}),
            WorkloadRequest("greedy", [5, 9], 3, 0.3, sampling={"temperature": 0.0, "top_k": -1}),
            WorkloadRequest("default", [5, 10], 3, 0.4, sampling={"temperature": 0.0})]
    run_sampling = {"temperature": 0.5, "top_k": 40}  # the recorded run's workload keys
    sent = {r.request_id: sampling_params(r, run_sampling) for r in reqs}
    assert sent["warm"] == SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=40, ignore_eos=True)
    save_trace(tmp_path / "w.jsonl", reqs, run_sampling)
    lines = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    # Only what differs from the defaults (temperature 0, top_p 1, top_k off, ignore_eos), per line.
    assert [{k: e[k] for k in ("temperature", "top_p", "top_k", "ignore_eos") if k in e} for e in lines] == [
        {"temperature": 0.5, "top_k": 40}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40},
        {"temperature": 0.5, "top_k": 5, "ignore_eos": False}, {}, {"top_k": 40}]  # "greedy" turned top_k off
    workload, replay_sampling = create_workload({"name": "trace", "path": str(tmp_path / "w.jsonl"),
                                                 "temperature": 0.0, "ignore_eos": True})
    replayed = workload.generate(CTX)
    assert {r.request_id: sampling_params(r, replay_sampling) for r in replayed} == sent
    # Saving the replay again writes the same file.
    save_trace(tmp_path / "again.jsonl", replayed, replay_sampling)
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "w.jsonl").read_bytes()


def test_default_sampling_adds_nothing_and_files_without_sampling_still_load(tmp_path):
    # A run of default sampling writes lines as before the keys were saved, byte for byte.
    reqs = [WorkloadRequest("a", [5, 6], 3, 0.0, 1), WorkloadRequest("b", [7], 2, 0.5)]
    save_trace(tmp_path / "t.jsonl", reqs, {"temperature": 0.0, "ignore_eos": True, "top_p": 1.0, "top_k": -1})
    old = ('{"request_id":"a","arrival_time":0.0,"priority":1,"output_len":3,"prompt_token_ids":[5,6]}\n'
           '{"request_id":"b","arrival_time":0.5,"priority":0,"output_len":2,"prompt_token_ids":[7]}\n')
    assert (tmp_path / "t.jsonl").read_text() == old
    (tmp_path / "old.jsonl").write_text(old)  # as every earlier run saved its workload
    back = load_trace(tmp_path / "old.jsonl", CTX)
    assert back == reqs and all(r.sampling is None for r in back)
    assert sampling_params(back[0], {"temperature": 0.3}) == SamplingParams(max_tokens=3, temperature=0.3,
                                                                             ignore_eos=True)


def test_numpy_numbers_a_custom_workload_hands_over_are_saved_as_plain_numbers(tmp_path):
    reqs = [WorkloadRequest("a", list(np.arange(5, 9)), np.int64(3), np.float64(0.5), np.int32(1))]
    save_trace(tmp_path / "t.jsonl", reqs)
    assert load_trace(tmp_path / "t.jsonl", CTX) == [WorkloadRequest("a", [5, 6, 7, 8], 3, 0.5, 1)]


@pytest.mark.parametrize("ids", [np.arange(5, 13, dtype=np.int32)[::2], np.arange(5, 9, dtype=np.uint16)])
def test_prompts_as_numpy_arrays_strided_or_unsigned_round_trip(tmp_path, ids):
    save_trace(tmp_path / "t.jsonl", [WorkloadRequest("a", ids, 3)])
    (back,) = load_trace(tmp_path / "t.jsonl", CTX)
    assert back.prompt_token_ids == ids.tolist() and all(type(t) is int for t in back.prompt_token_ids)


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85"])
def test_jsonl_text_may_hold_unicode_line_separators(tmp_path, sep):
    # JSON strings may hold these unescaped, and orjson writes them so; a JSONL line ends at "\n".
    text = f"first line{sep}second line"
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": text, "output_len": 2}, ensure_ascii=False) + "\n"
                    + json.dumps({"prompt_len": 3, "output_len": 1}) + "\r\n")
    first, second = load_trace(path, CTX)
    assert first.prompt == text and second.prompt_len == 3


@pytest.mark.parametrize("name", ["trace", "sharegpt"])
def test_files_are_read_as_utf8_whatever_the_locale(tmp_path, name):
    text = "Résumé: naïve café, 東京 ünd ßo weiter"
    if name == "trace":
        path = tmp_path / "t.jsonl"
        body = json.dumps({"prompt": text, "output_len": 2}, ensure_ascii=False)
    else:
        path = tmp_path / "s.json"
        body = json.dumps([{"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": text}]}],
                          ensure_ascii=False)
    path.write_bytes(body.encode())
    options = {"name": name, "path": str(path), **({"num_requests": 1} if name == "sharegpt" else {})}
    expected = tokenize(text, CTX)
    # Under LC_ALL=C (no UTF-8 mode) Python's default text encoding is ASCII.
    code = ("import json, sys; from framework.harness.workload import WorkloadContext, create_workload; "
            "print(json.dumps(create_workload(json.loads(sys.argv[1]))[0].generate(WorkloadContext(1024))[0].prompt_token_ids))")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(options)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == expected
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())  # a byte-order mark, as some Windows editors write
    assert create_workload(options)[0].generate(CTX)[0].prompt_token_ids == expected


def test_entry_forms_and_sorting(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        "# comment lines and blank lines are skipped", "",
        {"arrival_time": 2.0, "prompt_token_ids": [5, 6, 7], "output_len": 4, "priority": 1},
        {"arrival_time": 0.5, "prompt": "hello there, world", "output_len": 2},
        {"prompt_len": 9, "output_len": 3, "request_id": "z"},
    ])
    reqs = load_trace(path, CTX, seed=1)
    assert [r.request_id for r in reqs] == ["z", "1", "0"]  # sorted by arrival; ids default to position
    z, text, ids = reqs
    assert z.arrival_time == 0.0 and z.prompt_len == 9 and all(3 <= t < 1024 for t in z.prompt_token_ids)
    assert text.prompt == "hello there, world" and text.prompt_token_ids == tokenize("hello there, world", CTX)
    assert len(text.prompt_token_ids) == 4  # one id per word or mark without a tokenizer
    assert ids == WorkloadRequest("0", [5, 6, 7], 4, 2.0, 1)
    assert load_trace(path, CTX, seed=1)[0] == z and load_trace(path, CTX, seed=2)[0] != z


def test_requests_arriving_together_keep_the_files_order(tmp_path):
    # What a run without a rate saves (every arrival at 0): replayed in another order, fcfs would serve another run.
    path = write_jsonl(tmp_path / "t.jsonl", [{"request_id": str(i), "arrival_time": 0.0, "prompt_len": 4,
                                              "output_len": 2} for i in range(12)])
    assert [r.request_id for r in load_trace(path, CTX)] == [str(i) for i in range(12)]


def test_a_prompt_given_by_its_length_takes_no_special_token_id(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt_len": 5000, "output_len": 2}])
    (request,) = load_trace(path, CTX)
    assert min(request.prompt_token_ids) == CTX.first_token_id and max(request.prompt_token_ids) < CTX.vocab_size


def test_text_without_a_tokenizer_takes_ids_of_the_vocabulary_past_the_special_ones():
    ids = tokenize(" ".join(f"w{i}" for i in range(3000)), CTX)
    assert len(ids) == 3000 and min(ids) >= CTX.first_token_id and max(ids) < CTX.vocab_size
    assert len(set(ids)) > 900  # spread over the vocabulary


def test_json_array_form_and_rescaling(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"requests": [{"arrival_time": t, "prompt_len": 4, "output_len": 2} for t in (1, 2, 4)]}))
    workload, _ = create_workload({"name": "trace", "path": str(path), "rate": 1.5})
    reqs = workload.generate(CTX)
    assert [r.arrival_time for r in reqs] == pytest.approx([0.5, 1.0, 2.0])  # 3 requests / 2 s
    workload, _ = create_workload({"name": "trace", "path": str(path), "max_requests": 2})
    assert [r.arrival_time for r in workload.generate(CTX)] == [1, 2]


@pytest.mark.parametrize("bad, match", [
    ('{"prompt_len": 4, "output_len": 2', "not valid JSON"),
    ({"prompt_len": 4}, "output_len must be an integer >= 1"),
    ({"prompt_len": 4, "output_len": 0}, "output_len must be an integer >= 1"),
    ({"prompt_len": 4, "prompt": "hi", "output_len": 2}, "exactly one of"),
    ({"output_len": 2}, "exactly one of"),
    ({"prompt_len": 4, "output_len": 2, "arrival_time": -1}, "arrival_time must be a number >= 0"),
    ('{"prompt_len": 4, "output_len": 2, "arrival_time": NaN}', "arrival_time must be a number >= 0"),
    ({"prompt_len": 4, "output_len": 2, "arrival_time": True}, "arrival_time must be a number >= 0"),
    ({"prompt_token_ids": [1, 5000], "output_len": 2}, r"ids in \[0, 1024\)"),
    ({"prompt_len": 4, "output_len": 2, "colour": "red"}, "unknown key"),
    ({"prompt_len": 4, "output_len": 2, "priority": "high"}, "priority must be an integer"),
    ('[1, 2]', "expected a JSON object"),
    ({"prompt_len": 4, "output_len": 2, "request_id": None}, "request_id must be a non-empty string or an integer"),
    ({"prompt_len": 4, "output_len": 2, "request_id": True}, "request_id must be a non-empty string or an integer"),
    ({"prompt_len": 4, "output_len": 2, "request_id": ["a"]}, "request_id must be a non-empty string or an integer"),
    ({"prompt_len": 4, "output_len": 2, "request_id": ""}, "request_id must be a non-empty string or an integer"),
    ({"prompt_len": 4, "output_len": 2, "temperature": -1}, r"temperature must be a finite number >= 0, got -1$"),
    ({"prompt_len": 4, "output_len": 2, "top_p": 0}, r"top_p must be in \(0, 1\], got 0$"),
    ({"prompt_len": 4, "output_len": 2, "top_k": 2.5}, "top_k must be -1, 0 \\(disabled\\) or a positive integer"),
    ({"prompt_len": 4, "output_len": 2, "ignore_eos": "yes"}, "ignore_eos must be True or False, got 'yes'"),
])
def test_malformed_line_is_named(tmp_path, bad, match):
    good = {"prompt_len": 4, "output_len": 2}
    path = write_jsonl(tmp_path / "t.jsonl", [good, "# a comment", good, bad, good])
    with pytest.raises(TraceError, match=rf"t\.jsonl:4: .*{match}"):
        load_trace(path, CTX)


def test_malformed_json_array_entry_is_named(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"prompt_len": 4, "output_len": 2}, {"prompt_len": 4}]))
    with pytest.raises(TraceError, match="entry 1: output_len"):
        load_trace(path, CTX)
    path.write_text('[{"prompt_len": 4, "output_len": 2},\n {"prompt_len": 4,, }]')
    with pytest.raises(TraceError, match=r"t\.json:2: not valid JSON"):
        load_trace(path, CTX)


def test_file_level_errors(tmp_path):
    with pytest.raises(ValueError, match="missing.jsonl.* does not exist"):
        load_trace(tmp_path / "missing.jsonl", CTX)
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write_jsonl(tmp_path / "empty.jsonl", ["# nothing"]), CTX)
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"prompt_len": 2, "output_len": 1, "request_id": "a"}] * 2)
    with pytest.raises(TraceError, match="'a' appears more than once"):
        load_trace(dup, CTX)
    # The first id in file order that has a twin anywhere, not the first one repeated.
    ids = ["x", "a", "b", "b", "a"]
    dups = write_jsonl(tmp_path / "dups.jsonl", [{"prompt_len": 2, "output_len": 1, "request_id": i} for i in ids])
    with pytest.raises(TraceError, match="'a' appears more than once"):
        load_trace(dups, CTX)
    flat = write_jsonl(tmp_path / "flat.jsonl", [{"prompt_len": 2, "output_len": 1}])
    with pytest.raises(ValueError, match="no rate to rescale"):
        create_workload({"name": "trace", "path": str(flat), "rate": 2.0})[0].generate(CTX)


@pytest.mark.parametrize("name", ["trace", "sharegpt"])
def test_a_directory_or_a_compressed_file_is_a_one_line_error_naming_it(tmp_path, name):
    folder = tmp_path / "t.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"{re.escape(repr(str(folder)))} is a directory$"):
        create_workload({"name": name, "path": str(folder)})
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(json.dumps({"prompt_len": 4, "output_len": 2}).encode()))
    workload, _ = create_workload({"name": name, "path": str(gz)})
    with pytest.raises(ValueError, match=rf"^{re.escape(str(gz))}: not UTF-8 text .*decompressed first$"):
        workload.generate(CTX)


def test_the_shipped_sample_trace_loads():
    reqs = create_workload({"name": "trace", "path": "conf/workload/samples/trace.jsonl"})[0].generate(CTX)
    assert len(reqs) == 24 and {r.priority for r in reqs} == {0, 1}


@pytest.mark.parametrize("name", ["trace", "sharegpt"])
def test_a_missing_file_fails_when_the_workload_is_configured(tmp_path, monkeypatch, name):
    from framework.harness.workloads.trace import PROJECT_ROOT

    root, here = re.escape(str(PROJECT_ROOT)), re.escape(str(tmp_path))
    monkeypatch.chdir(PROJECT_ROOT)  # the two places looked in are one: named once
    with pytest.raises(ValueError, match=rf"'no/such/file.jsonl' not found \(looked in {root}\)$"):
        create_workload({"name": name, "path": "no/such/file.jsonl"})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"looked in {here} and {root}\)$"):
        create_workload({"name": name, "path": "no/such/file.jsonl"})
