"""vLLM v0's sequence data model (seed 004), the vocabulary of the ``v0`` input preparer (data only).

A request is a ``SequenceGroup``, the ``n`` sequences sampled from one prompt. Each ``Sequence`` has a
status, logical blocks and a ``SequenceData`` (tokens, how many are computed, and the stage: PREFILL
until every known token is computed, then DECODE). A ``SequenceGroupMetadata`` describes one scheduled
group to the model runner for one step.
"""
from __future__ import annotations

import copy
import enum
from collections.abc import Iterable, Sequence as Seq
from typing import TYPE_CHECKING

from framework.common.request import RequestStatus

if TYPE_CHECKING:
    from framework.common.sampling_params import SamplingParams

#: v0's ``SequenceStatus`` (WAITING, RUNNING, SWAPPED and the four FINISHED_* states, with the
#: same finish reasons): the framework's ``RequestStatus`` already is it.
SequenceStatus = RequestStatus


class SequenceStage(enum.Enum):
    PREFILL = enum.auto()
    DECODE = enum.auto()


class SequenceData:
    """Token ids of one sequence and how far its KV cache is computed. The stage turns DECODE once every
    known token is computed and stays so as sampled tokens are appended (each the next step's input);
    ``reset_state_for_recompute`` (after a preemption) returns it to PREFILL."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "_token_ids", "_num_computed_tokens", "_stage")

    def __init__(self, prompt_token_ids: Seq[int], output_token_ids: Seq[int] | None = None) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids or [])
        # Prompt + output in one list, kept in step with appends, so a step slices it directly
        # instead of concatenating (v0's cached all-token-ids list).
        self._token_ids = self.prompt_token_ids + self.output_token_ids
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL

    @property
    def stage(self) -> SequenceStage:
        return self._stage

    def get_len(self) -> int:
        return len(self._token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        """Prompt then output tokens (the cached list: do not modify it)."""
        return self._token_ids

    def get_last_token_id(self) -> int:
        return self._token_ids[-1]

    def append_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)

    def extend_token_ids(self, token_ids: Seq[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self._token_ids.extend(token_ids)

    def get_num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    def get_num_uncomputed_tokens(self) -> int:
        """Tokens still to prefill; after a recompute preemption that includes the outputs."""
        return len(self._token_ids) - self._num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        self._num_computed_tokens += num_new_computed_tokens
        if not 0 <= self._num_computed_tokens <= len(self._token_ids):
            raise ValueError(f"{self._num_computed_tokens} computed tokens but the sequence has {len(self._token_ids)}")
        if self._num_computed_tokens == len(self._token_ids):
            self._stage = SequenceStage.DECODE

    def reset_state_for_recompute(self) -> None:
        self._num_computed_tokens = 0
        self._stage = SequenceStage.PREFILL

    def get_prefix_token_ids(self, num_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """The first ``num_tokens`` tokens as (prompt part, output part or None), hashable."""
        prompt_len = len(self.prompt_token_ids)
        if num_tokens > prompt_len:
            return tuple(self.prompt_token_ids), tuple(self.output_token_ids[: num_tokens - prompt_len])
        return tuple(self.prompt_token_ids[:num_tokens]), None

    def __repr__(self) -> str:
        return (f"SequenceData(prompt={len(self.prompt_token_ids)}, output={len(self.output_token_ids)}, "
                f"computed={self._num_computed_tokens}, stage={self._stage.name})")


class LogicalTokenBlock:
    """One block's worth of a sequence's tokens (block ``block_number`` of its block table)."""

    __slots__ = ("block_number", "block_size", "token_ids")

    def __init__(self, block_number: int, block_size: int, token_ids: Seq[int] = ()) -> None:
        if len(token_ids) > block_size:
            raise ValueError(f"{len(token_ids)} tokens do not fit a block of {block_size}")
        self.block_number = block_number
        self.block_size = block_size
        self.token_ids = list(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def is_full(self) -> bool:
        return len(self.token_ids) == self.block_size

    def get_num_empty_slots(self) -> int:
        return self.block_size - len(self.token_ids)


class Sequence:
    """One sequence of a group: its data, status and logical blocks. The logical blocks are derived from
    the tokens when read (as later v0 versions do), so appending a token costs only the list append."""

    __slots__ = ("seq_id", "block_size", "data", "status", "stop_reason")

    def __init__(self, seq_id: int, prompt_token_ids: Seq[int], block_size: int,
                 data: SequenceData | None = None) -> None:
        """A new sequence of ``prompt_token_ids``, or one already under way (``data``)."""
        self.seq_id = seq_id
        self.block_size = block_size
        self.data = data if data is not None else SequenceData(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def n_blocks(self) -> int:
        return -(-self.data.get_len() // self.block_size)

    @property
    def logical_token_blocks(self) -> list[LogicalTokenBlock]:
        bs, tokens = self.block_size, self.data.get_token_ids()
        return [LogicalTokenBlock(i, bs, tokens[i * bs:(i + 1) * bs]) for i in range(self.n_blocks)]

    def get_len(self) -> int:
        return self.data.get_len()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def append_token_id(self, token_id: int) -> None:
        self.data.append_token_id(token_id)

    def is_finished(self) -> bool:
        return self.status.is_finished

    def is_prefill(self) -> bool:
        return self.data.stage is SequenceStage.PREFILL

    def fork(self, new_seq_id: int) -> Sequence:
        """A deep copy under a new id: same tokens, progress and status."""
        new = copy.deepcopy(self)
        new.seq_id = new_seq_id
        return new

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.name}, {self.data!r})"


class SequenceGroup:
    """The sequences generated from one prompt (``sampling_params.n`` of them, once forked)."""

    def __init__(self, request_id: str, seqs: Iterable[Sequence], sampling_params: SamplingParams,
                 arrival_time: float = 0.0) -> None:
        self.request_id = request_id
        self.seqs_dict: dict[int, Sequence] = {s.seq_id: s for s in seqs}
        if not self.seqs_dict:
            raise ValueError(f"sequence group {request_id!r} needs at least one sequence")
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time

    @property
    def prompt_token_ids(self) -> list[int]:
        return next(iter(self.seqs_dict.values())).prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs_dict.values())
        return [s for s in self.seqs_dict.values() if s.status == status]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.seqs_dict) if status is None else len(self.get_seqs(status))

    def num_unfinished_seqs(self) -> int:
        return sum(1 for s in self.seqs_dict.values() if not s.is_finished())

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs_dict.values())

    def is_prefill(self) -> bool:
        # The sequences of a group move through the stages together.
        return next(iter(self.seqs_dict.values())).is_prefill()

    def get_max_num_running_seqs(self) -> int:
        """The most sequences this group can run at once for the rest of its life: ``n`` while its prompt
        is computed (the others are forked when it is sampled), then its unfinished ones (the v0 preparer
        drops finished ones from the group)."""
        if self.is_prefill():
            return self.sampling_params.n
        return self.num_unfinished_seqs()

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs_dict:
            raise ValueError(f"sequence {seq.seq_id} is already in group {self.request_id!r}")
        self.seqs_dict[seq.seq_id] = seq

    def remove(self, seq_id: int) -> None:
        if seq_id not in self.seqs_dict:
            raise ValueError(f"sequence {seq_id} is not in group {self.request_id!r}")
        del self.seqs_dict[seq_id]

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, n={self.sampling_params.n}, seqs={list(self.seqs_dict.values())})"


class SequenceGroupMetadata:
    """What the model runner learns about one scheduled group in one step (seed 002).

    ``seq_data`` and ``block_tables`` (physical block numbers) are keyed by sequence id. A prompt step
    computes ``token_chunk_size`` tokens of each sequence (default: all), a decode step one;
    ``do_sample`` is False for a prompt chunk short of the last token. ``computed_block_nums``: blocks
    whose KV is already cached (prefix caching).
    """

    __slots__ = ("request_id", "is_prompt", "seq_data", "sampling_params", "block_tables", "do_sample",
                 "token_chunk_size", "computed_block_nums")

    def __init__(self, request_id: str, is_prompt: bool, seq_data: dict[int, SequenceData],
                 sampling_params: SamplingParams, block_tables: dict[int, list[int]], do_sample: bool = True,
                 token_chunk_size: int | None = None, computed_block_nums: list[int] | None = None) -> None:
        self.request_id = request_id
        self.is_prompt = is_prompt
        self.seq_data = seq_data
        self.sampling_params = sampling_params
        self.block_tables = block_tables
        self.do_sample = do_sample
        if token_chunk_size is None:
            token_chunk_size = next(iter(seq_data.values())).get_len() if is_prompt else 1
        self.token_chunk_size = token_chunk_size
        self.computed_block_nums = computed_block_nums if computed_block_nums is not None else []

    def __repr__(self) -> str:
        return (f"SequenceGroupMetadata({self.request_id!r}, is_prompt={self.is_prompt}, "
                f"seqs={list(self.seq_data)}, chunk={self.token_chunk_size}, do_sample={self.do_sample})")
