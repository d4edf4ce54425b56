"""Many concurrent streaming clients, a third of them leaving midway: every request accounted for, no block leaked."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.framework.server.support import API_KEY

NUM_CLIENTS = 32
MAX_TOKENS = 24
#: A leaver asks for many more tokens than it reads: only an abort ends its request before they are all generated.
LEAVER_MAX_TOKENS = 200


async def one_client(url: str, model: str, i: int, leave_after: int | None) -> tuple[int, str | None]:
    """Stream one completion; with ``leave_after``, hang up after that many chunks. Returns (chunks, finish)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        stream = await client.completions.create(model=model, prompt=f"w{10 + i} w{20 + i} w{30 + i}",
                                                 max_tokens=MAX_TOKENS if leave_after is None else LEAVER_MAX_TOKENS,
                                                 temperature=0.8, seed=i, stream=True,
                                                 extra_body={"ignore_eos": True})
        chunks, finish = 0, None
        async for chunk in stream:
            chunks += 1
            finish = chunk.choices[0].finish_reason
            if leave_after is not None and chunks == leave_after:
                await stream.close()  # the connection goes: the server must abort the request
                return chunks, None
        return chunks, finish


@pytest.mark.parametrize("which", ["server", "async_server"])
def test_concurrent_streams_with_disconnects_lose_nothing_and_leak_no_blocks(which, chat_ckpt, request):
    server = request.getfixturevalue(which)
    lab = server.server
    assert lab.engine.async_scheduling == (which == "async_server")
    records_before = len(lab.run.records)

    async def all_clients():
        return await asyncio.gather(*[one_client(server.url, str(chat_ckpt), i, 2 if i % 3 == 0 else None)
                                      for i in range(NUM_CLIENTS)])

    results = asyncio.run(all_clients())
    leavers = [i for i in range(NUM_CLIENTS) if i % 3 == 0]
    for i, (chunks, finish) in enumerate(results):
        if i in leavers:
            assert chunks == 2
        else:
            assert (chunks, finish) == (MAX_TOKENS, "length"), i
    deadline = time.monotonic() + 30
    while (lab.engine.has_unfinished_requests() or lab.loop.num_in_flight()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not lab.engine.has_unfinished_requests() and lab.loop.num_in_flight() == 0
    allocator = lab.engine.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks, "KV blocks leaked"
    allocator.check_invariants([])
    # Every request has its row: the stayers completed, the leavers aborted before their end.
    deadline = time.monotonic() + 10
    while len(lab.run.records) < records_before + NUM_CLIENTS and time.monotonic() < deadline:
        time.sleep(0.05)
    records = lab.run.records[records_before:]
    assert len(records) == NUM_CLIENTS
    assert sum(r.status == "length" and r.output_len == MAX_TOKENS for r in records) == NUM_CLIENTS - len(leavers)
    aborted = [r for r in records if r.status == "abort"]
    assert len(aborted) == len(leavers) and all(r.output_len < LEAVER_MAX_TOKENS for r in aborted)
