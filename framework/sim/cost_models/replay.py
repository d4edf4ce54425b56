"""Replayed step times: the k-th step takes the k-th measured duration, whatever it computes."""
from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from framework.common.config import parse_finite_float
from framework.sim.cost_model import COST_MODELS, BatchShape, CostModel
from framework.sim.hardware import Hardware
from models.config import ModelConfig


@COST_MODELS.register("replay")
class ReplayCostModel(CostModel):
    """Options: ``durations`` (seconds, in step order) or ``file`` (one duration per line, or a CSV with a
    ``duration`` column such as a run's ``steps.csv``, in its ``step`` order; of a cluster run's, the rows of replica
    ``replica``).
    Not a function of the shape (``deterministic = False``); a step past the recorded ones is a RuntimeError."""

    deterministic = False

    def __init__(self, model: ModelConfig, hardware: Hardware, dtype_bytes: int = 2, tensor_parallel_size: int = 1,
                 block_size: int = 16, durations: Sequence[float] | None = None, file: str | None = None,
                 replica: int | None = None, *, dtype: str | None = None) -> None:
        super().__init__(model, hardware, dtype_bytes, tensor_parallel_size, block_size, dtype=dtype)
        if (durations is None) == (file is None):
            raise ValueError("the replay cost model needs exactly one of durations=[...] or file=PATH")
        self.durations = _durations(durations, "durations") if durations is not None else read_durations(file, replica)
        self.num_replayed = 0

    def step_time(self, batch: BatchShape) -> float:
        return self._next()

    def decode_step_time(self, num_seqs: int, context: int) -> float:
        return self._next()

    def _next(self) -> float:
        k = self.num_replayed
        if k >= len(self.durations):
            raise RuntimeError(f"the replay cost model has {len(self.durations)} recorded steps and step {k + 1} was asked for")
        self.num_replayed = k + 1
        return self.durations[k]


def _durations(values: Sequence[Any], source: str) -> list[float]:
    """``values`` as seconds, each a finite number >= 0 (a NaN would make the clock, and every latency,
    NaN); ``source`` names them for the error."""
    out = []
    for k, value in enumerate(values):
        d = parse_finite_float(value)
        if d is None or d < 0:
            raise ValueError(f"replayed step durations must be finite numbers >= 0 seconds; {source} has {value!r} "
                             f"at step {k + 1}")
        out.append(d)
    return out


def read_durations(file: str | Path, replica: int | None = None) -> list[float]:
    """The durations of ``file`` (see ``ReplayCostModel``), checked as ``_durations`` does."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise ValueError(f"replay file {str(file)!r} does not exist")
    with open(path) as f:
        first = f.readline()
        f.seek(0)
        if "duration" not in first:
            return _durations([line.strip() for line in f if line.strip()], str(path))
        rows = list(csv.DictReader(f))
    replicas = sorted({int(r["replica"]) for r in rows if r.get("replica") not in (None, "")})
    if replica is None and len(replicas) > 1:
        raise ValueError(f"{path} holds the steps of replicas {replicas}: pick one with replica=N")
    if replica is not None:
        if replica not in replicas:
            raise ValueError(f"{path} holds no steps of replica {replica} (replicas: {replicas or 'none'})")
        rows = [r for r in rows if int(r["replica"]) == replica]
    if rows and rows[0].get("step") not in (None, ""):
        # In step order, whatever order the file's rows are in (a cluster run's interleave the replicas').
        rows.sort(key=lambda r: int(r["step"]))
    return _durations([r["duration"] for r in rows], str(path))
