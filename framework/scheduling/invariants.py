"""The scheduling invariants, checked after each step when ``EngineConfig.check_invariants`` is set."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from framework.common.request import Request, RequestStatus
from framework.kv.block_allocator import NULL_BLOCK

if TYPE_CHECKING:
    from framework.kv.block_allocator import BlockAllocator
    from framework.scheduling.output import SchedulerOutput
    from framework.scheduling.scheduler import Scheduler


def check_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Raise AssertionError if this step's output or the queues break an invariant: budgets; each scheduled
    token has a writable slot in its request's blocks; waiting requests hold no blocks, swapped ones exactly
    the swap blocks of their computed tokens; the queues and the allocator's books agree."""
    total = out.total_num_scheduled_tokens
    assert total <= scheduler.max_num_batched_tokens, f"{total} tokens > max_num_batched_tokens"
    assert scheduler.seats_taken <= scheduler.max_num_seqs, f"{scheduler.seats_taken} seats taken > max_num_seqs"
    assert len(out.scheduled) == len(out.num_scheduled_tokens), "a request is scheduled twice"
    assert list(out.num_scheduled_tokens) == [r.request_id for r in out.scheduled], (
        "num_scheduled_tokens does not list the scheduled requests in scheduled order")
    running = {r.request_id for r in scheduler.running}
    for req in out.scheduled:
        n = out.num_scheduled_tokens[req.request_id]
        assert req.status == RequestStatus.RUNNING, f"{req.request_id} scheduled while {req.status.name}"
        assert req.request_id in running, f"{req.request_id} is scheduled but not in the running queue"
        assert 0 < n <= req.num_tokens - req.num_computed_tokens, f"{req.request_id}: {n} tokens scheduled"
        scheduler.allocator.check_slots(req, req.num_computed_tokens, req.num_computed_tokens + n)
    moved_out = {r.request_id for r in out.swapped_out}
    assert not moved_out & {r.request_id for r in out.swapped_in}, "a request was swapped out and in in one step"
    assert not moved_out & set(out.num_scheduled_tokens), "a swapped-out request is scheduled"
    for req in scheduler.waiting:
        assert req.status == RequestStatus.WAITING, f"{req.request_id} in waiting while {req.status.name}"
        assert not req.block_ids and not req.cpu_block_ids, f"{req.request_id} waits holding blocks"
    for req in scheduler.swapped:
        assert req.status == RequestStatus.SWAPPED, f"{req.request_id} in swapped while {req.status.name}"
        assert not req.block_ids, f"{req.request_id} swapped with device blocks"
        want = scheduler.allocator.blocks_needed(req.num_computed_tokens)
        assert len(req.cpu_block_ids) == want > 0, (
            f"{req.request_id}: {len(req.cpu_block_ids)} swap blocks for {req.num_computed_tokens} computed tokens")
    for req in scheduler.running:
        assert req.status == RequestStatus.RUNNING, f"{req.request_id} in running while {req.status.name}"
        assert not req.cpu_block_ids, f"{req.request_id} runs while holding swap blocks"
        assert len(req.block_ids) >= scheduler.allocator.blocks_needed(req.num_computed_tokens), (
            f"{req.request_id}: {len(req.block_ids)} blocks cannot hold its {req.num_computed_tokens} computed tokens")
    live = len(scheduler.waiting) + len(scheduler.running) + len(scheduler.swapped) + len(scheduler._finishing)
    assert live == len(scheduler.requests), f"{live} queued requests but {len(scheduler.requests)} unfinished"
    check_books(scheduler)


def check_books(scheduler: Scheduler) -> None:
    """AssertionError unless the allocator's books agree with the live requests' blocks (``check_block_holders``)
    and with its own invariants."""
    check_block_holders(scheduler.allocator, scheduler.requests.values())
    scheduler.allocator.check_invariants(scheduler.requests.values())


def check_block_holders(allocator: BlockAllocator, requests: Iterable[Request]) -> None:
    """AssertionError unless the live requests' blocks agree with any allocator's counts: the distinct device
    blocks they hold are its used ones (none leaked, none handed out twice unseen), never the null block; a block
    held twice is at one position with the same tokens in both (a prefix or a fork); a swap block has one holder."""
    positions: dict[int, tuple[int, Request]] = {}
    swap_blocks: set[int] = set()
    bs = allocator.block_size
    for req in requests:
        assert NULL_BLOCK not in req.block_ids, f"{req.request_id} holds the null block"
        for i, bid in enumerate(req.block_ids):
            if bid not in positions:
                positions[bid] = (i, req)
                continue
            j, other = positions[bid]
            assert i == j, f"block {bid} is block {j} of {other.request_id} and block {i} of {req.request_id}"
            a = req.token_ids[i * bs:min((i + 1) * bs, req.num_computed_tokens)]
            b = other.token_ids[i * bs:min((i + 1) * bs, other.num_computed_tokens)]
            k = min(len(a), len(b))
            assert a[:k] == b[:k], f"block {bid} holds other tokens for {req.request_id} than for {other.request_id}"
        for bid in req.cpu_block_ids:
            assert bid not in swap_blocks, f"swap block {bid} is held twice (again by {req.request_id})"
            swap_blocks.add(bid)
    assert len(positions) == allocator.num_used_blocks, (
        f"the live requests hold {len(positions)} distinct device blocks but the allocator counts "
        f"{allocator.num_used_blocks} used")
    used_cpu = allocator.num_cpu_blocks - allocator.num_free_cpu_blocks
    assert len(swap_blocks) == used_cpu, (
        f"the live requests hold {len(swap_blocks)} swap blocks but the allocator counts {used_cpu} used")
