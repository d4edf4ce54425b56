"""Find a model by preset name or Hugging Face directory; load its config, weights and tokenizer.

A directory needs ``config.json`` and weights as ``model.safetensors``, sharded safetensors with
``model.safetensors.index.json``, or ``pytorch_model*.bin``. The tokenizer is loaded when the
directory has one.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.config import ModelConfig
from models.presets import PRESETS

if TYPE_CHECKING:
    import torch


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    path: Path | None  # None for a preset: random weights from the seed

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
    if gen.is_file():
        # transformers' generate stops on the generation config's EOS ids; so does this engine.
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
    return ModelSource(str(path), config, path)


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a checkpoint directory, one tensor at a time. Raises ValueError
    when the directory has no weights or lacks a shard its index lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        # As transformers does: other safetensors files beside it (Mistral's own-format
        # consolidated.safetensors, a PEFT adapter) hold tensors under other names.
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if files:
        # Checked before reading any, so a broken directory is a one-line configuration error.
        absent = [name for name in files if not (path / name).is_file()]
        if absent:
            raise ValueError(f"checkpoint {path} lacks {', '.join(absent)} (listed in model.safetensors.index.json)")
        from safetensors import safe_open

        for name in files:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        # A ValueError, as every other bad model option: the command line shows it in one line.
        raise ValueError(f"model {str(path)!r} has a config.json but no weights (*.safetensors or "
                         f"pytorch_model*.bin); executor=sim runs a model from its config.json alone")
    for file in bins:
        import torch  # only for .bin checkpoints; describing a model needs no torch

        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_tokenizer(source: ModelSource) -> Any | None:
    """The checkpoint's tokenizer, or None when it has none (presets never do)."""
    if source.path is None:
        return None
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((source.path / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path))
