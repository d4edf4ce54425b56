"""Text to token ids for workloads that carry text (traces, ShareGPT).

With the checkpoint's tokenizer the ids are the real ones. Presets have no tokenizer; then each
word or punctuation mark becomes one id chosen by a stable hash, which keeps the token counts a
real tokenizer would roughly give (about one per word) and the same text always the same ids.
"""
from __future__ import annotations

import re
import zlib

from framework.harness.workload import WorkloadContext

_PIECES = re.compile(r"\w+|[^\w\s]")


def tokenize(text: str, ctx: WorkloadContext) -> list[int]:
    if ctx.tokenizer is not None:
        return list(ctx.tokenizer.encode(text))  # as the engine tokenizes a text prompt
    span = ctx.vocab_size - ctx.first_token_id
    return [ctx.first_token_id + zlib.crc32(p.encode()) % span for p in _PIECES.findall(text)]
