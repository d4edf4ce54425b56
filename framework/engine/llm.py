"""``LLM``: vLLM's offline API over ``LLMEngine``."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from framework.common.config import EngineConfig
from framework.engine.llm_engine import LLMEngine
from framework.engine.prompts import Prompt, cache_salt, check_request_args
from framework.common.outputs import RequestOutput
from framework.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """``LLM(model="tiny-llama", policy="fcfs", backend="naive", ...)``: every ``EngineConfig``
    field is a keyword argument. ``generate`` runs prompts to completion and returns one
    ``RequestOutput`` per prompt, in the prompts' order; one the engine never ran (a prompt too
    long for it) has no tokens and a ``status_message``, and is logged as a warning."""

    def __init__(self, model: str = "tiny-llama", **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no ``SamplingParams``: the model's generation config applied
        (``EngineConfig.generation_config``), as vLLM's."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] | None = None,
                 use_tqdm: bool | Callable[..., Any] = False) -> list[RequestOutput]:
        """``priority``: one for every prompt, or a list of one per prompt. ``use_tqdm``: a progress bar, made by
        tqdm or by the callable given (``functools.partial(tqdm, ...)``), as vLLM's."""
        if _is_one_prompt(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Iterable):
            raise ValueError(f"prompts must be a prompt (text, token ids or a dict) or a list of them, "
                             f"got {type(prompts).__name__}: {prompts!r}")
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, Sequence):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}: {sampling_params!r}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and (isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence)):
            priority = [priority] * len(prompts)  # one for all, as vLLM's; checked per prompt below
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        # Tokenize and check everything before queueing anything, so bad input loses nothing; the
        # requests then take the token ids, so no prompt is tokenized twice.
        tokenized = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            token_ids, text = self.engine.tokenize(prompt)
            salt = cache_salt(prompt)
            check_request_args(p, None, priority[i] if priority else 0)
            self.engine.check_params(p)
            tokenized.append({"prompt_token_ids": token_ids, "prompt": text, "cache_salt": salt})
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = None
        try:
            for i, (prompt, p) in enumerate(zip(tokenized, params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
            if callable(use_tqdm):
                bar = use_tqdm(total=len(ids), desc="requests", unit="req")
            elif use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(ids), desc="requests", unit="req")
            # Only final outputs are read (vLLM's generate asks for FINAL_ONLY too): a cumulative
            # output per running request per step would decode each request's whole text every
            # step, quadratic in the output length.
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(final_only=True):
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: this call's requests still in flight are aborted, or
            # they would keep their KV blocks and run on in the next call, their outputs dropped.
            self.engine.abort_request([rid for rid in ids if rid not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [results[rid] for rid in ids]
        for out in outputs:
            if out.status_message:  # ignored by the scheduler: its output alone would not say why it is empty
                logger.warning("request %s was not run: %s", out.request_id, out.status_message)
        return outputs


def _is_one_prompt(prompts: Any) -> bool:
    """Whether ``prompts`` is one prompt (text, a dict, or token ids: a flat list of ints, numpy
    ints included, or a 1-D numpy or torch array) rather than a list of them."""
    if isinstance(prompts, (str, dict)):
        return True
    if isinstance(prompts, np.ndarray) or hasattr(prompts, "ndim"):  # torch tensors, without importing torch
        return prompts.ndim <= 1
    return (isinstance(prompts, Sequence) and len(prompts) > 0
            and all(isinstance(t, (int, np.integer)) for t in prompts))
