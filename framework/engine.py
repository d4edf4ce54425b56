"""``LLMEngine``: requests in, scheduler + executor each step, ``RequestOutput``s out."""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from framework.block_allocator import ALLOCATORS
from framework.clock import Clock
from framework.config import EngineConfig, is_finite_number
from framework.detokenizer import DETOKENIZE_CONTEXT, IncrementalDetokenizer
from framework.executor import EXECUTORS, ExecutorOutput
from framework.fast_forward import DecodePlan, commit_decode_run, plan_decode_run
from framework.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from framework.request import Request, RequestStatus
from framework.sampling_params import RequestOutputKind, SamplingParams
from framework.scheduler import POLICIES, Scheduler, SchedulerOutput
from models.loader import resolve_model

logger = logging.getLogger(__name__)

#: A default max_model_len larger than this is capped: the persistent batch and the RoPE table
#: are sized by it, and tiny CPU experiments do not need 128k-token rows.
DEFAULT_MAX_MODEL_LEN_CAP = 8192

Prompt = str | list[int] | dict[str, Any]


@dataclass
class StepStats:
    """One engine step, for timelines: what ran and the state of the queues and KV cache after."""

    step: int
    start_time: float
    duration: float
    num_scheduled_reqs: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_used: int
    kv_usage: float
    num_preempted: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_finished: int


class LLMEngine:
    """Online serving core. ``add_request`` queues work, each ``step`` runs one batch and returns
    outputs for the requests that progressed (a new token, or finished). Single-threaded."""

    def __init__(self, config: EngineConfig | None = None, clock: Clock | None = None, **kwargs: Any) -> None:
        """Built from ``config``, or from ``EngineConfig`` keyword arguments: not both."""
        if config is not None and kwargs:
            # Each would otherwise be dropped without a word, the config's value used instead.
            raise ValueError(f"LLMEngine takes an EngineConfig or EngineConfig keyword arguments, not both: "
                             f"set {', '.join(sorted(kwargs))} in the EngineConfig")
        self.config = config = config or EngineConfig(**kwargs)
        self.clock = clock or EXECUTORS.get(config.executor).make_clock()
        self.source = resolve_model(config.model)
        self.model_config = self.source.config
        config.max_model_len = self._resolve_max_model_len()
        # Resolve every name before loading anything, so a typo fails in milliseconds.
        POLICIES.get(config.policy)
        ALLOCATORS.get(config.allocator)
        # A simulated run never uses the tensor parts, and their registries load torch (about 2 s):
        # it checks their names only when they are not the defaults, so a typo is still caught.
        defaults = EngineConfig.backend, EngineConfig.preparer
        preparer_forks = False  # the default preparer (v1) runs n samples as n requests
        if config.executor == "model" or (config.backend, config.preparer) != defaults:
            from framework.attention import BACKENDS
            from framework.input_preparer import PREPARERS

            BACKENDS.get(config.backend)
            preparer_forks = PREPARERS.get(config.preparer).forks_parallel_samples
        self.policy = POLICIES.create_with(config.policy, config.policy_options)
        self.executor = EXECUTORS.create_with(config.executor, config.executor_options, config, self.source, self.clock)
        num_blocks, num_cpu_blocks = self.executor.kv_block_counts()
        usable = max(num_blocks - 1, 0)  # a budget below one block sizes no block, not the null block
        capacity = usable * config.block_size
        if capacity < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {usable} blocks x {config.block_size} tokens = {capacity} tokens, "
                f"less than one request of max_model_len={config.max_model_len}; raise {_kv_cache_setting(config)} "
                f"or lower max_model_len")
        self.executor.initialize(num_blocks, num_cpu_blocks)
        self.allocator = ALLOCATORS.create_with(config.allocator, config.allocator_options, num_blocks=num_blocks,
                                                block_size=config.block_size, num_cpu_blocks=num_cpu_blocks,
                                                enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.policy, self.allocator, self.clock)
        self.tokenizer = self.executor.tokenizer
        self._eos = frozenset(self.model_config.eos_token_ids)
        self._parents: dict[str, list[Request]] = {}
        # vLLM v0's parallel sampling (see InputPreparer.forks_parallel_samples): one leader per
        # request with n > 1 prefills; the others are forked from it when it samples. Simulated
        # runs fork too (Executor.samples_forks), so they schedule as the real executor does.
        self._fork_samples = self.executor.samples_forks and preparer_forks
        self._leaders: dict[str, Request] = {}
        #: How far each sequence of a DELTA request has been streamed, by sequence id.
        self._streams: dict[str, _Stream] = {}
        #: Whether a seeded request was ever added: only then does a step save generator states.
        self._any_seeded = False
        self._generator_device = self.executor.device
        self.step_callbacks: list[Callable[[StepStats, SchedulerOutput], None]] = []
        self.num_steps = 0
        self._stalled_steps = 0

    def _resolve_max_model_len(self) -> int:
        limit, why = self.model_config.max_context()
        if self.config.max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len={self.config.max_model_len} exceeds the model's {why} of {limit}")
        return self.config.max_model_len

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt given as text, token ids or a vLLM-style dict."""
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise ValueError(f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        else:
            ids = prompt
        # None (bare, or as a dict's value) is no text to tokenize, and bytes are no token ids
        # (they would pass as their byte values).
        if (ids is None and not isinstance(text, str)) or isinstance(ids, (bytes, bytearray)):
            raise ValueError(f"a prompt is text (str), token ids (a list of ints) or a dict with 'prompt_token_ids' "
                             f"or 'prompt'; got {type(prompt).__name__}: {prompt!r}")
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer; pass prompt_token_ids instead of text")
            ids = self.tokenizer.encode(text)
        return _token_ids(ids, self.model_config.vocab_size), text

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue one request; ValueError, with nothing queued, for a bad prompt or argument."""
        # abort_request takes only str ids (an iterable of them means several): an int id accepted
        # here could never be aborted.
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}: {request_id!r}")
        # Only None means the defaults: a falsy mistake ([], {}, 0) would otherwise pass as them.
        params = SamplingParams() if params is None else params
        check_request_args(params, arrival_time, priority)
        self.check_params(params)
        ids, text = self.tokenize(prompt)
        if request_id in self._parents or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Every sequence id is checked before anything is queued: a clash found half-way would
        # leave the request listed but never finishing.
        rids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for rid in rids:
            if self._sequence_in_use(rid):
                raise ValueError(f"request id {request_id!r} clashes with {rid!r}, a sequence already in use")
        arrival = self.clock.now() if arrival_time is None else arrival_time
        children = []
        for i, rid in enumerate(rids):
            child_params = params
            if params.n > 1:
                # Sample i takes seed + i (as vLLM), wrapped into SamplingParams' [0, 2**63): a
                # seed near the top is valid and must not fail for the samples after it.
                seed = None if params.seed is None else (params.seed + i) % 2**63
                # The prompt's logprobs are the request's, not a sample's: the first computes them.
                prompt_logprobs = params.prompt_logprobs if i == 0 else None
                child_params = dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
            req = Request(rid, ids, child_params, arrival, priority=priority, eos_token_ids=self._eos,
                          max_model_len=self.config.max_model_len, prompt=text,
                          parent_id=request_id if params.n > 1 else None, index=i)
            if params.stop or (params.output_kind is RequestOutputKind.DELTA and self.tokenizer is not None
                               and params.detokenize):
                # Stop strings are matched, and a delta's text is streamed, as the text grows.
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                                         params.include_stop_str_in_output)
            if child_params.seed is not None:
                import torch

                self._any_seeded = True
                req.generator = torch.Generator(device=self._generator_device).manual_seed(child_params.seed)
            children.append(req)
        self._parents[request_id] = children
        if len(children) > 1 and self._fork_samples:
            leader = children[0]
            leader.forks = children[1:]
            self._leaders[leader.request_id] = leader
            self.scheduler.add_request(leader)
            if leader.is_finished:  # ignored on arrival
                self._settle_forks([leader])
            return
        for req in children:
            self.scheduler.add_request(req)

    def check_params(self, params: SamplingParams) -> None:
        """ValueError, one line naming the option, for sampling parameters this engine cannot
        serve: an option the executor cannot honour (``Executor.check_request``), stop strings
        without a tokenizer, more (prompt) logprobs than ``max_logprobs`` (or the vocabulary)."""
        self.executor.check_request(params)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop is matched against the output text, and model "
                             f"{self.config.model!r} has no tokenizer to decode it; use stop_token_ids")
        limit, name = self.config.max_logprobs, "the engine's max_logprobs"
        if self.model_config.vocab_size < limit:
            limit, name = self.model_config.vocab_size, "the model's vocabulary size"
        for option in ("logprobs", "prompt_logprobs"):
            value = getattr(params, option)
            if value is not None and value > limit:
                raise ValueError(f"SamplingParams.{option}={value} exceeds {name} ({limit}); ask for at most {limit}")

    def _sequence_in_use(self, rid: str) -> bool:
        """Whether ``rid`` names an unfinished sequence: one the scheduler holds, or a parallel
        sample ``ID#i`` of a request still to be forked from its leader (vLLM v0)."""
        if rid in self.scheduler.requests:
            return True
        group, sep, _ = str(rid).rpartition("#")
        return bool(sep) and any(r.request_id == rid and not r.is_finished for r in self._parents.get(group, ()))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = list(request_id) if isinstance(request_id, Iterable) and not isinstance(request_id, str) else [request_id]
        if not all(isinstance(rid, str) for rid in ids):
            raise ValueError(f"abort_request takes a request id (str) or an iterable of them, got {request_id!r}")
        for rid in ids:
            for req in self._parents.get(rid, []):
                aborted = self.scheduler.abort_request(req.request_id)
                if aborted is not None and aborted.forks:
                    # A v0 leader aborted before its prompt completed takes its samples still to
                    # fork with it now: is_finished says so at once, not after the next step.
                    self._settle_forks([aborted])

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def is_finished(self, request_id: str) -> bool:
        """Whether every sequence of ``request_id`` has finished, its output perhaps not yet made
        (a request ignored on arrival finishes in ``add_request``; its output comes with the next
        step). An unknown id, or one whose final output was made, counts as finished."""
        return all(r.is_finished for r in self._parents.get(request_id, ()))

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- one step --------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one step. Returns an output for every request that progressed, as its
        ``SamplingParams.output_kind`` says (cumulative, the delta since its last output, or
        only once finished), or with ``final_only`` only for those that finished, each complete
        whatever its kind: a batch run that reads results at the end then skips building a
        cumulative output per running request every step."""
        start = self.clock.now()
        out = self.scheduler.schedule()
        seeded = _seeded_generator_states(out) if out.runs and self._any_seeded else []
        try:
            result = self.executor.execute(out) if out.runs else ExecutorOutput()
        except BaseException:
            # The step's requests sample their positions again when recomputed: a seeded one's
            # generator goes back to where the step found it (the sampler may have drawn from it
            # before the failure), so it samples what it would have had the step not failed.
            for generator, state in seeded:
                generator.set_state(state)
            self.scheduler.step_failed(out)
            raise
        sampled = result.sampled
        if result.prompt_logprobs:
            self._append_prompt_logprobs(result.prompt_logprobs)
        # One time for the step's tokens, forks' first tokens included: a streaming client gets
        # them together, and RequestMetrics.token_times counts one entry per step.
        now = self.clock.now()
        if self._leaders:
            self._fork_leaders(result, now)
        progressed = self.scheduler.update_from_output(out, sampled, now)
        if result.logprobs:
            self._append_logprobs(progressed, result.logprobs)
        done_elsewhere = self.scheduler.take_finished_outside_step()
        self._settle_forks(done_elsewhere)
        self._check_progress(out, done_elsewhere)
        # Requests finished outside the step (ignored, aborted) finished before the step's own
        # finishes: their outputs come first, in finish order, as a decode run delivers them.
        if final_only:
            outputs = [o for o in self._make_outputs(done_elsewhere + [r for r in progressed if r.is_finished], True)
                       if o.finished]
        else:
            outputs = self._make_outputs(done_elsewhere + progressed)
        self.num_steps += 1
        if self.step_callbacks:
            stats = self._step_stats(out, start, sum(o.finished for o in outputs))
            for callback in self.step_callbacks:
                callback(stats, out)
        return outputs

    def _fork_leaders(self, result: ExecutorOutput, now: float) -> None:
        """Fork the other sequences of every leader that sampled its first token this step."""
        sampled = result.sampled
        for rid in [rid for rid in self._leaders if rid in sampled]:
            leader = self._leaders.pop(rid)
            for child in leader.forks:
                token = sampled.get(child.request_id)
                if token is None:
                    raise RuntimeError(f"preparer {self.config.preparer!r} sampled no first token for "
                                       f"{child.request_id}, a parallel sample of {rid}")
                self.scheduler.fork(leader, child, token, now)
                if result.logprobs:
                    self._append_logprobs([child], result.logprobs)
            leader.forks = []

    def _append_logprobs(self, reqs: Iterable[Request], logprobs: dict[str, dict[int, Logprob]]) -> None:
        """Give each of ``reqs`` that asks for logprobs those of the token it just appended, its
        tokens' text decoded as vLLM does (each alone). Appended as the token is, once: a request
        recomputed after preemption samples only past its known tokens, so nothing repeats."""
        for req in reqs:
            if req.logprobs is None:
                continue
            entry = logprobs.get(req.request_id)
            if entry is None:
                raise RuntimeError(f"executor {self.config.executor!r} returned no logprobs for {req.request_id}, "
                                   f"which asks for them")
            self._decode_logprob_tokens(req, [entry])
            req.logprobs.append(entry)
            req.cumulative_logprob += entry[req.token_ids[-1]].logprob

    def _append_prompt_logprobs(self, prompt_logprobs: dict[str, list[dict[int, Logprob]]]) -> None:
        """Extend each request's prompt logprobs with the entries its prompt chunk computed this
        step (the executor computes only the positions the request lacks)."""
        for rid, entries in prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.prompt_logprobs is None:
                raise RuntimeError(f"executor {self.config.executor!r} returned prompt logprobs for {rid}, "
                                   f"which does not ask for them")
            if len(req.prompt_logprobs) + len(entries) > req.num_prompt_tokens:
                raise RuntimeError(f"executor {self.config.executor!r} returned more prompt logprobs for {rid} "
                                   f"than its prompt has tokens")
            self._decode_logprob_tokens(req, entries)
            req.prompt_logprobs.extend(entries)

    def _decode_logprob_tokens(self, req: Request, entries: list[dict[int, Logprob]]) -> None:
        """Each entry's tokens' text, decoded as vLLM does (each token alone), when ``req``
        is detokenized."""
        if self.tokenizer is not None and req.sampling_params.detokenize:
            for entry in entries:
                for token_id, logprob in entry.items():
                    logprob.decoded_token = self.tokenizer.decode([token_id])

    def _settle_forks(self, finished: Iterable[Request]) -> None:
        """A leader among ``finished`` (requests that finished before sampling: ignored, aborted)
        takes its forks with it; left waiting for a fork that never comes, they would keep the
        request unfinished forever."""
        for leader in finished:
            for child in leader.forks:
                child.status = leader.status
                child.status_message = leader.status_message
                child.finished_time = leader.finished_time
            if leader.forks:
                leader.forks = []
                self._leaders.pop(leader.request_id, None)

    def advance(self, until: float = math.inf) -> list[RequestOutput]:
        """``step(final_only=True)``, or, when the executor fast-forwards (the sim executor's
        ``fast_forward``), a run of pure-decode steps with exactly the effect of stepping them one
        by one (``framework/fast_forward.py``), none of them starting at or after ``until`` (the
        next arrival). Returns the outputs of the requests that finished."""
        plan = self.plan_decode_run(until)
        if plan is None:
            return self.step(final_only=True)
        return self.commit_decode_run(plan, len(plan.end_times))

    def plan_decode_run(self, until: float = math.inf, through_finishes: bool = True) -> DecodePlan | None:
        """The pure-decode steps that provably come next (changes nothing), or None."""
        return plan_decode_run(self, until, through_finishes)

    def commit_decode_run(self, plan: DecodePlan, num_steps: int) -> list[RequestOutput]:
        """Take the first ``num_steps`` steps of ``plan`` (made since the engine last changed);
        returns the outputs of the requests that finished."""
        run = commit_decode_run(self, plan, num_steps)
        self._stalled_steps = 0
        self._settle_forks(run.finished_outside)  # a v0 leader aborted since the last step, as in step()
        # A request of several sequences (n > 1) finishes with its last one: its output belongs
        # to that step, not to the step of a sibling that finished earlier in the run (the run is
        # applied whole, so every sibling already shows as finished here).
        last: dict[str, int] = {}
        for step, group in run.finished:  # in step order: the last step wins
            for req in group:
                last[req.parent_id or req.request_id] = step
        outside = [r for r in run.finished_outside if (r.parent_id or r.request_id) not in last]
        outputs = [o for o in self._make_outputs(outside, True) if o.finished] if outside else []
        if outputs:
            run.outputs_finished[1] = len(outputs)
        for step, group in run.finished:
            done = [o for o in self._make_outputs([r for r in group if last[r.parent_id or r.request_id] == step], True)
                    if o.finished]
            if done:
                run.outputs_finished[step] = run.outputs_finished.get(step, 0) + len(done)
                outputs += done
        for callback in self.step_callbacks:
            callback.on_decode_run(run)  # type: ignore[attr-defined]
        return outputs

    def _check_progress(self, out: SchedulerOutput, done: list[Request]) -> None:
        if out.runs or done or not self.scheduler.has_unfinished_requests():
            self._stalled_steps = 0
            return
        self._stalled_steps += 1
        if self._stalled_steps >= 3:
            s = self.scheduler
            raise RuntimeError(
                f"policy {self.config.policy!r} scheduled nothing for {self._stalled_steps} steps with "
                f"{len(s.waiting)} waiting, {len(s.running)} running, {len(s.swapped)} swapped requests and "
                f"{self.allocator.num_free_blocks} free blocks: the policy cannot make progress")

    def _step_stats(self, out: SchedulerOutput, start: float, num_finished: int) -> StepStats:
        decode = sum(1 for r in out.scheduled if out.num_scheduled_tokens[r.request_id] == 1)
        total = out.total_num_scheduled_tokens
        s = self.scheduler
        return StepStats(
            step=self.num_steps, start_time=start, duration=self.clock.now() - start,
            num_scheduled_reqs=len(out.scheduled), num_scheduled_tokens=total,
            num_prefill_tokens=total - decode, num_decode_tokens=decode,
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            kv_blocks_used=self.allocator.num_used_blocks, kv_usage=self.allocator.usage,
            num_preempted=len(out.preempted) + len(out.swapped_out),
            num_swapped_out_blocks=len(out.blocks_to_swap_out), num_swapped_in_blocks=len(out.blocks_to_swap_in),
            num_finished=num_finished)

    # -- outputs ---------------------------------------------------------------------------------
    def _make_outputs(self, reqs: list[Request], final: bool = False) -> list[RequestOutput]:
        """One output per request among ``reqs``' sequences, as its ``output_kind`` says (none
        for an unfinished FINAL_ONLY one); with ``final``, cumulative whatever the kind."""
        seen: dict[str, RequestOutput | None] = {}
        for req in reqs:
            parent_id = req.parent_id or req.request_id
            if parent_id in seen:
                continue
            children = self._parents.get(parent_id)
            if children is None:
                continue
            kind = children[0].sampling_params.output_kind
            if kind is RequestOutputKind.CUMULATIVE or final:
                output = self._output(parent_id, children)
            elif kind is RequestOutputKind.DELTA:
                output = self._delta_output(parent_id, children)
            else:  # FINAL_ONLY
                output = self._output(parent_id, children) if all(r.is_finished for r in children) else None
            seen[parent_id] = output
            if output is not None and output.finished:
                del self._parents[parent_id]
                if kind is RequestOutputKind.DELTA:
                    for child in children:
                        self._streams.pop(child.request_id, None)
        return [o for o in seen.values() if o is not None]

    def _output(self, request_id: str, children: list[Request]) -> RequestOutput:
        first = children[0]
        completions = []
        for req in children:
            ids = req.output_token_ids
            text = ""
            if req.detokenizer is not None:
                # The text decoded as it grew: cut at a stop string, held back while one may start.
                text = req.detokenizer.output_text(req.is_finished)
            elif self.tokenizer is not None and req.sampling_params.detokenize and ids:
                # The stop token's text is left out (a non-special EOS or stop id would show).
                shown = ids[:-1] if req.status == RequestStatus.FINISHED_STOPPED else ids
                text = decode_continuation(self.tokenizer, first.prompt_token_ids, shown)
            logprobs = req.logprobs
            if logprobs is not None and not req.is_finished:
                logprobs = list(logprobs)  # a running request's list still grows
            completions.append(CompletionOutput(req.index, text, ids, req.status.finish_reason, req.stop_reason,
                                                req.cumulative_logprob, logprobs))
        # n > 1: one time per step that gave any sequence a token, as a streaming client receives
        # them, so TPOT and the ITLs are a sequence's pace, not the pace of all tokens together.
        token_times = first.token_times if len(children) == 1 else sorted({t for r in children for t in r.token_times})
        if not all(r.is_finished for r in children):
            token_times = list(token_times)  # a finished request's never change: its output may share them
        return self._request_output(request_id, children, completions, token_times, _prompt_logprobs(first))

    def _delta_output(self, request_id: str, children: list[Request]) -> RequestOutput:
        """A DELTA request's output: for each sequence with something new since the request's
        last output (tokens, or its finish), a completion of only the new token ids, text (from
        its ``IncrementalDetokenizer``, so the deltas add up to the cumulative text) and
        logprobs; ``metrics.token_times`` holds the new tokens' times, the other metrics are
        cumulative. Work is proportional to what is new."""
        first = children[0]
        num_prompt = first.num_prompt_tokens
        completions = []
        new_times: list[float] = []
        for req in children:
            stream = self._streams.get(req.request_id)
            if stream is None:
                stream = self._streams[req.request_id] = _Stream(num_prompt)
            # Tokens are only ever appended (a recompute preemption keeps them), so nothing
            # streamed is sent again.
            ids = req.token_ids[stream.num_tokens:]
            newly_finished = req.is_finished and not stream.finished
            if not ids and not newly_finished:
                continue
            sent = stream.num_tokens - num_prompt  # output tokens already streamed
            new_times.extend(req.token_times[sent:])
            text = ""
            if req.detokenizer is not None:
                text = req.detokenizer.output_text(req.is_finished, stream.num_chars)
                stream.num_chars += len(text)
            stream.num_tokens = req.num_tokens
            stream.finished = req.is_finished
            logprobs = req.logprobs[sent:] if req.logprobs is not None else None
            completions.append(CompletionOutput(req.index, text, ids, req.status.finish_reason, req.stop_reason,
                                                req.cumulative_logprob, logprobs))
        token_times = new_times if len(children) == 1 else sorted(set(new_times))
        # Prompt logprobs go out once, with the first output that has them (as vLLM's DELTA).
        head = self._streams[first.request_id]
        prompt_logprobs = None if head.sent_prompt_logprobs else _prompt_logprobs(first)
        head.sent_prompt_logprobs |= prompt_logprobs is not None
        return self._request_output(request_id, children, completions, token_times, prompt_logprobs)

    @staticmethod
    def _request_output(request_id: str, children: list[Request], completions: list[CompletionOutput],
                        token_times: list[float], prompt_logprobs: list[dict[int, Logprob] | None] | None
                        ) -> RequestOutput:
        """The ``RequestOutput`` of ``children``' completions: the request's metrics so far,
        with ``token_times`` as the output kind gives them."""
        first = children[0]
        finished = all(r.is_finished for r in children)
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=_min(r.first_scheduled_time for r in children),
            first_token_time=_min(r.first_token_time for r in children),
            last_token_time=_max(r.token_times[-1] if r.token_times else None for r in children),
            finished_time=_max(r.finished_time for r in children) if finished else None,
            token_times=token_times,
            num_prompt_tokens=first.num_prompt_tokens,
            num_generated_tokens=sum(r.num_output_tokens for r in children),
            num_cached_tokens=first.num_cached_tokens,
            num_preemptions=sum(r.num_preemptions for r in children),
            num_swaps=sum(r.num_swaps for r in children))
        return RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=finished, metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
            status_message=next((r.status_message for r in children if r.status_message), None),
            priority=first.priority, prompt_logprobs=prompt_logprobs)


def _prompt_logprobs(req: Request) -> list[dict[int, Logprob] | None] | None:
    """``req``'s prompt logprobs for an output: None until the prompt's are all computed (a
    request prefilled over several steps streams them with its first token), and never the
    list still growing."""
    if req.prompt_logprobs is None or len(req.prompt_logprobs) < req.num_prompt_tokens:
        return None
    return req.prompt_logprobs


@dataclass
class _Stream:
    """A DELTA sequence's progress: ``num_tokens`` of its ``token_ids`` (prompt included) sent,
    ``num_chars`` of its text; for the first sequence, whether the request's prompt logprobs
    went out."""

    num_tokens: int
    num_chars: int = 0
    finished: bool = False
    sent_prompt_logprobs: bool = False


def _seeded_generator_states(out: SchedulerOutput) -> list[tuple[Any, Any]]:
    """The generator and its state of each seeded request ``out`` schedules, and of each parallel
    sample still to be forked from one of them (its first token is drawn from its own generator)."""
    return [(r.generator, r.generator.get_state()) for req in out.scheduled for r in (req, *req.forks)
            if r.generator is not None]


def decode_continuation(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """The text ``output_ids`` add after ``prompt_ids``: ``decode(tail + output)`` minus
    ``decode(tail)`` for the prompt's last few tokens, so that prompt text + output text reads
    as the whole sequence. Decoded alone, a SentencePiece word's leading space ("▁world") would
    be dropped; vLLM keeps it. When the tail's text is not a prefix of the whole (a character
    split across the boundary), the output is decoded alone."""
    tail = list(prompt_ids[-DETOKENIZE_CONTEXT:])
    if not tail:
        return tokenizer.decode(output_ids, skip_special_tokens=True)
    prefix = tokenizer.decode(tail, skip_special_tokens=True)
    whole = tokenizer.decode(tail + list(output_ids), skip_special_tokens=True)
    if whole.startswith(prefix):
        return whole[len(prefix):]
    return tokenizer.decode(output_ids, skip_special_tokens=True)


def _kv_cache_setting(config: EngineConfig) -> str:
    """The setting that sized the KV cache, in ``EngineConfig``'s order of precedence: what to
    raise when it is too small."""
    if config.num_gpu_blocks_override is not None:
        return f"num_gpu_blocks_override (now {config.num_gpu_blocks_override})"
    if config.kv_cache_memory_gb is not None:
        return f"kv_cache_memory_gb (now {config.kv_cache_memory_gb})"
    return (f"cpu_kv_cache_gb (now {config.cpu_kv_cache_gb}) on a CPU or gpu_memory_utilization "
            f"(now {config.gpu_memory_utilization}) on a GPU, set kv_cache_memory_gb or num_gpu_blocks_override,")


def check_request_args(params: Any, arrival_time: Any = None, priority: Any = 0) -> None:
    """ValueError naming the argument unless ``params`` is a ``SamplingParams``, ``arrival_time``
    None or a finite number and ``priority`` a finite number. The scheduler compares priorities
    and times mid-step, where a string or NaN would fail every later step too."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}: {params!r}")
    if arrival_time is not None and not is_finite_number(arrival_time):
        raise ValueError(f"arrival_time must be a finite number or None, got {arrival_time!r}")
    if not is_finite_number(priority):
        raise ValueError(f"priority must be a finite number, got {priority!r}")


def _token_ids(ids: Iterable[Any], vocab_size: int) -> list[int]:
    """``ids`` (a list, a 1-D integer numpy array or any iterable of ints) as a non-empty list of
    ints in ``[0, vocab_size)``; ValueError otherwise (floats and bools, and float, bool or object
    arrays, included). Big simulated workloads send millions of ids, so the checks avoid a Python
    step per token where they can: an array is checked in numpy, and a list of plain ints (the
    set of its element types, built in C) is kept as is."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"prompt token ids must be a 1-D integer array, got shape {ids.shape} of {ids.dtype}")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            _out_of_vocabulary(ids.tolist(), vocab_size)
        ids = ids.tolist()
    else:
        if type(ids) is not list or not set(map(type, ids)) <= {int}:
            try:
                ids = list(ids)
                # operator.index takes numpy ints and refuses floats, but takes bools as 0 and 1.
                if any(type(t) is bool for t in ids):
                    raise TypeError("a bool is not a token id")
                ids = list(map(operator.index, ids))
            except TypeError as exc:
                raise ValueError(f"prompt token ids must be integers: {exc}") from None
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            _out_of_vocabulary(ids, vocab_size)
    if not ids:
        raise ValueError("prompt is empty: a request needs at least one prompt token")
    return ids


def _out_of_vocabulary(ids: list[int], vocab_size: int) -> None:
    bad = next(t for t in ids if not 0 <= t < vocab_size)
    raise ValueError(f"prompt token id {bad} is out of the vocabulary [0, {vocab_size})")


def _min(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
