"""The ``BlockAllocator`` interface: KV block bookkeeping (block ids, never tensors) that the scheduler calls."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from framework.common.registry import Registry
from framework.common.request import Request

#: Block 0 is never handed out: block tables are padded with it (seeds 000/001).
NULL_BLOCK = 0


@dataclass
class PrefixHit:
    """Cached blocks that hold the start of a request's tokens (found, not yet taken)."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class AllocatorStats:
    """Counts since the allocator was built. The prefix lookups of requests recomputed after a preemption are kept
    apart (``preempted_*``), as vLLM keeps them: ``prefix_hit_rate`` measures sharing, not recompute's reuse."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preempted_query_tokens: int = 0
    preempted_hit_tokens: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    cow_copies: int = 0
    evictions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


class BlockAllocator(ABC):
    """Bookkeeping of ``num_blocks`` device blocks of ``block_size`` tokens and ``num_cpu_blocks``
    swap blocks.

    Contract:
    - It keeps books only and never touches a tensor: the executor runs the copy and swap lists the
      scheduler collects, so real and simulated runs share one allocator.
    - Block ``NULL_BLOCK`` is reserved; ``num_blocks - 1`` blocks are usable.
    - ``allocate_slots`` either gives the request every block it needs, or changes nothing and
      returns False. It writes ``request.block_ids`` and nothing else on the request but
      ``request.block_hashes``, a cache of its full blocks' hashes that any call may extend.
    - A block is held by as many requests as its reference count says; a block whose count drops
      to zero becomes free (and, if it holds a full cached block, stays findable until evicted).
    - Copies that keep shared blocks correct (copy-on-write) are queued and handed to the
      scheduler by ``take_copies``; they must run on the device before the next forward pass.
    """

    name: ClassVar[str] = ""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = AllocatorStats()

    @classmethod
    def check_option_values(cls, **options: Any) -> None:
        """ValueError, one line, for an option value (``EngineConfig.allocator_options``, names already checked) this
        allocator refuses whatever its pool: called before the model loads, so a bad value costs no load. Checks none
        by default; a constructor may call it to check its own."""

    # -- capacity --------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""

    @property
    @abstractmethod
    def num_free_cpu_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------------
    @abstractmethod
    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached full blocks matching the request's first tokens, always leaving
        at least the last token to compute. Changes no block and nothing on the request but
        its hash cache (``block_hashes``)."""

    @property
    @abstractmethod
    def num_cached_blocks(self) -> int:
        """Free blocks still holding a findable full block."""

    # -- allocation ------------------------------------------------------------------------------
    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Give ``request`` blocks for its first ``num_computed_tokens + prefix + num_new_tokens`` tokens, the
        ``prefix`` blocks first (only for a request holding none). All-or-nothing: False changes nothing. A
        ``prefix`` holds until an allocation evicts one of its blocks; taking it after that is a ValueError."""

    def fits_after(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None,
                   released: Sequence[Request]) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens, prefix)`` would succeed once the ``released``
        requests gave their device blocks back; changes nothing. This default counts all their blocks as
        freed, overcounting shared ones; allocators that share blocks answer exactly."""
        freed = sum(len(r.block_ids) for r in released)
        return self._new_blocks(request, num_new_tokens, prefix) <= self.num_free_blocks + freed

    def _new_blocks(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None) -> int:
        """Blocks ``allocate_slots`` takes from the free pool beyond the prefix blocks."""
        prefix_tokens, prefix_blocks = (prefix.num_tokens, len(prefix.block_ids)) if prefix else (0, 0)
        total = request.num_computed_tokens + prefix_tokens + num_new_tokens
        return max(0, self.blocks_needed(total) - len(request.block_ids) - prefix_blocks)

    @abstractmethod
    def free(self, request: Request) -> None:
        """Drop the request's references to its device and swap blocks."""

    @abstractmethod
    def fork(self, parent: Request, child: Request) -> None:
        """Make ``child`` share every device block of ``parent`` (reference counts go up)."""

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) device block copies queued since the last call."""
        return []

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Make these blocks unfindable by ``find_prefix`` (their KV may be missing: a step that
        was to fill them failed); they stay held by whoever holds them. Default: nothing (an
        allocator without a prefix cache)."""

    # -- swap ------------------------------------------------------------------------------------
    @abstractmethod
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to swap space: (device, cpu) pairs to copy, or None (and no
        change) when the swap space is too small."""

    @abstractmethod
    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (cpu, device) pairs to copy, or None (no change) when
        the device has too few free blocks."""

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Raise AssertionError if the books disagree with the given live requests."""

    def check_slots(self, request: Request, start: int, end: int) -> None:
        """Raise AssertionError unless ``request`` holds a real block for each of its token
        positions ``[start, end)`` (the tokens a step is about to write). Allocators that share
        blocks also check that no other request relies on a block being written."""
        bs = self.block_size
        assert len(request.block_ids) * bs >= end, (
            f"{request.request_id}: {len(request.block_ids)} blocks cannot hold tokens up to position {end}")
        written = request.block_ids[start // bs:-(-end // bs)]
        assert NULL_BLOCK not in written, f"{request.request_id} would write into the null block"


ALLOCATORS: Registry[BlockAllocator] = Registry(
    "allocator", BlockAllocator, entry_point_group="framework.allocators", builtin="framework.kv.allocators")
