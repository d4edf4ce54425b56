"""Broken checkpoints are one-line ValueErrors naming the file and what is wrong (exit 2 from the command
line), as every other bad input; they were tracebacks (SafetensorError, KeyError, UnpicklingError, ...).
A tensor named twice is refused, an index entry outside the folder too; NaN and inf weights are warned of."""
import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework import LLM
from models import iter_checkpoint, resolve_model
from models.loader import MAX_NON_FINITE_WARNINGS
from framework.testing.parity import make_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved whole (``single``) and in shards with an index (``sharded``)."""
    base = tmp_path_factory.mktemp("saved")
    hf = make_hf_checkpoint(base / "single", "llama", seed=8)
    hf.save_pretrained(base / "sharded", max_shard_size="100KB")
    return base


def copy(saved: Path, kind: str, dest: Path) -> Path:
    shutil.copytree(saved / kind, dest)
    return dest


def as_bin(path: Path, state: object, name: str = "pytorch_model.bin") -> Path:
    """``path`` with its safetensors replaced by ``state`` torch.save'd as ``name``."""
    for file in path.glob("*.safetensors*"):
        file.unlink()
    torch.save(state, path / name)
    return path / name


def index_of(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def write_index(path: Path, index: object) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def refused(path: Path, message: str) -> str:
    """The one-line error LLM(model=path) raises, which must match ``message``."""
    with pytest.raises(ValueError, match=message) as info:
        LLM(model=str(path), max_model_len=64)
    assert "\n" not in str(info.value)
    return str(info.value)


def truncate(file: Path, keep: int | None = None) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:keep if keep is not None else len(data) - 100])


SAFETENSORS_DAMAGE = {
    "truncated": (lambda f: truncate(f), "model.safetensors is not a valid safetensors file .*not fully covered"),
    "truncated in its header": (lambda f: truncate(f, 40), "model.safetensors is not a valid safetensors file"),
    "empty": (lambda f: f.write_bytes(b""), "model.safetensors is empty"),
    "garbage": (lambda f: f.write_bytes(bytes(range(256)) * 20), "model.safetensors is not a valid safetensors file"),
}


@pytest.mark.parametrize("damage", SAFETENSORS_DAMAGE)
def test_a_broken_safetensors_file_is_named(saved, tmp_path, damage):
    corrupt, message = SAFETENSORS_DAMAGE[damage]
    path = copy(saved, "single", tmp_path / "ckpt")
    corrupt(path / "model.safetensors")
    assert str(path / "model.safetensors") in refused(path, message)


def test_a_broken_shard_is_found_before_any_tensor_is_read(saved, tmp_path):
    """Every shard's header is checked when iter_checkpoint is called, so a broken last shard costs no reading
    of the ones before it (iter_checkpoint was a generator that met it after loading the others)."""
    path = copy(saved, "sharded", tmp_path / "ckpt")
    last = sorted(path.glob("model-*.safetensors"))[-1]
    truncate(last)
    with pytest.raises(ValueError, match=f"{last.name} is not a valid safetensors file"):
        iter_checkpoint(path)


INDEX_DAMAGE = {
    "without weight_map": (lambda i: {"metadata": i["metadata"]}, "index.json lacks weight_map"),
    "weight_map a list": (lambda i: {**i, "weight_map": list(i["weight_map"])}, "weight_map is a list; it must map"),
    "weight_map empty": (lambda i: {**i, "weight_map": {}}, "weight_map is empty"),
    "a file that is a number": (lambda i: {"weight_map": {**i["weight_map"], "lm_head.weight": 3}},
                                "weight_map maps 'lm_head.weight' to 3, not a file name"),
    "an empty file name": (lambda i: {"weight_map": {**i["weight_map"], "lm_head.weight": ""}},
                           "weight_map maps 'lm_head.weight' to '', not a file name"),
    "not an object": (lambda i: [i], "index.json lacks weight_map"),
    "a number": (lambda i: 3, "index.json lacks weight_map"),
}


@pytest.mark.parametrize("damage", INDEX_DAMAGE)
def test_a_bad_index_is_named(saved, tmp_path, damage):
    change, message = INDEX_DAMAGE[damage]
    path = copy(saved, "sharded", tmp_path / "ckpt")
    write_index(path, change(index_of(path)))
    assert str(path / "model.safetensors.index.json") in refused(path, message)


def test_an_index_that_is_not_json_is_named(saved, tmp_path):
    # Was a JSONDecodeError that named no file.
    path = copy(saved, "sharded", tmp_path / "ckpt")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {')
    refused(path, f"{path / 'model.safetensors.index.json'} is not valid JSON")


def move_a_shard_out(path: Path, outside: Path) -> tuple[str, Path]:
    """Move the last shard of ``path`` into ``outside``: (its name, where it is now)."""
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    outside.mkdir(exist_ok=True)
    return shard.name, Path(shutil.move(shard, outside / shard.name))


@pytest.mark.parametrize("entry", ["relative", "absolute"])
def test_an_index_entry_outside_the_folder_is_refused(saved, tmp_path, entry):
    """A weight_map entry such as ../x.safetensors was followed, loading weights from outside the checkpoint."""
    path = copy(saved, "sharded", tmp_path / "ckpt")
    name, moved = move_a_shard_out(path, tmp_path / "elsewhere")
    index = index_of(path)
    pointer = f"../elsewhere/{name}" if entry == "relative" else str(moved)
    index["weight_map"] = {k: pointer if v == name else v for k, v in index["weight_map"].items()}
    write_index(path, index)
    refused(path, f"weight_map entry '{pointer}' .* lies outside the checkpoint folder {path}$")


def test_an_index_entry_that_is_a_symlink_out_of_the_folder_is_refused(saved, tmp_path):
    path = copy(saved, "sharded", tmp_path / "ckpt")
    name, moved = move_a_shard_out(path, tmp_path / "elsewhere")
    (path / name).symlink_to(moved)
    refused(path, f"weight_map entry '{name}' .* outside the checkpoint folder .*through a symlink, to {moved}")


def test_a_hugging_face_cache_snapshot_loads(saved, tmp_path):
    """The hub cache keeps a snapshot's files as links into the repository's blobs/: not outside it."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in (saved / "sharded").iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    LLM(model=str(snapshot), max_model_len=64)


def test_a_cache_snapshots_link_out_of_the_hub_cache_blobs_is_refused(saved, tmp_path):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abc"
    path = copy(saved, "sharded", snapshot)
    name, moved = move_a_shard_out(path, tmp_path / "elsewhere")
    (path / name).symlink_to(moved)
    refused(path, f"weight_map entry '{name}' .* outside the checkpoint folder .*through a symlink, to {moved}")


def test_a_tensor_in_two_shards_is_refused(saved, tmp_path):
    """Read in turn, the second shard's copy silently overwrote the first's."""
    path = copy(saved, "sharded", tmp_path / "ckpt")
    shards = sorted(path.glob("model-*.safetensors"))
    first, last = shards[0], shards[-1]
    extra = load_file(first)
    key = sorted(extra)[0]
    save_file({**load_file(last), key: extra[key] * 2}, str(last), metadata={"format": "pt"})
    refused(path, f"has tensor {key} in both {first.name} and {last.name}")


def test_a_tensor_in_two_unindexed_safetensors_files_is_refused(saved, tmp_path):
    path = copy(saved, "single", tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    save_file(state, str(path / "a.safetensors"))
    save_file({"lm_head.weight": state["lm_head.weight"]}, str(path / "b.safetensors"))
    refused(path, "has tensor lm_head.weight in both a.safetensors and b.safetensors")


def test_a_tensor_named_twice_in_the_index_is_refused(saved, tmp_path):
    """json keeps the last of a repeated key silently."""
    path = copy(saved, "sharded", tmp_path / "ckpt")
    first = sorted(path.glob("model-*.safetensors"))[0].name
    text = (path / "model.safetensors.index.json").read_text()
    head, tail = text.split('"weight_map": {', 1)
    (path / "model.safetensors.index.json").write_text(f'{head}"weight_map": {{"lm_head.weight": "{first}", {tail}')
    refused(path, "index.json names 'lm_head.weight' twice")


def test_one_weight_under_two_names_is_refused(saved, tmp_path):
    """With and without the "model." prefix, two tensors load the same parameter: the second silently won."""
    path = copy(saved, "single", tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    save_file({**state, "embed_tokens.weight": state["model.embed_tokens.weight"] * 2}, str(path / "model.safetensors"))
    message = refused(path, "checkpoint tensors .* are both the weight embed_tokens.weight")
    assert "model.embed_tokens.weight and embed_tokens.weight" in message or \
        "embed_tokens.weight and model.embed_tokens.weight" in message


def state_of(saved: Path) -> dict[str, torch.Tensor]:
    return load_file(saved / "single" / "model.safetensors")


def truncated_zip(path: Path, saved: Path) -> None:
    truncate(as_bin(path, state_of(saved)), 1000)


BIN_DAMAGE = {
    "garbage": (lambda p, s: as_bin(p, {}).write_bytes(b"not a checkpoint" * 50),
                r"pytorch_model.bin is not a PyTorch checkpoint \(neither a zip archive nor a pickle\)"),
    "empty": (lambda p, s: as_bin(p, {}).write_bytes(b""), "pytorch_model.bin is empty"),
    "truncated": (truncated_zip, r"pytorch_model.bin is not a readable PyTorch checkpoint \(truncated or corrupt\?\)"),
    # fairseq-style: the training arguments pickled beside the weights.
    "refused by weights_only": (lambda p, s: as_bin(p, {**state_of(s), "args": argparse.Namespace(lr=1.0)}),
                                "pytorch_model.bin is refused by torch.load\\(weights_only=True\\): Unsupported "
                                "global: GLOBAL argparse.Namespace"),
    "a training checkpoint": (lambda p, s: as_bin(p, {"state_dict": state_of(s), "step": 3}),
                              "pytorch_model.bin holds 'state_dict': a dict, not a tensor"),
    "a list": (lambda p, s: as_bin(p, list(state_of(s).values())), "pytorch_model.bin holds a list, not a state dict"),
}


@pytest.mark.parametrize("damage", BIN_DAMAGE)
def test_a_broken_bin_file_is_named(saved, tmp_path, damage):
    corrupt, message = BIN_DAMAGE[damage]
    path = copy(saved, "single", tmp_path / "ckpt")
    corrupt(path, saved)
    assert str(path / "pytorch_model.bin") in refused(path, message)


def test_a_tensor_in_two_bin_shards_is_refused(saved, tmp_path):
    path = copy(saved, "single", tmp_path / "ckpt")
    state = state_of(saved)
    as_bin(path, state, "pytorch_model-00001-of-00002.bin")
    torch.save({"lm_head.weight": state["lm_head.weight"]}, path / "pytorch_model-00002-of-00002.bin")
    refused(path, "has tensor lm_head.weight in both pytorch_model-00001-of-00002.bin and "
                  "pytorch_model-00002-of-00002.bin")


def test_nan_and_inf_weights_are_warned_of_one_line_per_tensor(saved, tmp_path, caplog):
    path = copy(saved, "single", tmp_path / "ckpt")
    state = state_of(saved)
    state["model.norm.weight"][3] = float("nan")
    state["lm_head.weight"][7, :2] = float("inf")
    save_file(state, str(path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="models.loader"):
        LLM(model=str(path), max_model_len=64)
    lines = [r.getMessage() for r in caplog.records if r.name == "models.loader"]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    file = path / "model.safetensors"
    assert f"checkpoint tensor model.norm.weight ({file}) holds 1 NaN and 0 inf among its 128 values; " in lines[1]
    assert f"checkpoint tensor lm_head.weight ({file}) holds 0 NaN and 2 inf among its 65536 values; " in lines[0]


def test_many_non_finite_tensors_are_warned_of_a_few_then_counted(saved, tmp_path, caplog):
    path = copy(saved, "single", tmp_path / "ckpt")
    state = {name: torch.full_like(tensor, float("nan")) for name, tensor in state_of(saved).items()}
    save_file(state, str(path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="models.loader"):
        assert len(list(iter_checkpoint(path))) == len(state)
    lines = [r.getMessage() for r in caplog.records if r.name == "models.loader"]
    assert len(lines) == 6 and lines[-1] == f"{len(state) - 5} more checkpoint tensors hold NaN or inf values"


def test_exactly_as_many_non_finite_tensors_as_are_warned_of_get_no_count_line(saved, tmp_path, caplog):
    path = copy(saved, "single", tmp_path / "ckpt")
    state = state_of(saved)
    for name in sorted(state)[:MAX_NON_FINITE_WARNINGS]:
        state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, str(path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="models.loader"):
        assert len(list(iter_checkpoint(path))) == len(state)
    lines = [r.getMessage() for r in caplog.records if r.name == "models.loader"]
    assert len(lines) == MAX_NON_FINITE_WARNINGS and not any("more checkpoint tensors" in line for line in lines)


def test_float8_tensors_are_read_without_a_finiteness_check(saved, tmp_path):
    path = copy(saved, "single", tmp_path / "ckpt")
    state = state_of(saved)
    state["extra.scale"] = torch.ones(4).to(torch.float8_e4m3fn)
    save_file(state, str(path / "model.safetensors"))
    read = dict(iter_checkpoint(path))
    assert read.keys() == state.keys() and read["extra.scale"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("content, message", [
    ("{eos", "generation_config.json is not valid JSON"),                       # was a JSONDecodeError naming no file
    ("[2]", "generation_config.json holds a JSON list, not an object"),         # was an AttributeError
    ('{"eos_token_id": "</s>"}', "generation_config.json: eos_token_id must be a token id or a list of them"),
])
def test_a_bad_generation_config_is_named(saved, tmp_path, content, message):
    path = copy(saved, "single", tmp_path / "ckpt")
    (path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        resolve_model(str(path))


def test_an_eos_token_id_that_is_a_string_is_refused(saved, tmp_path):
    # list("</s>") made four one-character "ids" that never matched a token.
    path = copy(saved, "single", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="config.json: model config: eos_token_id must be a token id or a list"):
        resolve_model(str(path))


def run_command(path: Path, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "framework.run", f"model.name={path}", "engine.max_model_len=256",
         "workload.num_requests=2", "plots=false", "progress=false", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("damage", ["truncated safetensors", "index without weight_map", "refused bin",
                                    "unsupported model_type"])
def test_the_command_line_prints_one_line_and_exits_2(saved, tmp_path, damage):
    """Broken checkpoints ended in a traceback and exit 1 (the config.json one already in one line)."""
    kind = "sharded" if damage == "index without weight_map" else "single"
    path = copy(saved, kind, tmp_path / "ckpt")
    if damage == "truncated safetensors":
        truncate(path / "model.safetensors")
        culprit = path / "model.safetensors"
    elif damage == "index without weight_map":
        write_index(path, {"metadata": {}})
        culprit = path / "model.safetensors.index.json"
    elif damage == "refused bin":
        culprit = as_bin(path, {**state_of(saved), "args": argparse.Namespace(lr=1.0)})
    else:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
        culprit = path / "config.json"
    done = run_command(path, tmp_path / "run")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(culprit) in lines[0], done.stderr
