"""ShareGPT-format conversations as a workload (the dataset ``vllm bench serve`` uses).

The file is a JSON array of ``{"id": ..., "conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}``. As vLLM does, the first turn is the prompt and the
second the reference completion whose token count is the output length; conversations with
fewer than two turns, or with a prompt or completion under ``min_len`` tokens, are skipped.
Text is tokenised with the checkpoint's tokenizer when it has one (else one id per word).
"""
from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from framework.common.config import check_positive_int, check_seed
from framework.harness.workload import WORKLOADS, Workload, WorkloadContext, WorkloadRequest
from framework.harness.workloads.arrivals import arrival_times, check_rate
from framework.harness.workloads.text import tokenize
from framework.harness.workloads.trace import read_text, resolve_path

logger = logging.getLogger(__name__)


@WORKLOADS.register("sharegpt")
class ShareGPTWorkload(Workload):
    """``num_requests`` conversations sampled (without replacement, by ``seed``) from ``path``.

    ``output_len`` fixes every output length (null: the completion's length, capped at
    ``max_output_len`` when set). Pairs whose prompt exceeds ``max_prompt_len`` or whose prompt
    and output exceed the engine's ``max_model_len`` are skipped, and so are those whose prompt,
    or completion when ``output_len`` is null, has fewer than ``min_len`` tokens. Arrivals as
    for synthetic workloads (``rate``, ``burstiness``).
    """

    def __init__(self, path: str, num_requests: int = 32, rate: float | None = None, burstiness: float = 1.0,
                 output_len: int | None = None, max_output_len: int | None = None,
                 max_prompt_len: int | None = None, min_len: int = 4, seed: int = 0) -> None:
        check_seed("workload.seed", seed)
        check_positive_int("num_requests", num_requests)
        check_rate(rate, burstiness)
        resolve_path(path)  # a missing file fails with the configuration, before an engine is built
        for name, v in (("output_len", output_len), ("max_output_len", max_output_len), ("max_prompt_len", max_prompt_len)):
            check_positive_int(name, v, optional=True)
        check_positive_int("min_len", min_len)
        self.path, self.num_requests, self.rate, self.burstiness = path, num_requests, rate, burstiness
        self.output_len, self.max_output_len, self.max_prompt_len = output_len, max_output_len, max_prompt_len
        self.min_len, self.seed = min_len, seed

    def check_lengths(self, max_model_len: int) -> None:
        """Refuses an ``output_len`` that leaves no room within ``max_model_len`` for a prompt of ``min_len`` tokens
        (every conversation would be skipped). Prompts are text: their lengths are known once tokenised."""
        if self.output_len is not None and self.output_len > max_model_len - self.min_len:
            raise ValueError(f"workload.output_len={self.output_len} leaves no room within max_model_len="
                             f"{max_model_len} for a prompt of min_len={self.min_len} tokens: lower it or raise "
                             f"engine.max_model_len")
        return None

    def _conversations(self) -> list[dict[str, Any]]:
        path = resolve_path(self.path)
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: a ShareGPT file is a JSON array of conversations")
        for i, conv in enumerate(data):
            turns = conv.get("conversations") if isinstance(conv, dict) else None
            if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
                raise ValueError(f"{path}: entry {i} is not a conversation "
                                 "({\"conversations\": [{\"from\": ..., \"value\": \"...\"}, ...]})")
        return data

    def generate(self, ctx: WorkloadContext) -> list[WorkloadRequest]:
        data = self._conversations()
        if ctx.tokenizer is None:
            logger.warning("the model has no tokenizer: ShareGPT text becomes one id per word")
        seeds = np.random.SeedSequence(self.seed).spawn(2)
        order = np.random.default_rng(seeds[0]).permutation(len(data))
        picked: list[tuple[list[int], str, int]] = []
        for i in order:
            turns = data[i]["conversations"]
            if len(turns) < 2:
                continue
            prompt = turns[0]["value"]
            ids = tokenize(prompt, ctx)
            if len(ids) < self.min_len:
                continue
            out_len = self.output_len
            if out_len is None:  # the completion's length; min_len and the cap apply to it alone
                out_len = len(tokenize(turns[1]["value"], ctx))
                if out_len < self.min_len:
                    continue
                if self.max_output_len is not None:
                    out_len = min(out_len, self.max_output_len)
            if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
                continue
            if ctx.max_model_len is not None and len(ids) + out_len > ctx.max_model_len:
                continue
            picked.append((ids, prompt, out_len))
            if len(picked) == self.num_requests:
                break
        if len(picked) < self.num_requests:
            raise ValueError(f"{self.path}: only {len(picked)} usable conversations for num_requests={self.num_requests} "
                             f"(min_len={self.min_len}, max_prompt_len={self.max_prompt_len}, "
                             f"max_model_len={ctx.max_model_len})")
        times = arrival_times(len(picked), self.rate, self.burstiness, np.random.default_rng(seeds[1]))
        return [WorkloadRequest(str(i), ids, out_len, float(t), 0, text)
                for i, ((ids, text, out_len), t) in enumerate(zip(picked, times))]
