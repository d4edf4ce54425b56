"""The ``InputPreparer`` interface: turns a ``SchedulerOutput`` into the tensors of one forward
pass. The model runner calls it once per step."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from framework.attention import AttentionMetadata
from framework.registry import Registry
from framework.scheduler import SchedulerOutput


@dataclass
class SamplingMetadata:
    """Per sampled row: temperature (0 = greedy), top-k (0 = off), top-p (1 = off), and the
    request's own generator where it has a seed."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    all_greedy: bool = True


@dataclass
class ModelInput:
    """One forward pass: flat ``input_ids``/``positions`` of all scheduled tokens, the attention
    metadata, and which hidden states to sample from (``logits_indices``), for which requests.
    ``host`` keeps the CPU arrays the preparer computed (for tests, debugging and simulators)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_req_ids: list[str]
    sampling: SamplingMetadata
    host: dict[str, np.ndarray] = field(default_factory=dict)


class InputPreparer(ABC):
    """Builds model inputs from scheduler outputs, keeping whatever per-request state it likes
    between steps. Contract: ``prepare`` returns None for an empty step; otherwise tokens appear
    in ``SchedulerOutput.scheduled`` order, request ``i``'s new tokens at positions
    ``num_computed_tokens .. num_computed_tokens + num_scheduled_tokens - 1``; a request samples
    only when this step reaches its last known token (a chunk mid-prompt does not). It may not
    modify the scheduler output or the requests."""

    name: ClassVar[str] = ""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu") -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.device = torch.device(device)

    @abstractmethod
    def prepare(self, out: SchedulerOutput) -> ModelInput | None: ...


PREPARERS: Registry[InputPreparer] = Registry(
    "preparer", InputPreparer, entry_point_group="framework.preparers", builtin="framework.preparers")
