import tracemalloc

import pytest

from framework.kv.allocators import paged
from framework.kv.allocators.paged import PagedBlockAllocator
from framework.kv.block_allocator import NULL_BLOCK
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(), arrival_time=0.0)


def compute(alloc, r, n, prefix=None):
    """Allocate for n new tokens and mark them computed, as scheduler + runner would."""
    assert alloc.allocate_slots(r, n, prefix)
    r.num_computed_tokens += (prefix.num_tokens if prefix else 0) + n


def test_allocate_free_and_null_block():
    alloc = PagedBlockAllocator(num_blocks=6, block_size=4)
    r = req("a", list(range(10)))
    compute(alloc, r, 10)
    assert len(r.block_ids) == 3 and NULL_BLOCK not in r.block_ids
    assert alloc.num_free_blocks == 2
    alloc.check_invariants([r])
    alloc.free(r)
    assert r.block_ids == [] and alloc.num_free_blocks == 5
    alloc.check_invariants([])


def test_a_pool_of_millions_of_blocks_takes_memory_only_for_the_blocks_handed_out():
    tracemalloc.start()
    try:
        alloc = PagedBlockAllocator(num_blocks=2_000_000, block_size=4)
        built = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert built < 1 << 20
    assert alloc.num_free_blocks == 1_999_999
    r = req("a", list(range(10)))
    compute(alloc, r, 10)
    assert r.block_ids == [1, 2, 3] and alloc.num_free_blocks == 1_999_996
    alloc.check_invariants([r])
    alloc.free(r)
    assert alloc.num_free_blocks == 1_999_999
    alloc.check_invariants([])


def test_allocation_is_all_or_nothing():
    alloc = PagedBlockAllocator(num_blocks=4, block_size=4)
    r = req("a", list(range(20)))
    assert not alloc.allocate_slots(r, 20)
    assert r.block_ids == [] and alloc.num_free_blocks == 3
    assert alloc.allocate_slots(r, 12)
    assert alloc.num_free_blocks == 0
    assert not alloc.allocate_slots(r, 1) or r.num_computed_tokens < 12


def test_prefix_hit_is_chained_and_leaves_last_token():
    alloc = PagedBlockAllocator(num_blocks=16, block_size=4)
    a = req("a", list(range(12)))
    compute(alloc, a, 12)
    a_blocks = list(a.block_ids)
    alloc.free(a)
    # Same first 8 tokens, then different: two blocks hit.
    b = req("b", list(range(8)) + [99, 98, 97])
    hit = alloc.find_prefix(b)
    assert hit.num_tokens == 8 and hit.block_ids == a_blocks[:2]
    # Exactly the cached 12 tokens: the last block is not matched (a token must be computed).
    c = req("c", list(range(12)))
    assert alloc.find_prefix(c).num_tokens == 8
    # Same second block content but a different first block: chaining prevents a match.
    d = req("d", [50, 51, 52, 53] + list(range(4, 8)) + [1])
    assert alloc.find_prefix(d).num_tokens == 0


def test_prefix_hit_shares_blocks_with_refcounts():
    alloc = PagedBlockAllocator(num_blocks=16, block_size=4)
    a = req("a", list(range(9)))
    compute(alloc, a, 9)
    b = req("b", list(range(8)) + [77, 78])
    hit = alloc.find_prefix(b)
    assert hit.block_ids == a.block_ids[:2]
    compute(alloc, b, 2, hit)
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_computed_tokens == 10
    alloc.check_invariants([a, b])
    assert alloc.stats.prefix_hit_tokens == 8
    alloc.free(a)
    alloc.free(b)
    alloc.check_invariants([])
    assert alloc.num_free_blocks == 15 and alloc.num_cached_blocks == 2


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(paged, "block_hash", lambda parent, tokens: 42)
    alloc = PagedBlockAllocator(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3])
    compute(alloc, a, 3)
    b = req("b", [5, 6, 7])
    assert alloc.find_prefix(b).num_tokens == 0


def test_the_prefix_search_stops_at_the_first_block_that_misses(monkeypatch):
    # A later block's hash may match (here the hash ignores the parent): a hit past a miss would give
    # the request another prompt's KV at that position.
    monkeypatch.setattr(paged, "block_hash", lambda parent, tokens: hash(tokens))
    alloc = PagedBlockAllocator(num_blocks=8, block_size=2)
    compute(alloc, req("a", [1, 2, 3, 4, 5]), 5)
    assert alloc.find_prefix(req("b", [9, 9, 3, 4, 5])).block_ids == []
    assert alloc.find_prefix(req("c", [1, 2, 3, 4, 5])).num_tokens == 4


def test_a_request_holding_blocks_finds_no_prefix():
    # allocate_slots refuses a prefix to a request holding blocks: a hit would turn into an error.
    alloc = PagedBlockAllocator(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    compute(alloc, a, 5)
    alloc.free(a)
    b = req("b", [1, 2, 3, 4, 5, 6])
    compute(alloc, b, 1)
    assert alloc.find_prefix(b).num_tokens == 0
    compute(alloc, b, 1, alloc.find_prefix(b))
    alloc.free(b)


def test_an_uncached_free_block_is_handed_out_before_the_cached_ones():
    alloc = PagedBlockAllocator(num_blocks=4, block_size=2)  # 3 usable blocks
    held = []
    for tokens in ([1, 2], [3, 4], [5, 6]):
        r = req(str(tokens), tokens + [0])
        compute(alloc, r, 2)
        held.append(r.block_ids[0])
        alloc.free(r)  # three cached free blocks, least recently used first
    alloc.uncache([held[2]])  # as a failed step does: the block's contents and its hash disagree
    n = req("n", [7, 7, 7])
    compute(alloc, n, 1)
    assert n.block_ids == [held[2]] and alloc.stats.evictions == 0
    assert alloc.find_prefix(req("q", [1, 2, 0])).num_tokens == 2
    alloc.free(n)


def test_a_pool_of_only_the_null_block_is_refused():
    with pytest.raises(ValueError, match="a KV pool needs at least 2 blocks"):
        PagedBlockAllocator(num_blocks=1, block_size=16)


def test_lru_eviction_prefers_uncached_then_oldest():
    alloc = PagedBlockAllocator(num_blocks=5, block_size=2)
    a = req("a", [1, 2, 3])  # one full (cached) block + one partial
    compute(alloc, a, 3)
    full_a = a.block_ids[0]
    alloc.free(a)
    b = req("b", [7, 8, 9])
    compute(alloc, b, 3)
    full_b = b.block_ids[0]
    alloc.free(b)
    assert alloc.num_cached_blocks == 2
    # Two fresh blocks come from the uncached ones first: both cached blocks survive.
    c = req("c", [20, 21, 22, 23])
    assert alloc.allocate_slots(c, 4)
    assert full_a not in c.block_ids and full_b not in c.block_ids
    # The next one evicts the least recently used cached block (a's).
    d = req("d", [30])
    assert alloc.allocate_slots(d, 1)
    assert d.block_ids == [full_a]
    assert alloc.find_prefix(req("a2", [1, 2, 3])).num_tokens == 0
    assert alloc.find_prefix(req("b2", [7, 8, 9])).num_tokens == 2
    assert alloc.stats.evictions == 1


@pytest.mark.parametrize("refill", [True, False])
def test_a_prefix_whose_block_was_evicted_since_it_was_found_is_refused(refill):
    # A policy that looks up several prefixes and then admits: the first admission evicts a
    # block of the second one's hit. Taking it would share another request's (or no) KV.
    alloc = PagedBlockAllocator(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3])
    compute(alloc, a, 3)
    alloc.free(a)  # one cached block [1, 2], one free uncached block
    b = req("b", [1, 2, 9])
    hit = alloc.find_prefix(b)
    assert hit.num_tokens == 2
    c = req("c", [5, 6, 7, 8])
    compute(alloc, c, 4)  # takes both free blocks, evicting b's hit
    if not refill:
        alloc.free(c)  # the evicted block is free again, with no tokens cached
    with pytest.raises(ValueError, match="b: prefix block .* evicted since find_prefix"):
        alloc.allocate_slots(b, 1, hit)
    assert b.block_ids == []
    alloc.check_invariants([c] if refill else [])


def test_a_live_copy_of_an_evicted_cached_block_is_still_found():
    # a and b computed the same prompt in one step: two copies of each full block, one indexed.
    # Once a's copies are freed and evicted, b's (still running) must serve the next hit.
    alloc = PagedBlockAllocator(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    a, b = req("a", prompt), req("b", prompt)
    compute(alloc, a, 5)
    compute(alloc, b, 5)
    alloc.free(a)
    other = req("c", [9] * 8)  # takes every free block: a's cached copies are evicted
    compute(alloc, other, 8)
    alloc.check_invariants([b, other])
    assert alloc.find_prefix(req("d", prompt)).block_ids == b.block_ids[:2]
    alloc.free(other)
    alloc.free(b)
    alloc.check_invariants([])
    # b's copies are the cached ones now; evicting them leaves nothing indexed.
    fill = req("e", [8] * 14)
    compute(alloc, fill, 14)
    alloc.check_invariants([fill])
    assert alloc.find_prefix(req("f", prompt)).num_tokens == 0
    alloc.free(fill)


def test_fork_and_copy_on_write():
    alloc = PagedBlockAllocator(num_blocks=10, block_size=4)
    parent = req("p", list(range(6)))
    compute(alloc, parent, 6)
    child = req("c", list(range(6)))
    child.num_computed_tokens = 6
    alloc.fork(parent, child)
    alloc.check_invariants([parent, child])
    shared_last = parent.block_ids[1]
    child.token_ids.append(100)
    assert alloc.allocate_slots(child, 1)
    assert child.block_ids[0] == parent.block_ids[0]
    assert child.block_ids[1] != shared_last
    assert alloc.take_copies() == [(shared_last, child.block_ids[1])]
    assert alloc.take_copies() == []
    alloc.check_invariants([parent, child])
    alloc.free(parent)
    alloc.free(child)
    alloc.check_invariants([])
    assert alloc.num_free_blocks == 9


def test_swap_out_and_in():
    alloc = PagedBlockAllocator(num_blocks=6, block_size=4, num_cpu_blocks=3)
    r = req("r", list(range(10)))
    compute(alloc, r, 10)
    dev = list(r.block_ids)
    mapping = alloc.swap_out(r)
    assert [d for d, _ in mapping] == dev and r.block_ids == [] and len(r.cpu_block_ids) == 3
    assert alloc.stats.blocks_swapped_out == 3 and alloc.stats.blocks_swapped_in == 0
    r.status = RequestStatus.SWAPPED
    alloc.check_invariants([r])
    assert alloc.num_free_blocks == 5 and alloc.num_free_cpu_blocks == 0
    # The swap space is full: another swap-out is refused and changes nothing.
    other = req("o", list(range(100, 104)))
    compute(alloc, other, 4)
    assert alloc.swap_out(other) is None and len(other.block_ids) == 1
    alloc.free(other)
    back = alloc.swap_in(r)
    r.status = RequestStatus.RUNNING
    assert [c for c, _ in back] == [c for _, c in mapping]
    assert r.cpu_block_ids == [] and len(r.block_ids) == 3
    assert alloc.stats.blocks_swapped_out == 3 and alloc.stats.blocks_swapped_in == 3
    alloc.check_invariants([r])
    alloc.free(r)
    alloc.check_invariants([])


def test_swap_refused_when_space_is_short():
    alloc = PagedBlockAllocator(num_blocks=8, block_size=2, num_cpu_blocks=1)
    r = req("r", list(range(5)))
    compute(alloc, r, 5)
    assert alloc.swap_out(r) is None
    assert len(r.block_ids) == 3 and alloc.num_free_cpu_blocks == 1
    alloc.free(r)


def test_invariant_check_catches_a_wrong_owner():
    alloc = PagedBlockAllocator(num_blocks=6, block_size=4)
    r = req("r", list(range(5)))
    compute(alloc, r, 5)
    thief = req("t", [1])
    thief.block_ids = [r.block_ids[0]]
    with pytest.raises(AssertionError, match="ref_count"):
        alloc.check_invariants([r, thief])
    thief.block_ids = []
    alloc.free(r)


def test_invariant_check_catches_a_shared_prefix_block_with_other_tokens():
    # What taking a stale prefix did: a request shares a full cached block of other tokens.
    alloc = PagedBlockAllocator(num_blocks=6, block_size=2)
    r = req("r", [1, 2, 3])
    compute(alloc, r, 3)
    thief = req("t", [7, 8, 9])
    thief.block_ids = [r.block_ids[0]]
    thief.num_computed_tokens = 2
    alloc._blocks[r.block_ids[0]].ref_count += 1
    with pytest.raises(AssertionError, match="t shares block .* other tokens"):
        alloc.check_invariants([r, thief])
    alloc.free(thief)
    alloc.free(r)


def test_invariant_check_catches_a_held_block_in_the_free_queue():
    # The counts still add up: a held block sits in the free queue, a free one is missing from it.
    alloc = PagedBlockAllocator(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a, b = req("a", [1, 2]), req("b", [3, 4])
    compute(alloc, a, 2)
    compute(alloc, b, 2)
    gone = b.block_ids[0]
    alloc.free(b)
    del alloc._free[gone]
    alloc._free[a.block_ids[0]] = None
    with pytest.raises(AssertionError, match="disagrees with the free queue"):
        alloc.check_invariants([a])


def test_invariant_check_catches_a_forked_block_written_without_a_copy():
    alloc = PagedBlockAllocator(num_blocks=8, block_size=4)
    parent, child = req("p", [1, 2, 3]), req("c", [1, 2, 3])
    compute(alloc, parent, 3)
    alloc.fork(parent, child)
    child.num_computed_tokens = 3
    alloc.check_invariants([parent, child])
    child.token_ids.append(9)  # written into the shared partial block with no copy-on-write
    child.num_computed_tokens = 4
    with pytest.raises(AssertionError, match="shared by 2 requests that disagree on its contents"):
        alloc.check_invariants([parent, child])


def test_invariant_check_catches_a_cached_hash_the_index_does_not_know():
    alloc = PagedBlockAllocator(num_blocks=8, block_size=4)
    r = req("r", [1, 2, 3])
    compute(alloc, r, 3)
    alloc._blocks[r.block_ids[0]].hash = 12345
    with pytest.raises(AssertionError, match="neither indexed nor a copy"):
        alloc.check_invariants([r])


def test_the_base_slot_check_refuses_a_write_into_the_null_block_where_the_write_starts():
    # What a plugin allocator inherits: the null block first in the written range.
    from framework.kv.block_allocator import BlockAllocator

    alloc = PagedBlockAllocator(num_blocks=8, block_size=2)
    r = req("r", [1, 2, 3, 4])
    r.block_ids = [NULL_BLOCK, 5]
    with pytest.raises(AssertionError, match="would write into the null block"):
        BlockAllocator.check_slots(alloc, r, 0, 2)
    BlockAllocator.check_slots(alloc, r, 2, 4)
    r.block_ids = []


def test_fits_after_counts_a_hit_on_blocks_only_the_released_requests_hold():
    # Freed with their last holder, those blocks come back to the pool cached, and the hit takes them again.
    alloc = PagedBlockAllocator(num_blocks=5, block_size=2)  # 4 usable blocks
    a = req("a", [1, 2, 3, 4, 5])
    compute(alloc, a, 5)
    b = req("b", [1, 2, 3, 4] + [9] * 6)  # 5 blocks, 2 of them a's
    hit = alloc.find_prefix(b)
    assert hit.num_tokens == 4
    predicted = alloc.fits_after(b, 6, hit, [a])
    alloc.free(a)
    assert predicted == alloc.allocate_slots(b, 6, alloc.find_prefix(b)) is False


@pytest.mark.parametrize("released", [["b"], ["a"], ["a", "b"], ["c"], []])
def test_fits_after_answers_what_allocating_after_the_release_does(released):
    """Shared prefix blocks come free only with their last holder, and a prefix hit on a free
    cached block takes it from the pool: the answer must match what really happens."""
    import copy

    def setup():
        alloc = PagedBlockAllocator(num_blocks=12, block_size=4, enable_prefix_caching=True)
        shared = list(range(100, 108))
        held = {name: req(name, shared + [i] * 3) for i, name in enumerate("ab")}
        held["c"] = req("c", [50] * 9)
        for r in held.values():
            hit = alloc.find_prefix(r)
            compute(alloc, r, r.num_tokens - hit.num_tokens, hit)
        gone = req("gone", [60] * 8)  # finished: its two full blocks stay cached in the free pool
        compute(alloc, gone, 8)
        alloc.free(gone)
        return alloc, held

    probe_alloc, probe_held = setup()
    outcomes = set()
    for size in range(1, 40):
        newcomer = req("new", [60] * 8 + [70] * size)
        prefix = probe_alloc.find_prefix(newcomer)
        predicted = probe_alloc.fits_after(newcomer, newcomer.num_tokens - prefix.num_tokens, prefix,
                                           [probe_held[n] for n in released])
        alloc, held = copy.deepcopy((probe_alloc, probe_held))
        for name in released:
            alloc.free(held[name])
        actual_prefix = alloc.find_prefix(newcomer)
        assert actual_prefix.block_ids == prefix.block_ids
        actual = alloc.allocate_slots(copy.deepcopy(newcomer), newcomer.num_tokens - prefix.num_tokens, actual_prefix)
        assert predicted == actual, f"{size} more tokens, released {released}"
        outcomes.add(actual)
    assert outcomes == {True, False}


@pytest.mark.parametrize("options, heir", [({}, "b"), ({"promote_duplicate": "oldest"}, "b"),
                                           ({"promote_duplicate": "newest"}, "c")])
def test_the_copy_that_takes_an_evicted_blocks_place(options, heir):
    # a, b and c computed the same prompt in one step, in that order: a's blocks are indexed, b's and
    # c's are copies. Once a's are evicted, hits go to the oldest copy (b's), as in vLLM 0.32, or with
    # promote_duplicate="newest" (this allocator before) to c's.
    alloc = PagedBlockAllocator(num_blocks=12, block_size=2, **options)
    prompt = [1, 2, 3, 4, 5]
    reqs = {rid: req(rid, prompt) for rid in "abc"}
    for r in reqs.values():
        compute(alloc, r, 5)
    alloc.free(reqs["a"])
    filler = req("f", [9] * 10)  # takes every free block, a's cached ones last
    compute(alloc, filler, 10)
    alloc.check_invariants([reqs["b"], reqs["c"], filler])
    assert alloc.find_prefix(req("d", prompt)).block_ids == reqs[heir].block_ids[:2]


def test_an_unknown_promote_duplicate_is_refused():
    with pytest.raises(ValueError, match="^promote_duplicate must be one of 'oldest', 'newest', got 'middle'$"):
        PagedBlockAllocator(num_blocks=4, block_size=2, promote_duplicate="middle")


def test_without_prefix_caching_no_lookup_is_counted():
    """vLLM's hit rate counts lookups, and with caching off none is made: no queries, so no 0% hit rate."""
    alloc = PagedBlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
    for rid in "ab":
        compute(alloc, req(rid, list(range(10))), 10)
    assert (alloc.stats.prefix_query_tokens, alloc.stats.prefix_hit_tokens) == (0, 0)


def test_a_freed_requests_uncached_blocks_come_back_tail_first():
    """As vLLM's BlockPool.free_blocks: a freed request's blocks go back tail first, so its uncached tail block is
    the next handed out (its cached blocks queue for eviction, the tail first)."""
    alloc = PagedBlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(10)))
    compute(alloc, a, 10)
    assert a.block_ids == [1, 2, 3]
    alloc.free(a)
    b = req("b", list(range(50, 60)))
    compute(alloc, b, 10)
    assert b.block_ids == [3, 2, 1]
