"""Paged KV blocks: reference counts, hash-chained prefix cache, LRU eviction, CPU swap (vLLM's, seed 003)."""
from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from framework.kv.block_allocator import ALLOCATORS, NULL_BLOCK, BlockAllocator, PrefixHit
from framework.common.request import Request, RequestStatus

_ROOT_HASH = -1
#: ``promote_duplicate``'s values: the index in the copies list (oldest first) of the one promoted.
PROMOTE_DUPLICATE = {"oldest": 0, "newest": -1}


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


def _root_hash(request: Request) -> int:
    """The parent of a request's first block: its ``cache_salt``'s, so that only requests of one salt share blocks."""
    return _ROOT_HASH if request.cache_salt is None else hash((_ROOT_HASH, request.cache_salt))


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained through its parent so equal hashes imply equal prefixes
    (up to collisions, which ``find_prefix`` rules out by comparing tokens)."""
    return hash((parent_hash, token_ids))


@ALLOCATORS.register("paged")
class PagedBlockAllocator(BlockAllocator):
    """Free blocks wait in one LRU queue: never-cached blocks at the front (handed out first),
    cached ones appended as they are freed, so the least recently used cached block is evicted
    first. A request's blocks are freed tail first, keeping shared prefix heads longest.
    Blocks never handed out are made on first use (ids in order, after the queue's never-cached
    front), so a pool of millions of blocks costs nothing until it fills.

    Several blocks may cache one hash (requests that computed the same prefix in one step); hits use the
    one indexed, the first cached. When it is evicted, ``promote_duplicate`` picks which copy takes its
    place: ``"oldest"`` (as vLLM 0.32's ``BlockHashToBlockMap``) or ``"newest"`` (this allocator before)."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, promote_duplicate: str = "oldest") -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching)
        self.check_option_values(promote_duplicate=promote_duplicate)
        self._promote_index = PROMOTE_DUPLICATE[promote_duplicate]
        #: Blocks handed out at least once, by id; the rest (ids len(_blocks) and up) are fresh.
        self._blocks = [_Block(NULL_BLOCK)]
        #: Free blocks handed out before: never-cached (or uncached) ones first, then cached, LRU.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        #: Further blocks caching a hash already indexed (requests that computed the same prefix
        #: in one step, or a swapped-in one's), oldest first: one of them takes the index when the
        #: indexed block is evicted, or its hits would be lost while a copy still lives.
        self._hash_copies: dict[int, list[int]] = {}
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self._copies: list[tuple[int, int]] = []
        self._forked = False  # whether fork() ever shared blocks (see decode_run_blocks)

    @classmethod
    def check_option_values(cls, promote_duplicate: str = "oldest", **others: Any) -> None:
        super().check_option_values(**others)  # a subclass's own options
        if promote_duplicate not in PROMOTE_DUPLICATE:
            raise ValueError(f"promote_duplicate must be one of {', '.join(map(repr, PROMOTE_DUPLICATE))}, "
                             f"got {promote_duplicate!r}")

    # -- capacity --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self._blocks)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for b in self._free if self._blocks[b].hash is not None)

    # -- prefix cache ----------------------------------------------------------------------------
    def _request_hashes(self, request: Request, num_blocks: int) -> list[int]:
        # Full-block hashes never change (tokens are only appended), so they are cached on the
        # request and extended on demand.
        hashes = request.block_hashes
        bs, tokens = self.block_size, request.token_ids
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else _root_hash(request)
            hashes.append(block_hash(parent, tuple(tokens[i * bs:(i + 1) * bs])))
        return hashes

    def find_prefix(self, request: Request) -> PrefixHit:
        if not self.enable_prefix_caching or request.block_ids:
            return PrefixHit()
        bs, tokens, hashes = self.block_size, request.token_ids, request.block_hashes
        # At least one token must be computed to produce logits, so never match the last token.
        max_blocks = (len(tokens) - 1) // bs
        hit: list[int] = []
        # Hashes are extended only as far as the search goes (sealing computes the rest), and
        # each block's token tuple serves both its hash and the collision check.
        index, blocks = self._hash_to_block, self._blocks
        for i in range(max_blocks):
            toks = tuple(tokens[i * bs:(i + 1) * bs])
            if i < len(hashes):
                h = hashes[i]
            else:
                h = block_hash(hashes[i - 1] if i else _root_hash(request), toks)
                hashes.append(h)
            bid = index.get(h)
            if bid is None or blocks[bid].token_ids != toks:
                break
            hit.append(bid)
        return PrefixHit(hit, len(hit) * bs)

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        bs, blocks = self.block_size, self._blocks
        prefix_ids = prefix.block_ids if prefix else []
        prefix_tokens = prefix.num_tokens if prefix else 0
        held = request.block_ids
        if prefix_ids and held:
            raise ValueError(f"{request.request_id}: a prefix can only be taken by a request holding no blocks")
        start = request.num_computed_tokens + prefix_tokens
        total = start + num_new_tokens
        # Writing into a partially filled block that others share needs a private copy first.
        cow = (num_new_tokens > 0 and start % bs != 0 and start // bs < len(held)
               and blocks[held[start // bs]].ref_count > 1)
        if held and total <= len(held) * bs and not cow:
            # Its blocks take the new tokens (a decode, 31 steps in 32 at block size 32): nothing to take.
            if self.enable_prefix_caching and total // bs > min(start // bs, len(request.block_hashes)):
                self._seal(request, start // bs, total // bs)
            return True
        num_new_blocks = self._new_blocks(request, num_new_tokens, prefix)
        reclaimed = 0
        if prefix_ids:
            # A prefix goes stale once an allocation since find_prefix evicted one of its blocks
            # (a policy that looks up several prefixes, then admits): that block now holds other
            # tokens, or none, and taking it would silently corrupt the KV cache.
            hashes = self._request_hashes(request, len(prefix_ids))
            for i, bid in enumerate(prefix_ids):
                if blocks[bid].hash != hashes[i]:
                    raise ValueError(f"{request.request_id}: prefix block {bid} was evicted since find_prefix; "
                                     f"find the prefix again right before scheduling with it")
                if blocks[bid].ref_count == 0:
                    reclaimed += 1
        if num_new_blocks + cow + reclaimed > self.num_free_blocks:
            return False
        first_allocation = not request.block_ids and request.num_computed_tokens == 0

        if prefix_ids:
            free = self._free
            for bid in prefix_ids:  # runs for every cached block a request reuses
                block = blocks[bid]
                if block.ref_count == 0:
                    del free[bid]
                block.ref_count += 1
            request.block_ids.extend(prefix_ids)
        if cow:
            idx = start // bs
            src = request.block_ids[idx]
            dst = self._take_free()
            self._blocks[src].ref_count -= 1
            request.block_ids[idx] = dst
            self._copies.append((src, dst))
            self.stats.cow_copies += 1
        if num_new_blocks:
            request.block_ids += self._pop_free_blocks(num_new_blocks)
        # A lookup counts where one was made, as vLLM's hit rate: caching on, a request that reads the cache.
        looked_up = first_allocation and self.enable_prefix_caching and request.reads_prefix_cache
        if looked_up and request.num_preemptions:
            self.stats.preempted_query_tokens += request.num_tokens
            self.stats.preempted_hit_tokens += prefix_tokens
        elif looked_up:
            self.stats.prefix_query_tokens += request.num_tokens
            self.stats.prefix_hit_tokens += prefix_tokens
        if self.enable_prefix_caching:
            self._seal(request, start // bs, total // bs)
        return True

    def fits_after(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None,
                   released: Sequence[Request]) -> bool:
        # A released block comes free only if the released requests hold all its references; a
        # prefix block that is (or comes) free is taken from the pool too (allocate_slots'
        # "reclaimed"). No copy-on-write: the policies ask this for requests holding no blocks.
        held = Counter(bid for req in released for bid in req.block_ids)
        blocks = self._blocks
        freed = sum(1 for bid, n in held.items() if blocks[bid].ref_count == n)
        reclaimed = sum(1 for bid in prefix.block_ids if blocks[bid].ref_count == held.get(bid, 0)) if prefix else 0
        return self._new_blocks(request, num_new_tokens, prefix) + reclaimed <= self.num_free_blocks + freed

    # -- decode runs (framework.sim.fast_forward.DecodeRunAllocator) ----------------------------
    def decode_run_blocks(self, requests: Sequence[Request], num_steps: int) -> int | None:
        """The fast-forward protocol's bound on the blocks a decode run takes (None: not now)."""
        # A one-token step allocates only when it starts a block and copies only into a shared partial
        # block, which only fork() makes (prefix hits are full blocks): without a fork, one block per
        # request per bs steps bounds the run without visiting the requests.
        bs, blocks = self.block_size, self._blocks
        bound = len(requests) * -(-num_steps // bs)
        if not self._forked and bound <= self.num_free_blocks:
            return bound
        needed = 0
        for req in requests:
            held = req.block_ids
            start = req.num_computed_tokens
            if start % bs and blocks[held[start // bs]].ref_count > 1:
                return None
            n = (start + num_steps + bs - 1) // bs - len(held)
            if n > 0:
                needed += n
        return needed

    def allocate_decode_run(self, requests: Sequence[Request], num_steps: int, track: bool = False,
                            active: Sequence[int] | None = None,
                            pauses: Mapping[int, Callable[[], None]] | None = None) -> list[int]:
        """The fast-forward protocol's decode run: ``fast_forward.replay_decode_run``'s effect, event by event."""
        bs = self.block_size
        # events[j]: step j's events in request order: (request, -1) takes a fresh block (the step starts
        # one), (request, i) seals block i (the step fills it); a start precedes a fill in the same step
        # (block_size 1), as in allocate_slots.
        events: defaultdict[int, list[tuple[Request, int]]] = defaultdict(list)
        caching = self.enable_prefix_caching
        for k, req in enumerate(requests):
            computed = req.num_computed_tokens
            last = num_steps if active is None else active[k]
            j = len(req.block_ids) * bs - computed + 1
            while j <= last:
                events[j].append((req, -1))
                j += bs
            if caching:
                j = (-computed) % bs or bs
                while j <= last:
                    events[j].append((req, (computed + j) // bs - 1))
                    j += bs
        steps = sorted(events.keys() | pauses.keys()) if pauses else sorted(events)
        in_use = self.num_used_blocks
        used: list[int] = []
        done = 0
        # A long run has two events per request per block_size steps: taking one free block and
        # sealing the block right after the last one hashed (_seal's loop for one new block, inlined).
        take, blocks, index = self._take_free, self._blocks, self._hash_to_block
        for j in steps:
            if track:
                used.extend([in_use] * (j - 1 - done))
            for req, i in events.get(j, ()):
                if i < 0:
                    req.block_ids.append(take())
                    in_use += 1
                elif len(hashes := req.block_hashes) == i:
                    toks = tuple(req.token_ids[i * bs:(i + 1) * bs])
                    h = block_hash(hashes[i - 1] if i else _root_hash(req), toks)
                    hashes.append(h)
                    block = blocks[req.block_ids[i]]
                    if block.hash is None:
                        block.hash = h
                        block.token_ids = toks
                        if index.setdefault(h, bid := block.block_id) != bid:
                            self._hash_copies.setdefault(h, []).append(bid)
                else:
                    self._seal(req, i, i + 1)
            if pauses and j in pauses:
                pauses[j]()
                in_use = self.num_used_blocks
            if track:
                used.append(in_use)
            done = j
        if track:
            used.extend([in_use] * (num_steps - done))
        return used

    def _seal(self, request: Request, first: int, end: int) -> None:
        """Make full blocks [first, end) findable by later requests; one ending in a placeholder (async
        scheduling) waits for a later call, which starts at the first block not yet hashed."""
        bs, tokens, blocks = self.block_size, request.token_ids, self._blocks
        hashes = request.block_hashes
        if request.num_placeholders:
            end = min(end, (len(tokens) - request.num_placeholders) // bs)
        first = min(first, len(hashes))
        if end <= first:
            return
        # Hashes of blocks not yet hashed are computed here rather than by _request_hashes, so
        # each block's token tuple is built once (this runs for every block every request fills).
        block_ids, index = request.block_ids, self._hash_to_block
        for i in range(first, end):
            block = blocks[block_ids[i]]
            if i < len(hashes):
                if block.hash is not None:
                    continue
                h, toks = hashes[i], tuple(tokens[i * bs:(i + 1) * bs])
            else:
                toks = tuple(tokens[i * bs:(i + 1) * bs])
                h = block_hash(hashes[i - 1] if i else _root_hash(request), toks)
                hashes.append(h)
                if block.hash is not None:
                    continue
            block.hash = h
            block.token_ids = toks
            if index.setdefault(h, bid := block.block_id) != bid:
                self._hash_copies.setdefault(h, []).append(bid)

    def _pop_free_blocks(self, num: int) -> list[int]:
        """Take ``num`` free blocks in the queue's order, evicting what they cache."""
        take = self._take_free
        return [take() for _ in range(num)]

    def _take_free(self) -> int:
        """The next free block, held once: the queue's never-cached front, else a fresh block, else
        the least recently used cached block (its cache entry evicted)."""
        free, blocks = self._free, self._blocks
        bid = next(iter(free), None)
        if bid is None or (blocks[bid].hash is not None and len(blocks) < self.num_blocks):
            block = _Block(len(blocks))
            blocks.append(block)
        else:
            del free[bid]
            block = blocks[bid]
            if block.hash is not None:
                self._evict(block)
        block.ref_count = 1
        return block.block_id

    def _evict(self, block: _Block) -> None:
        """Forget what a free block caches, as it is taken for new tokens."""
        self._unindex(block)
        self.stats.evictions += 1

    def _unindex(self, block: _Block) -> None:
        """Forget what a cached block holds: out of the prefix index, its hash cleared."""
        h, bid = block.hash, block.block_id
        copies = self._hash_copies.get(h)
        if copies is not None and bid in copies:
            copies.remove(bid)
        elif copies is not None:  # the indexed block goes: a copy takes its place
            self._hash_to_block[h] = copies.pop(self._promote_index)
        elif self._hash_to_block.get(h) == bid:
            del self._hash_to_block[h]
        if copies is not None and not copies:
            del self._hash_copies[h]
        block.hash = block.token_ids = None

    def _release_all(self, request: Request) -> None:
        """Drop ``request``'s reference to each of its blocks; a block no one holds goes back to the free
        queue, the tail first, as vLLM's: a cached one at the end (the tail is evicted first), an uncached
        one at the front (the tail handed out first)."""
        blocks, free = self._blocks, self._free
        uncached = []
        for bid in reversed(request.block_ids):
            block = blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                free[bid] = None
                if block.hash is None:
                    uncached.append(bid)
        for bid in reversed(uncached):
            free.move_to_end(bid, last=False)
        request.block_ids = []

    def free(self, request: Request) -> None:
        if self.enable_prefix_caching and request.block_ids:
            # Full blocks whose last token was a placeholder when computed (async scheduling) are sealed
            # now: the request may not allocate again. Otherwise a no-op: sealed when allocated. Not the
            # block a step still in flight computes (a preemption or abort with a token in flight): vLLM
            # caches a block once the step computing it has given its output to a running request.
            done = request.num_computed_tokens - request.num_placeholders
            self._seal(request, len(request.block_hashes), done // self.block_size)
        self._release_all(request)
        if request.cpu_block_ids:
            self._cpu_free.extend(request.cpu_block_ids)
            request.cpu_block_ids = []

    def fork(self, parent: Request, child: Request) -> None:
        if child.block_ids:
            raise ValueError(f"{child.request_id}: cannot fork into a request that already holds blocks")
        for bid in parent.block_ids:
            self._blocks[bid].ref_count += 1
        child.block_ids = list(parent.block_ids)
        self._forked = True

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def uncache(self, block_ids: Iterable[int]) -> None:
        blocks, free = self._blocks, self._free
        for bid in block_ids:
            block = blocks[bid]
            if block.hash is not None:
                self._unindex(block)
                if block.ref_count == 0:  # free: handed out before cached blocks, as never-cached ones are
                    free.move_to_end(bid, last=False)

    # -- swap ------------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        if len(request.block_ids) > len(self._cpu_free):
            return None
        mapping = [(bid, self._cpu_free.pop()) for bid in request.block_ids]
        self._release_all(request)
        request.cpu_block_ids = [cpu for _, cpu in mapping]
        self.stats.blocks_swapped_out += len(mapping)
        return mapping

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        if len(request.cpu_block_ids) > self.num_free_blocks:
            return None
        mapping = [(cpu, self._take_free()) for cpu in request.cpu_block_ids]
        request.block_ids = [dev for _, dev in mapping]
        self._cpu_free.extend(request.cpu_block_ids)
        request.cpu_block_ids = []
        self.stats.blocks_swapped_in += len(mapping)
        if self.enable_prefix_caching:
            self._seal(request, 0, request.num_computed_tokens // self.block_size)
        return mapping

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self, requests: Iterable[Request]) -> None:
        owners: Counter[int] = Counter()
        contents: dict[int, set[tuple[int, tuple[int, ...]]]] = {}
        cpu_owners: Counter[int] = Counter()
        for req in requests:
            if req.status == RequestStatus.SWAPPED:
                assert not req.block_ids, f"{req.request_id} is swapped but holds device blocks {req.block_ids}"
            assert NULL_BLOCK not in req.block_ids, f"{req.request_id} holds the null block"
            owners.update(req.block_ids)
            cpu_owners.update(req.cpu_block_ids)
            bs, computed = self.block_size, req.num_computed_tokens
            for i, bid in enumerate(req.block_ids):
                block = self._blocks[bid]
                if block.ref_count > 1:
                    tokens = tuple(req.token_ids[i * bs:min((i + 1) * bs, computed)])
                    contents.setdefault(bid, set()).add((i, tokens))
                    # A shared full prefix block holds the same tokens for every holder.
                    assert block.hash is None or block.token_ids == tuple(req.token_ids[i * bs:(i + 1) * bs]), (
                        f"{req.request_id} shares block {bid} at position {i}, which caches other tokens")
        for block in self._blocks[1:]:
            held = owners.get(block.block_id, 0)
            assert block.ref_count == held, (
                f"block {block.block_id}: ref_count {block.ref_count} but held by {held} request(s)")
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: ref_count {block.ref_count} disagrees with the free queue")
            # Sharing is legal for a full prefix block (hashed), or for a block that every holder
            # sees at the same position with the same computed tokens (a fork before copy-on-write).
            assert held < 2 or block.hash is not None or len(contents[block.block_id]) == 1, (
                f"block {block.block_id} is shared by {held} requests that disagree on its contents")
        used = sum(1 for b in self._blocks[1:] if b.ref_count > 0)
        # Cached blocks are free blocks that still hold a hash, so this counts them once.
        assert len(self._blocks) <= self.num_blocks, f"{len(self._blocks)} blocks made of a pool of {self.num_blocks}"
        assert used + self.num_free_blocks == self.num_usable_blocks, "free + used + cached != total device blocks"
        assert NULL_BLOCK not in self._free, "the null block is in the free queue"
        for h, bid in self._hash_to_block.items():
            assert self._blocks[bid].hash == h, f"prefix index points block {bid} at a stale hash"
        for h, copies in self._hash_copies.items():
            assert copies and h in self._hash_to_block, f"copies of hash {h} without an indexed block"
            assert all(self._blocks[b].hash == h for b in copies), f"a copy of hash {h} caches another hash"
        hashed = sum(1 for b in self._blocks[1:] if b.hash is not None)
        assert hashed == len(self._hash_to_block) + sum(map(len, self._hash_copies.values())), (
            "a cached block is neither indexed nor a copy of an indexed one")
        assert all(n == 1 for n in cpu_owners.values()), "a swap block is held by two requests"
        assert len(set(self._cpu_free)) == len(self._cpu_free), "a swap block is free twice"
        assert not set(cpu_owners) & set(self._cpu_free), "a held swap block is also free"
        assert len(cpu_owners) + len(self._cpu_free) == self.num_cpu_blocks, "free + used != total swap blocks"

    def check_slots(self, request: Request, start: int, end: int) -> None:
        super().check_slots(request, start, end)
        bs = self.block_size
        for i in range(start // bs, -(-end // bs)):
            block = self._blocks[request.block_ids[i]]
            assert block.ref_count >= 1, f"{request.request_id} writes into block {block.block_id}, which is free"
            # A shared block may only be rewritten with what it already holds: a full prefix block
            # whose tokens are this request's (another request took it as a prefix this step).
            assert block.ref_count == 1 or block.token_ids == tuple(request.token_ids[i * bs:(i + 1) * bs]), (
                f"{request.request_id} writes into block {block.block_id}, shared by {block.ref_count} requests")
