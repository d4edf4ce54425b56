"""A model-based check of the paged allocator as a scheduler drives it: random admissions (with
and without prefix hits, several in one step), chunked prefills, decodes, forks, swaps, frees,
failed steps (``uncache``) and decode runs, against a reference written here.

The reference is the KV itself: each slot a step writes holds the token ids up to and including
its position (what a transformer's K and V depend on). Copies (swap out, swap in, copy-on-write)
move slots as the executor would, so any block shared wrongly, freed while held, or handed out
by a prefix hit with other tokens shows up as a request reading a slot that holds another
prefix. Next to it: which full blocks may be found (the longest run of the request's blocks
that some cached block holds), the documented eviction order (never-cached free blocks first,
then cached ones least recently freed first, a request's tail first), and the free, cached and
swap counts."""
from __future__ import annotations

import copy

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from framework.kv.allocators.paged import PagedBlockAllocator
from framework.kv.block_allocator import PrefixHit
from framework.sim.fast_forward import replay_decode_run
from framework.common.request import Request, RequestStatus
from framework.common.sampling_params import SamplingParams

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 60], [70, 71, 72, 73, 74, 75, 76, 77]]


class AllocatorModel(RuleBasedStateMachine):
    @initialize(bs=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(4, 24), num_cpu=st.integers(0, 12),
                caching=st.booleans())
    def setup(self, bs, num_blocks, num_cpu, caching):
        self.alloc = PagedBlockAllocator(num_blocks, bs, num_cpu, enable_prefix_caching=caching)
        self.bs = bs
        self.caching = caching
        self.kv: dict[int, list] = {b: [None] * bs for b in range(num_blocks)}
        self.cpu_kv: dict[int, list] = {b: [None] * bs for b in range(num_cpu)}
        self.uncached: set[int] = set()  # blocks a failed step left unfindable
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.ids = 0
        self.clock = 0
        self.free_time: dict[int, int] = {b: -1 for b in range(1, num_blocks)}

    # -- reference helpers -------------------------------------------------------------------------
    def new_request(self, tokens):
        self.ids += 1
        r = Request(f"r{self.ids}", list(tokens), SamplingParams(), arrival_time=0.0)
        r.status = RequestStatus.RUNNING
        return r

    def held(self):
        return {b for r in self.running for b in r.block_ids}

    def full(self, b):
        return all(s is not None for s in self.kv[b])

    def findable(self, b):
        return self.caching and b not in self.uncached and self.full(b)

    def expected_hit_blocks(self, tokens):
        """How many of the request's first blocks some findable block holds, in a row."""
        bs, n = self.bs, 0
        last = {tuple(self.kv[b][-1]) for b in range(1, self.alloc.num_blocks) if self.findable(b)}
        while n < (len(tokens) - 1) // bs and tuple(tokens[:(n + 1) * bs]) in last:
            n += 1
        return n

    def snapshot(self):
        """The free blocks in the documented eviction order: never-cached ones first (any order),
        then cached ones, least recently freed first."""
        free = [b for b in range(1, self.alloc.num_blocks) if b not in self.held()]
        cached = sorted((b for b in free if self.findable(b)), key=self.free_time.__getitem__)
        return [b for b in free if not self.findable(b)], cached

    def check_taken(self, before, taken, reclaimed=()):
        uncached, cached = before
        cached = [b for b in cached if b not in reclaimed]
        k = len(taken) - len(set(taken) & set(uncached))
        if k:
            assert set(uncached) <= set(taken), f"cached blocks evicted while uncached ones were free: {taken}"
        assert set(taken) - set(uncached) == set(cached[:k]), (
            f"evicted {sorted(set(taken) - set(uncached))}, but the least recently freed cached blocks are {cached[:k]}")

    def note_freed(self, order):
        """Blocks no one holds any more, stamped in the order they were given back."""
        now = self.held()
        for b in order:
            if b not in now:
                self.clock += 1
                self.free_time[b] = self.clock

    def write(self, r, start, end):
        for p in range(start, end):
            self.kv[r.block_ids[p // self.bs]][p % self.bs] = tuple(r.token_ids[:p + 1])

    def apply_copies(self):
        for src, dst in self.alloc.take_copies():
            self.kv[dst] = list(self.kv[src])
            self.uncached.discard(dst)

    def take_fresh(self, blocks):
        for b in blocks:
            self.kv[b] = [None] * self.bs
            self.uncached.discard(b)

    def allocate(self, r, n, prefix=None):
        """allocate_slots as the scheduler calls it; the step's writes are left to the caller."""
        before_ids, before_free = list(r.block_ids), self.alloc.num_free_blocks
        order = self.snapshot()
        free_before = set(order[0]) | set(order[1])
        ok = self.alloc.allocate_slots(r, n, prefix)
        if not ok:
            assert r.block_ids == before_ids and self.alloc.num_free_blocks == before_free
            assert self.alloc.take_copies() == []
            return False
        hit = set(prefix.block_ids) if prefix else set()
        taken = [b for b in r.block_ids if b in free_before and b not in hit]
        self.check_taken(order, taken, hit)
        self.take_fresh(taken)
        self.apply_copies()
        return True

    # -- rules ---------------------------------------------------------------------------------------
    @rule(data=st.data())
    def admit(self, data):
        tokens = data.draw(st.sampled_from(BASES))[:data.draw(st.integers(0, 10))]
        tokens = tokens + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=8))
        r = self.new_request(tokens)
        prefix = self.find(r) if data.draw(st.booleans()) else PrefixHit()
        n = data.draw(st.integers(1, len(tokens) - prefix.num_tokens))
        if self.allocate(r, n, prefix):
            r.num_computed_tokens = prefix.num_tokens
            self.write(r, prefix.num_tokens, prefix.num_tokens + n)
            r.num_computed_tokens += n
            self.running.append(r)

    def find(self, r):
        hit = self.alloc.find_prefix(r)
        assert hit.num_tokens == len(hit.block_ids) * self.bs
        for i, b in enumerate(hit.block_ids):
            assert self.kv[b] == [tuple(r.token_ids[:p + 1]) for p in range(i * self.bs, (i + 1) * self.bs)], (
                f"prefix hit block {b} holds other tokens")
        assert len(hit.block_ids) == self.expected_hit_blocks(r.token_ids), (
            f"hit {len(hit.block_ids)} blocks, {self.expected_hit_blocks(r.token_ids)} are cached")
        return hit

    @rule(data=st.data())
    def admit_two_in_one_step(self, data):
        """Two requests with a common start admitted in one step: the second may hit the first's
        blocks sealed at allocation, before the step writes them."""
        base = data.draw(st.sampled_from(BASES))
        a = self.new_request(base + data.draw(st.lists(st.integers(0, 3), max_size=3)))
        b = self.new_request(base + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
        if not self.allocate(a, len(a.token_ids)):
            return
        hit = self.alloc.find_prefix(b)
        for i, blk in enumerate(hit.block_ids):
            assert blk in a.block_ids or self.kv[blk][-1] == tuple(b.token_ids[:(i + 1) * self.bs])
        self.write(a, 0, len(a.token_ids))
        a.num_computed_tokens = len(a.token_ids)
        self.running.append(a)
        if self.allocate(b, len(b.token_ids) - hit.num_tokens, hit):
            b.num_computed_tokens = hit.num_tokens
            self.write(b, hit.num_tokens, len(b.token_ids))
            b.num_computed_tokens = len(b.token_ids)
            self.running.append(b)

    @rule(data=st.data())
    def fits_after(self, data):
        """What a policy asks before preempting: would the request fit once these were released?"""
        tokens = data.draw(st.sampled_from(BASES)) + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=8))
        r = self.new_request(tokens)
        prefix = self.find(r) if data.draw(st.booleans()) else PrefixHit()
        released = data.draw(st.lists(st.sampled_from(self.running), unique_by=id)) if self.running else []
        n = data.draw(st.integers(1, len(tokens) - prefix.num_tokens))
        answer = self.alloc.fits_after(r, n, prefix, released)
        alloc, r2, released2, prefix2 = copy.deepcopy((self.alloc, r, released, prefix))
        for victim in released2:
            alloc.free(victim)
        assert answer == alloc.allocate_slots(r2, n, prefix2)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def compute(self, data):
        """A chunk of a prefill, or a decode (the sampled token appended first)."""
        r = data.draw(st.sampled_from(self.running))
        if r.num_computed_tokens == len(r.token_ids):
            r.token_ids.append(data.draw(st.integers(0, 3)))
        n = data.draw(st.integers(1, len(r.token_ids) - r.num_computed_tokens))
        if self.allocate(r, n):
            self.write(r, r.num_computed_tokens, r.num_computed_tokens + n)
            r.num_computed_tokens += n
        elif data.draw(st.booleans()):
            self.free(r)  # preempted by recompute

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def failed_step(self, data):
        """The executor failed on a step: what it was to write leaves the prefix cache, and the
        request is freed to be recomputed (``Scheduler.step_failed``)."""
        r = data.draw(st.sampled_from(self.running))
        if r.num_computed_tokens == len(r.token_ids):
            r.token_ids.append(data.draw(st.integers(0, 3)))
        n = data.draw(st.integers(1, len(r.token_ids) - r.num_computed_tokens))
        if self.allocate(r, n):
            written = r.block_ids[r.num_computed_tokens // self.bs:]
            self.alloc.uncache(written)
            self.uncached |= set(written)
            self.free(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self.free(data.draw(st.sampled_from(self.running)))

    def free(self, r):
        order = list(reversed(r.block_ids))
        self.alloc.free(r)
        self.running.remove(r)
        self.note_freed(order)

    def at_end(self):
        return [r for r in self.running if r.num_computed_tokens == len(r.token_ids)]

    @precondition(lambda self: self.at_end())
    @rule(data=st.data())
    def fork(self, data):
        """v0's fork of a request whose prompt is computed; the two then diverge."""
        parent = data.draw(st.sampled_from(self.at_end()))
        child = self.new_request(parent.token_ids)
        self.alloc.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        r = data.draw(st.sampled_from(self.running))
        order = list(reversed(r.block_ids))
        free_cpu = self.alloc.num_free_cpu_blocks
        mapping = self.alloc.swap_out(r)
        if mapping is None:
            assert free_cpu < len(order) and r.block_ids
            return
        for dev, cpu in mapping:
            self.cpu_kv[cpu] = list(self.kv[dev])
        r.status = RequestStatus.SWAPPED
        self.running.remove(r)
        self.swapped.append(r)
        self.note_freed(order)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        r = data.draw(st.sampled_from(self.swapped))
        order = self.snapshot()
        mapping = self.alloc.swap_in(r)
        if mapping is None:
            assert len(r.cpu_block_ids) > self.alloc.num_free_blocks
            return
        self.check_taken(order, [dev for _, dev in mapping])
        for cpu, dev in mapping:
            self.kv[dev] = list(self.cpu_kv[cpu])
            self.uncached.discard(dev)
        r.status = RequestStatus.RUNNING
        self.swapped.remove(r)
        self.running.append(r)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def abort_swapped(self, data):
        r = data.draw(st.sampled_from(self.swapped))
        self.alloc.free(r)
        assert not r.cpu_block_ids
        self.swapped.remove(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode_run(self, data):
        """The simulator's fast-forward: ``num_steps`` decode steps at once, one request finishing
        at a pause, equal to replaying ``allocate_slots(request, 1)`` step by step."""
        reqs = [r for r in self.running if r.num_computed_tokens == len(r.token_ids)]
        if not reqs:
            return
        steps = data.draw(st.integers(1, 3 * self.bs + 1))
        for r in reqs:
            r.token_ids.append(data.draw(st.integers(0, 3)))  # sampled by the last step
        need = self.alloc.decode_run_blocks(reqs, steps)
        if need is None or need > self.alloc.num_free_blocks:
            for r in reqs:
                r.token_ids.pop()
            return
        for r in reqs:
            r.token_ids.extend(data.draw(st.lists(st.integers(0, 3), min_size=steps - 1, max_size=steps - 1)))
        quit_k = data.draw(st.integers(0, len(reqs) - 1))
        quit_at = data.draw(st.integers(1, steps))
        active = [quit_at if k == quit_k else steps for k in range(len(reqs))]
        twin_alloc, twin_reqs = copy.deepcopy((self.alloc, reqs))
        order = {}

        def pause(alloc, victim, record):
            def finish():
                if record:
                    order["tail"] = list(reversed(victim.block_ids))
                alloc.free(victim)
            return finish

        before = self.snapshot()
        free_before = set(before[0]) | set(before[1])
        used = self.alloc.allocate_decode_run(reqs, steps, track=True, active=active,
                                              pauses={quit_at: pause(self.alloc, reqs[quit_k], True)})
        replayed = replay_decode_run(twin_alloc, twin_reqs, steps, track=True, active=active,
                                                      pauses={quit_at: pause(twin_alloc, twin_reqs[quit_k], False)})
        assert used == replayed
        assert [r.block_ids for r in reqs] == [r.block_ids for r in twin_reqs]
        assert list(self.alloc._free) == list(twin_alloc._free)
        assert self.alloc._hash_to_block == twin_alloc._hash_to_block
        assert self.alloc._hash_copies == twin_alloc._hash_copies
        quitter = reqs[quit_k]
        # The reference: write what each request computed; the quitter's blocks went back at its
        # pause, after its last allocation (its slots are written before it is freed).
        for r in [quitter] + [r for r in reqs if r is not quitter]:  # its blocks may be reused
            blocks = list(reversed(order["tail"])) if r is quitter else r.block_ids
            self.take_fresh(b for b in blocks if b in free_before)
            n = quit_at if r is quitter else steps
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                self.kv[blocks[p // self.bs]][p % self.bs] = tuple(r.token_ids[:p + 1])
            r.num_computed_tokens += n
        self.running.remove(quitter)
        self.note_freed(order["tail"])

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def books_agree(self):
        if not hasattr(self, "alloc"):
            return
        alloc, bs = self.alloc, self.bs
        live = self.running + self.swapped
        alloc.check_invariants(live)
        for r in self.running:
            for p in range(r.num_computed_tokens):
                assert self.kv[r.block_ids[p // bs]][p % bs] == tuple(r.token_ids[:p + 1]), (
                    f"{r.request_id} reads position {p} from block {r.block_ids[p // bs]}, which holds other KV")
        for r in self.swapped:
            assert len(r.cpu_block_ids) == -(-r.num_computed_tokens // bs)
            for p in range(r.num_computed_tokens):
                assert self.cpu_kv[r.cpu_block_ids[p // bs]][p % bs] == tuple(r.token_ids[:p + 1])
        held = self.held()
        assert alloc.num_free_blocks == alloc.num_usable_blocks - len(held)
        free = set(range(1, alloc.num_blocks)) - held
        assert alloc.num_cached_blocks == sum(1 for b in free if self.findable(b))
        assert alloc.num_free_cpu_blocks == alloc.num_cpu_blocks - sum(len(r.cpu_block_ids) for r in self.swapped)


# The profile's example count (tests/conftest.py: "ci" by default, "long" for 3,000), 40 rules each.
AllocatorModel.TestCase.settings = settings(settings(), stateful_step_count=40)
test_paged_allocator_matches_the_model = AllocatorModel.TestCase
