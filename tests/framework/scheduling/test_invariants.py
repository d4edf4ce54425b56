"""``check_invariants`` catches an allocator that shares or leaks blocks whatever its class: the books of a
plugin allocator that keeps no reference counts are checked against what the live requests hold."""
from types import SimpleNamespace

import pytest

from framework import ALLOCATORS, LLM, SamplingParams
from framework.kv.block_allocator import BlockAllocator, PrefixHit
from framework.scheduling.invariants import check_block_holders


class FreeList(BlockAllocator):
    """A plain free list written to the ``BlockAllocator`` contract (no prefix cache, no forks, no swap); ``bug``:
    "share" hands the same blocks to every request."""

    bug = ""

    def __init__(self, num_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=True):
        super().__init__(num_blocks, block_size, num_cpu_blocks, False)
        self._free = list(range(num_blocks - 1, 0, -1))
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))

    num_free_blocks = property(lambda self: len(self._free))
    num_free_cpu_blocks = property(lambda self: len(self._cpu_free))
    num_cached_blocks = property(lambda self: 0)

    def find_prefix(self, request):
        return PrefixHit()

    def allocate_slots(self, request, num_new_tokens, prefix=None):
        n = self._new_blocks(request, num_new_tokens, prefix)
        if n > len(self._free):
            return False
        new = self._free[-n:] if self.bug == "share" and n > 1 else [self._free.pop() for _ in range(n)]
        request.block_ids.extend(new)
        return True

    def free(self, request):
        kept = request.block_ids[-1:] if self.bug == "leak" else []  # a leak: its last block never comes back
        self._free.extend(b for b in request.block_ids if b not in self._free and b not in kept)
        self._cpu_free.extend(request.cpu_block_ids)
        request.block_ids, request.cpu_block_ids = [], []

    def fork(self, parent, child):
        raise NotImplementedError

    def swap_out(self, request):
        return None

    def swap_in(self, request):
        return None


for bug in ("", "share", "leak"):
    ALLOCATORS.register(f"test_free_list_{bug or 'ok'}")(type(f"FreeList{bug.title()}", (FreeList,), {"bug": bug}))


def generate(allocator, llm=None):
    llm = llm or LLM(model="tiny-llama", allocator=allocator, max_model_len=128, block_size=4, seed=0,
                     check_invariants=True)
    prompts = [{"prompt_token_ids": [3 + i + j for j in range(10)]} for i in range(4)]
    return llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))


def test_a_correct_plugin_allocator_passes_and_serves_what_paged_serves():
    assert ([o.outputs[0].token_ids for o in generate("test_free_list_ok")]
            == [o.outputs[0].token_ids for o in generate("paged")])


def test_an_allocator_handing_out_held_blocks_is_caught_whatever_its_class():
    """This allocator keeps no reference counts to check: the blocks the requests hold show it."""
    llm = LLM(model="tiny-llama", allocator="test_free_list_share", max_model_len=128, block_size=4, seed=0,
              check_invariants=True)
    with pytest.raises(AssertionError, match=r"the live requests hold 3 distinct device blocks but the allocator "
                                             r"counts 0 used"):
        generate("test_free_list_share", llm)
    llm.engine.config.check_invariants = False  # the suite's own leak check aborts what is left, unchecked


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_leaked_by_the_last_finishes_are_caught_though_no_step_follows(async_scheduling):
    # Checked only by schedule(), the blocks freed (and leaked) by a run's last finishes went unchecked: the run
    # ended well with blocks used and no request holding them.
    llm = LLM(model="tiny-llama", allocator="test_free_list_leak", max_model_len=128, block_size=4,
              check_invariants=True, async_scheduling=async_scheduling, executor="sim")
    with pytest.raises(AssertionError, match=r"the live requests hold 0 distinct device blocks but the allocator "
                                             r"counts 1 used"):
        llm.generate({"prompt_token_ids": list(range(3, 13))}, SamplingParams(max_tokens=6, ignore_eos=True))
    forgive(llm.engine.allocator)


def forgive(allocator):
    """Give a leaking FreeList its leaked blocks back, for the test suite's own leak check after the test."""
    allocator._free = list(range(allocator.num_blocks - 1, 0, -1))


def test_blocks_leaked_by_an_abort_are_caught():
    llm = LLM(model="tiny-llama", allocator="test_free_list_leak", max_model_len=128, block_size=4,
              check_invariants=True, executor="sim")
    llm.engine.add_request("r", {"prompt_token_ids": list(range(3, 13))}, SamplingParams(max_tokens=6))
    llm.engine.step()
    with pytest.raises(AssertionError, match="allocator counts"):
        llm.engine.abort_request("r")
    forgive(llm.engine.allocator)


def held(request_id, block_ids, tokens, computed, cpu_block_ids=()):
    return SimpleNamespace(request_id=request_id, block_ids=list(block_ids), cpu_block_ids=list(cpu_block_ids),
                           token_ids=list(tokens), num_computed_tokens=computed)


def books(used, cpu_used=0):
    """A ``FreeList`` of 16 device and 4 swap blocks with ``used`` and ``cpu_used`` of them handed out."""
    alloc = FreeList(16, 4, num_cpu_blocks=4)
    alloc._free, alloc._cpu_free = alloc._free[:15 - used], alloc._cpu_free[:4 - cpu_used]
    return alloc


@pytest.mark.parametrize("requests, used, cpu_used, message", [
    # A finished request's block kept (a leak), and a block given twice with the books counting it once.
    ([held("a", [1, 2], range(8), 8)], 3, 0, "hold 2 distinct device blocks but the allocator counts 3 used"),
    ([held("a", [1, 2], range(8), 8), held("b", [3], range(4), 4)], 2, 0, "hold 3 distinct .* counts 2 used"),
    ([held("a", [0, 1], range(8), 8)], 2, 0, "a holds the null block"),
    ([held("a", [1, 2], range(8), 8), held("b", [2], range(4, 8), 4)], 2, 0, "block 2 is block 1 of a and block 0 of b"),
    ([held("a", [1, 2], range(8), 8), held("b", [3, 2], [*range(4), 9, 9, 9], 7)], 3, 0,
     "block 2 holds other tokens for b than for a"),
    ([held("a", [], range(8), 8, [0, 1]), held("b", [], range(8), 8, [1, 2])], 0, 3, "swap block 1 is held twice"),
    ([held("a", [], range(8), 8, [0, 1])], 0, 1, "hold 2 swap blocks but the allocator counts 1 used"),
])
def test_the_books_any_allocator_keeps_are_checked_against_the_blocks_requests_hold(requests, used, cpu_used, message):
    with pytest.raises(AssertionError, match=message):
        check_block_holders(books(used, cpu_used), requests)


def test_blocks_shared_at_one_position_with_the_same_tokens_pass():
    """A prefix block two requests hold, and a fork's last block before it is written (fewer tokens computed)."""
    prompt = list(range(10))
    check_block_holders(books(3), [held("a", [1, 2, 3], prompt, 10), held("b", [1, 2], prompt[:8], 7)])
