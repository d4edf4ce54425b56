"""Find a model by preset name or Hugging Face directory; load its config, weights and tokenizer.

A directory needs ``config.json`` and weights, taken in transformers' order: ``model.safetensors``,
else the shards ``model.safetensors.index.json`` lists, else ``pytorch_model.bin``, else the shards
``pytorch_model.bin.index.json`` lists; a folder with none of those, every ``*.safetensors``, else every
``pytorch_model*.bin``. The tokenizer is loaded when the
directory has one. A broken file, an index whose ``weight_map`` is missing, malformed or names a
file outside the directory, and a tensor named twice are ValueErrors naming the file.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.config import ModelConfig, eos_token_ids
from models.presets import PRESETS

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
#: Tensors holding NaN or inf that get a warning each; one more line counts the rest.
MAX_NON_FINITE_WARNINGS = 5
#: ``generation_config.json`` keys that are default sampling options (vLLM's ``generation_config="auto"``), with
#: the ``SamplingParams`` option each sets: ``max_new_tokens`` is ``max_tokens``.
GENERATION_SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                            "frequency_penalty": "frequency_penalty", "temperature": "temperature", "top_k": "top_k",
                            "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    path: Path | None  # None for a preset: random weights from the seed
    #: The sampling options the checkpoint's ``generation_config.json`` sets (``GENERATION_SAMPLING_KEYS``), by
    #: ``SamplingParams`` name; unchecked (``framework`` checks them as ``SamplingParams``).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def is_preset(self) -> bool:
        return self.path is None


def resolve_model(name_or_path: str) -> ModelSource:
    if not isinstance(name_or_path, (str, Path)):  # model.name=5 reads as an int
        raise ValueError(f"model must be a preset ({', '.join(sorted(PRESETS))}) or a checkpoint directory, "
                         f"got {name_or_path!r}")
    if name_or_path in PRESETS:
        return ModelSource(name_or_path, ModelConfig.from_hf(PRESETS[name_or_path]), None)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory "
            f"holding a Hugging Face config.json")
    try:
        with open(path / "config.json") as f:
            config = ModelConfig.from_hf(json.load(f))
    except ValueError as exc:  # json's errors too: name the file, which neither message does
        raise ValueError(f"{path / 'config.json'}: {exc}") from None
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ModelSource(str(path), config, path)
    data = _generation_config(gen)
    # transformers' generate stops on the generation config's EOS ids, on none if it gives none (config.json's
    # count only without the file); so does this engine.
    eos = data.get("eos_token_id")
    config.eos_token_ids = [] if eos is None else eos_token_ids(eos, str(gen))
    # As vLLM: every sampling key set (not null), whatever do_sample says.
    sampling = {option: data[key] for key, option in GENERATION_SAMPLING_KEYS.items() if data.get(key) is not None}
    return ModelSource(str(path), config, path, sampling)


def _generation_config(gen: Path) -> dict[str, Any]:
    """A ``generation_config.json``'s settings. Raises ValueError naming the file."""
    try:
        data = json.loads(gen.read_text())
    except ValueError as exc:  # json's errors (and a file that is not UTF-8)
        raise ValueError(f"{gen} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{gen} holds a JSON {type(data).__name__}, not an object of generation settings")
    return data


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from a checkpoint directory, one tensor at a time; warns of NaN or inf weights. Raises
    ValueError, naming the file, for absent or broken weights, a bad index or a tensor named twice: for
    safetensors at this call, before any tensor is read."""
    files, index = _weight_files(path)
    if not files:
        # A ValueError, as every other bad model option: the command line shows it in one line.
        raise ValueError(f"model {str(path)!r} has a config.json but no weights (*.safetensors or "
                         f"pytorch_model*.bin); executor=sim runs a model from its config.json alone")
    absent = [name for name in files if not (path / name).is_file()]
    if absent:
        raise ValueError(f"checkpoint {path} lacks {', '.join(absent)} (listed in {index})")
    if files[0].endswith(".safetensors"):
        _check_safetensors(path, files)
        return _warn_non_finite(_read_safetensors(path, files))
    return _warn_non_finite(_read_bins([path / name for name in files]))


def _weight_files(path: Path) -> tuple[list[str], str | None]:
    """The weight files to read, relative to ``path``, in transformers' order (the module docstring), and the
    index that lists them (None for none). Files beside the one chosen are ignored, as transformers ignores
    them: a stale single file or index left by another save, a PEFT adapter, Mistral's own-format
    consolidated.safetensors."""
    for single, index in (("model.safetensors", INDEX_FILE), ("pytorch_model.bin", BIN_INDEX_FILE)):
        if (path / single).is_file():
            return [single], None
        if (path / index).is_file():
            return _index_shards(path, index), index
    safetensors = sorted(p.name for p in path.glob("*.safetensors"))
    return safetensors or sorted(p.name for p in path.glob("pytorch_model*.bin")), None


def _index_shards(path: Path, name: str) -> list[str]:
    """The shard files index ``name`` lists. Raises ValueError unless it is JSON whose weight_map maps each
    tensor name once to a file inside the checkpoint folder."""
    index = path / name
    try:
        data = json.loads(index.read_text(), object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:  # json keeps the last of a repeated key silently
        raise ValueError(f"{index} names {exc.key!r} twice") from None
    except ValueError as exc:  # json's errors (and a file that is not UTF-8)
        raise ValueError(f"{index} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "weight_map" not in data:
        raise ValueError(f"{index} lacks weight_map (the mapping of each tensor name to the file holding it)")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        what = f"a {type(weight_map).__name__}" if not isinstance(weight_map, dict) else "empty"
        raise ValueError(f"{index}: weight_map is {what}; it must map each tensor name to the file holding it")
    first: dict[str, str] = {}  # each shard file -> the first tensor listed in it
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise ValueError(f"{index}: weight_map maps {name!r} to {file!r}, not a file name")
        first.setdefault(file, name)
    for file, name in first.items():
        _check_inside(path, file, f"{index}: weight_map entry {file!r} (for {name})")
    return sorted(first)


class _RepeatedKey(Exception):
    """A JSON object gave ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; raises _RepeatedKey for a key given twice."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen.add(key)
    return dict(pairs)


def _check_inside(folder: Path, file: str, what: str) -> None:
    """Raise ValueError unless ``folder / file`` lies inside ``folder`` once symlinks are followed (a Hugging
    Face cache snapshot's links into its repository's blobs/ count as inside)."""
    root = folder.resolve()
    target = (root / file).resolve()
    if target.is_relative_to(root):
        return
    # The hub cache keeps every file of snapshots/<revision>/ as a link to ../../blobs/<hash>.
    if root.parent.name == "snapshots" and target.is_relative_to(root.parent.parent / "blobs"):
        return
    # An absolute name or one with "..", else a name inside the folder that a symlink leads out of.
    lexical = Path(os.path.normpath(root / file)).is_relative_to(root)
    raise ValueError(f"{what} lies outside the checkpoint folder {folder}"
                     f"{f' (through a symlink, to {target})' if lexical else ''}")


def _check_safetensors(path: Path, files: list[str]) -> None:
    """Raise ValueError for a file that is not safetensors, or a tensor in two files; reads headers only."""
    holder: dict[str, str] = {}
    for file in files:
        for key in _safetensors_keys(path / file):
            if key in holder:  # read in turn, the second would silently overwrite the first
                raise ValueError(f"checkpoint {path} has tensor {key} in both {holder[key]} and {file}")
            holder[key] = file


def _safetensors_keys(file: Path) -> list[str]:
    """The tensor names in a safetensors file's header; raises ValueError naming a broken file."""
    from safetensors import SafetensorError, safe_open

    if file.stat().st_size == 0:
        raise ValueError(f"checkpoint file {file} is empty")
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except SafetensorError as exc:
        raise ValueError(f"checkpoint file {file} is not a valid safetensors file (truncated or corrupt?): "
                         f"{_first_line(exc)}") from None


def _read_safetensors(path: Path, files: list[str]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """(name, file, tensor) of every tensor in ``files``, which ``_check_safetensors`` passed."""
    from safetensors import SafetensorError, safe_open

    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                try:
                    tensor = f.get_tensor(key)
                except SafetensorError as exc:  # a header that parses but a tensor torch cannot build
                    raise ValueError(f"checkpoint file {path / name}: tensor {key}: {_first_line(exc)}") from None
                yield key, path / name, tensor


def _read_bins(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """(name, file, tensor) of every tensor in the ``pytorch_model*.bin`` files; raises ValueError for a
    tensor in two of them, before yielding any of the second's."""
    holder: dict[str, Path] = {}
    for file in files:
        state = _load_bin(file)
        twice = sorted(state.keys() & holder.keys())
        if twice:
            raise ValueError(f"checkpoint {file.parent} has tensor {twice[0]} in both {holder[twice[0]].name} "
                             f"and {file.name}")
        holder.update(dict.fromkeys(state, file))
        for key, tensor in state.items():
            yield key, file, tensor


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict, loaded with torch.load(weights_only=True); raises ValueError naming the file
    when it is not such a file or holds anything but tensors."""
    import torch  # only for .bin checkpoints; describing a model needs no torch

    with open(file, "rb") as f:
        head = f.read(4)
    if not head:
        raise ValueError(f"checkpoint file {file} is empty")
    # torch.save writes a zip archive (a pickle protocol >= 2 before torch 1.6): anything else is no checkpoint.
    if not head.startswith((b"PK\x03\x04", b"\x80")):
        raise ValueError(f"checkpoint file {file} is not a PyTorch checkpoint (neither a zip archive nor a pickle)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except MemoryError:  # not the file's fault
        raise
    except Exception as exc:  # a corrupt file fails in many ways: struct.error, KeyError, AssertionError, ...
        raise ValueError(f"checkpoint file {file} {_bin_failure(exc)}") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint file {file} holds a {type(state).__name__}, not a state dict of tensors")
    odd = next((key for key, value in state.items() if not isinstance(value, torch.Tensor)), None)
    if odd is not None:
        raise ValueError(f"checkpoint file {file} holds {odd!r}: a {type(state[odd]).__name__}, not a tensor "
                         f"(a training checkpoint? the model's state dict is needed)")
    return state


def _bin_failure(exc: Exception) -> str:
    """What torch.load's exception says is wrong with a file, in a phrase."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # refused: the pickle holds more than tensors and plain containers
        reason = text.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0].splitlines()[0]
        return (f"is refused by torch.load(weights_only=True): {reason}; if you trust the file, re-save its "
                f"tensors with safetensors")
    detail = text.split(". ")[0].strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"is not a readable PyTorch checkpoint (truncated or corrupt?): {detail}"


def _first_line(exc: Exception) -> str:
    """An exception's message on one line."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _warn_non_finite(tensors: Iterator[tuple[str, Path, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of ``tensors``, logging a warning for each of the first few holding NaN or inf and
    a count of the rest."""
    count = 0
    for name, file, tensor in tensors:
        if not _finite(tensor):
            count += 1
            if count <= MAX_NON_FINITE_WARNINGS:
                log.warning("checkpoint tensor %s (%s) holds %d NaN and %d inf among its %d values; outputs "
                            "that use it may be NaN", name, file, int(tensor.isnan().sum()), int(tensor.isinf().sum()),
                            tensor.numel())
        yield name, tensor
    if count > MAX_NON_FINITE_WARNINGS:
        log.warning("%d more checkpoint tensors hold NaN or inf values", count - MAX_NON_FINITE_WARNINGS)


def _finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN and no inf: one pass (min and max propagate NaN), far cheaper than isfinite."""
    if not tensor.is_floating_point() or tensor.dtype.itemsize < 2 or tensor.numel() == 0:
        return True  # aminmax has no float8 kernels; an empty tensor has no minimum
    low, high = tensor.aminmax()
    return bool(low.isfinite() and high.isfinite())


def load_tokenizer(source: ModelSource) -> Any | None:
    """The checkpoint's tokenizer, or None when it has none (presets never do)."""
    if source.path is None:
        return None
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((source.path / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path))
