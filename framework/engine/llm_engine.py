"""``LLMEngine``: requests in, scheduler + executor each step, ``RequestOutput``s out."""
from __future__ import annotations

import dataclasses
import errno
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from framework.common.clock import Clock
from framework.common.config import EngineConfig
from framework.common.detokenizer import IncrementalDetokenizer
from framework.common.outputs import RequestOutput
from framework.common.request import Request
from framework.common.sampling_params import RequestOutputKind, SamplingParams
from framework.engine.logprobs import append_logprobs, append_prompt_logprobs
from framework.engine.output_processor import OutputProcessor
from framework.engine.parallel_sampling import SampleForks
from framework.engine.prompts import Prompt, cache_salt, check_request_args, tokenize
from framework.execution.executor import EXECUTORS, ExecutorOutput, check_kv_capacity, kv_cache_setting
from framework.kv.block_allocator import ALLOCATORS
from framework.scheduling.output import SchedulerOutput
from framework.scheduling.policy import POLICIES, SchedulerPolicy
from framework.scheduling.scheduler import Scheduler
from models.config import ModelConfig
from models.loader import ModelSource, resolve_model

logger = logging.getLogger(__name__)

#: A default max_model_len larger than this is capped: the persistent batch and the RoPE table
#: are sized by it, and tiny CPU experiments do not need 128k-token rows.
DEFAULT_MAX_MODEL_LEN_CAP = 8192
#: The token budget when none is given (vLLM's), before a policy that prefills each prompt whole raises it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


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


class CheckedConfig(NamedTuple):
    """What ``check_before_loading`` found: the model's source, the policy built, and two traits of the parts."""

    source: ModelSource
    policy: SchedulerPolicy
    forks_parallel_samples: bool
    async_capable: bool
    sampling_defaults: dict[str, Any]


def check_before_loading(config: EngineConfig, max_prompt_len: int | None = None) -> CheckedConfig:
    """What an engine of ``config`` refuses before it loads anything (the model's config, every part's name, the
    token budget, async scheduling, the policy's and allocator's options, a KV cache given in blocks that cannot hold
    a request): ValueError or UnavailableError, one line.
    Resolves ``config``'s max_model_len and token budget in place."""
    source = resolve_model(config.model)
    config.max_model_len = resolve_max_model_len(config.max_model_len, source.config)
    sampling_defaults = generation_defaults(config, source)
    # Resolve every name before loading anything, so a typo fails in milliseconds.
    POLICIES.get(config.policy)
    ALLOCATORS.get(config.allocator)
    config.max_num_batched_tokens = resolve_token_budget(config, config.max_model_len)
    check_token_budget(config.policy, config.max_num_batched_tokens, config.max_model_len, max_prompt_len)
    if config.num_gpu_blocks_override is not None:  # the KV cache's size is known before anything is built
        check_kv_capacity(config, config.num_gpu_blocks_override)
    # The tensor parts' registries load torch (about 2 s), which a simulated run never needs: they are
    # checked only when the run names other parts, so a typo is still caught. Their options are not (the
    # default backend's config file sets some in every run), and a simulated run builds neither part.
    defaults = EngineConfig.backend, EngineConfig.preparer
    preparer_forks = False  # the default preparer (v1) runs n samples as n requests
    preparer_defers = True
    if config.executor == "model" or (config.backend, config.preparer) != defaults:
        from framework.execution.attention import BACKEND_ARGUMENTS, BACKENDS
        from framework.execution.input_preparer import PREPARER_ARGUMENTS, PREPARERS

        # Their options' names (a sweep's pre-check runs this, and a simulated run builds neither part).
        BACKENDS.check_options(config.backend, config.backend_options, **dict.fromkeys(BACKEND_ARGUMENTS))
        PREPARERS.check_options(config.preparer, config.preparer_options, **dict.fromkeys(PREPARER_ARGUMENTS))
        preparer_forks = PREPARERS.get(config.preparer).forks_parallel_samples
        preparer_defers = PREPARERS.get(config.preparer).defers_sampled
    executor_async = EXECUTORS.get(config.executor).supports_async
    async_capable = executor_async and preparer_defers
    if config.async_scheduling is True and not async_capable:
        lacking = [part for part, ok in (
            (f"executor={config.executor}, whose steps are not run without waiting (model and sim's are)",
             executor_async),
            (f"preparer={config.preparer}, which does not defer sampled tokens (v1 does)", preparer_defers)) if not ok]
        raise ValueError(f"async_scheduling=true cannot run with {' nor '.join(lacking)}: set async_scheduling "
                         f"to auto or false")
    policy = POLICIES.create_with(config.policy, config.policy_options)
    # The allocator is built once the KV cache's size is known: its options' names and values are checked now.
    ALLOCATORS.check_options(config.allocator, config.allocator_options, num_blocks=0, block_size=config.block_size,
                             num_cpu_blocks=0, enable_prefix_caching=config.enable_prefix_caching)
    ALLOCATORS.get(config.allocator).check_option_values(**config.allocator_options)
    return CheckedConfig(source, policy, preparer_forks, async_capable, sampling_defaults)


def generation_defaults(config: EngineConfig, source: ModelSource) -> dict[str, Any]:
    """The ``SamplingParams`` options a request leaves unset take from the model (``EngineConfig.generation_config``):
    with ``auto`` those its ``generation_config.json`` sets, with ``vllm`` none. ValueError, naming the file, for one
    ``SamplingParams`` refuses."""
    if config.generation_config == "vllm" or not source.sampling_defaults:
        return {}
    try:
        SamplingParams(**source.sampling_defaults)
    except ValueError as exc:
        raise ValueError(f"{source.path}/generation_config.json sets a default sampling option that is refused: {exc} "
                         f"(generation_config=vllm ignores the file's sampling options)") from None
    return dict(source.sampling_defaults)


class LLMEngine:
    """Online serving core. ``add_request`` queues work, each ``step`` runs one batch and returns
    outputs for the requests that progressed (a new token, or finished). Single-threaded."""

    def __init__(self, config: EngineConfig | None = None, clock: Clock | None = None, *,
                 max_prompt_len: int | None = None, **kwargs: Any) -> None:
        """Built from ``config``, or from ``EngineConfig`` keyword arguments: not both. ``max_prompt_len``: the
        longest prompt the caller will send, when it knows (a run knows its workload's), which the token budget of
        a policy that prefills each prompt whole must hold instead of ``max_model_len``; a longer one is ignored."""
        if config is not None and kwargs:
            # Each would otherwise be dropped without a word, the config's value used instead.
            raise ValueError(f"LLMEngine takes an EngineConfig or EngineConfig keyword arguments, not both: "
                             f"set {', '.join(sorted(kwargs))} in the EngineConfig")
        self.config = config = config or EngineConfig(**kwargs)
        self.clock = clock or EXECUTORS.get(config.executor).make_clock()
        checked = check_before_loading(config, max_prompt_len)
        self.source, self.policy = checked.source, checked.policy
        #: The options of ``default_sampling_params`` that differ from ``SamplingParams()``'s (``generation_defaults``).
        self.sampling_defaults = checked.sampling_defaults
        self.model_config = self.source.config
        self.executor = EXECUTORS.create_with(config.executor, config.executor_options, config, self.source, self.clock)
        #: Whether a step is scheduled while the one before runs (``EngineConfig.async_scheduling``).
        self.async_scheduling = config.async_scheduling is True or (
            config.async_scheduling == "auto" and checked.async_capable and self.executor.device.startswith("cuda"))
        # The step launched and not yet collected (async scheduling): its output, the executor's handle,
        # and its seeded generators' states before it.
        self._in_flight: tuple[SchedulerOutput, Any, list[tuple[Any, Any]]] | None = None
        num_blocks, num_cpu_blocks = self.executor.kv_block_counts()
        check_kv_capacity(config, num_blocks)
        try:
            self.executor.initialize(num_blocks, num_cpu_blocks)
        except (MemoryError, OSError, RuntimeError) as exc:
            if not _out_of_memory(exc):
                raise
            raise ValueError(f"the KV cache of {num_blocks} blocks x {config.block_size} tokens does not fit in "
                             f"{self.executor.device} memory ({type(exc).__name__}); lower "
                             f"{kv_cache_setting(config)}") from None
        self.allocator = ALLOCATORS.create_with(config.allocator, config.allocator_options, num_blocks=num_blocks,
                                                block_size=config.block_size, num_cpu_blocks=num_cpu_blocks,
                                                enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.policy, self.allocator, self.clock)
        self.tokenizer = self.executor.tokenizer
        self._eos = frozenset(self.model_config.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        # vLLM v0's parallel sampling (InputPreparer.forks_parallel_samples): an n > 1 request prefills
        # one leader and forks the others from it; simulated runs fork too, so they schedule as real ones.
        self._fork_samples = self.executor.samples_forks and checked.forks_parallel_samples
        self.forks = SampleForks(self.scheduler, config.preparer)
        #: Whether a seeded request was ever added: only then does a step save generator states.
        self._any_seeded = False
        self._generator_device = self.executor.device
        self.step_callbacks: list[Callable[[StepStats, SchedulerOutput], None]] = []
        self.num_steps = 0
        self._stalled_steps = 0

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt given as text, token ids or a vLLM-style dict."""
        return tokenize(prompt, self.tokenizer, self.model_config.vocab_size, self.config.model)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue one request; ValueError, with nothing queued, for a bad prompt or argument. ``arrival_time`` (default:
        now) is a time on the engine's clock, ``clock.now()``: seconds since it started (simulated ones, simulated);
        a ``time.time()`` timestamp, which vLLM takes, is refused."""
        # abort_request takes only str ids (an iterable means several): an int id could never be aborted.
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}: {request_id!r}")
        # Only None means the defaults: a falsy mistake ([], {}, 0) would otherwise pass as them.
        params = self.default_sampling_params() if params is None else params
        check_request_args(params, arrival_time, priority)
        if arrival_time is not None:
            self._check_arrival_time(arrival_time)
        self.check_params(params)
        ids, text = self.tokenize(prompt)
        salt = cache_salt(prompt)
        if request_id in self.output_processor.requests or request_id in self.scheduler.requests:
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
                # Sample i takes seed + i (as vLLM), wrapped into SamplingParams' signed 64 bits: a
                # seed near the top is valid and must not fail for the samples after it.
                seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
                # The prompt's logprobs are the request's, not a sample's: the first computes them.
                prompt_logprobs = params.prompt_logprobs if i == 0 else None
                child_params = dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
            req = Request(rid, ids, child_params, arrival, priority=priority, eos_token_ids=self._eos,
                          max_model_len=self.config.max_model_len, prompt=text,
                          parent_id=request_id if params.n > 1 else None, index=i, cache_salt=salt)
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
        self.output_processor.requests[request_id] = children
        if len(children) > 1 and self._fork_samples:
            leader = children[0]
            self.forks.add(leader, children[1:])
            self.scheduler.add_request(leader)
            if leader.is_finished:  # ignored on arrival
                self.forks.settle([leader])
            return
        for req in children:
            self.scheduler.add_request(req)

    def _check_arrival_time(self, arrival_time: float) -> None:
        """ValueError for an arrival time nearer the current Unix time than to the engine clock's reading: read on
        the engine's clock, a ``time.time()`` timestamp would put the arrival decades ahead (latencies of -1.8e9 s)."""
        now = self.clock.now()
        if arrival_time > now and arrival_time - now > abs(arrival_time - time.time()):
            raise ValueError(f"arrival_time={arrival_time!r} is a time.time() timestamp, not a time on the engine's "
                             f"clock (engine.clock.now(): {now:.6g} s since it started): pass None for now, or "
                             f"engine.clock.now() - (time.time() - t) for a request that arrived at Unix time t")

    def default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a request given none: ``SamplingParams()`` with the model's generation
        config applied (``EngineConfig.generation_config``), as vLLM's ``LLM.get_default_sampling_params``."""
        return SamplingParams(**self.sampling_defaults)

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
        return bool(sep) and any(r.request_id == rid and not r.is_finished for r in self.output_processor.requests.get(group, ()))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = list(request_id) if isinstance(request_id, Iterable) and not isinstance(request_id, str) else [request_id]
        if not all(isinstance(rid, str) for rid in ids):
            raise ValueError(f"abort_request takes a request id (str) or an iterable of them, got {request_id!r}")
        for rid in ids:
            for req in self.output_processor.requests.get(rid, []):
                aborted = self.scheduler.abort_request(req.request_id)
                if aborted is not None and aborted.forks:
                    # A v0 leader aborted before its prompt completed takes its unforked samples
                    # with it here, so is_finished says so at once, not after the next step.
                    self.forks.settle([aborted])

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def is_finished(self, request_id: str) -> bool:
        """Whether every sequence of ``request_id`` has finished, its output perhaps not yet made
        (a request ignored on arrival finishes in ``add_request``; its output comes with the next
        step). An unknown id, or one whose final output was made, counts as finished."""
        return all(r.is_finished for r in self.output_processor.requests.get(request_id, ()))

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # -- one step --------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one step; returns an output for each request that progressed, as its
        ``SamplingParams.output_kind`` says, or with ``final_only`` one complete output (whatever
        the kind) for each request that finished, sparing a batch run a per-step cumulative output.
        With async scheduling, the tokens a step returns are those of the step launched by the call before."""
        if self.async_scheduling:
            return self._step_async(final_only)
        start = self.clock.now()
        out = self.scheduler.schedule()
        seeded = _seeded_generator_states(out) if out.runs and self._any_seeded else []
        try:
            result = self.executor.execute(out) if out.runs else ExecutorOutput()
        except BaseException:
            # Recomputed requests sample these positions again: seeded generators go back to the
            # step's start (the sampler may have drawn before failing), so they sample the same.
            for generator, state in seeded:
                generator.set_state(state)
            self.scheduler.step_failed(out)
            raise
        sampled = result.sampled
        if result.prompt_logprobs:
            append_prompt_logprobs(self.scheduler.requests, result.prompt_logprobs, self.tokenizer, self.config.executor)
        # One time for the step's tokens, forks' first tokens included: a streaming client gets
        # them together, and RequestMetrics.token_times counts one entry per step.
        now = self.clock.now()
        if self.forks.leaders:
            forked = self.forks.fork(result, now)
            if result.logprobs:
                append_logprobs(forked, result.logprobs, self.tokenizer, self.config.executor)
        progressed = self.scheduler.update_from_output(out, sampled, now)
        if result.logprobs:
            append_logprobs(progressed, result.logprobs, self.tokenizer, self.config.executor)
        done_elsewhere = self.scheduler.take_finished_outside_step()
        self.forks.settle(done_elsewhere)
        self._check_progress(out, done_elsewhere)
        outputs = self._outputs(done_elsewhere, progressed, final_only)
        self._count_step(out, start, outputs)
        return outputs

    def _outputs(self, done_elsewhere: list[Request], progressed: list[Request], final_only: bool) -> list[RequestOutput]:
        # Requests finished outside the step (ignored, aborted) finished before the step's own
        # finishes: their outputs come first, in finish order, as a decode run delivers them.
        if final_only:
            return self.output_processor.final_outputs(done_elsewhere + [r for r in progressed if r.is_finished])
        return self.output_processor.make_outputs(done_elsewhere + progressed)

    def _count_step(self, out: SchedulerOutput, start: float, outputs: list[RequestOutput]) -> None:
        self.num_steps += 1
        if self.step_callbacks:
            stats = self._step_stats(out, start, sum(o.finished for o in outputs))
            for callback in self.step_callbacks:
                callback(stats, out)

    def _step_async(self, final_only: bool) -> list[RequestOutput]:
        """``step`` with async scheduling: schedule and launch step N+1 (the scheduler sees step N committed,
        its sampled tokens placeholders), then wait for step N's tokens, update and commit N+1."""
        start = self.clock.now()
        out = self.scheduler.schedule()
        seeded = _seeded_generator_states(out) if out.runs and self._any_seeded else []
        prev, self._in_flight = self._in_flight, None
        handle = result = None
        try:
            if out.runs:
                handle = self.executor.launch(out)
            if prev is not None:
                result = self.executor.collect(prev[1])
        except BaseException:
            self._async_step_failed(out, prev, seeded)
            raise
        progressed: list[Request] = []
        try:
            if prev is not None and result is not None:
                if result.prompt_logprobs:
                    # A request aborted while its prompt chunk ran is gone: its entries go with it.
                    aborted = {r.request_id for r in prev[0].scheduled if r.is_finished}
                    append_prompt_logprobs(self.scheduler.requests, {
                        rid: entries for rid, entries in result.prompt_logprobs.items() if rid not in aborted},
                        self.tokenizer, self.config.executor)
                progressed = self.scheduler.update_from_committed(prev[0], result.sampled, self.clock.now())
                if result.logprobs:
                    append_logprobs(progressed, result.logprobs, self.tokenizer, self.config.executor)
            done_elsewhere = self.scheduler.take_finished_outside_step()
            self._check_progress(out, done_elsewhere, resolved=prev is not None)
            outputs = self._outputs(done_elsewhere, progressed, final_only)
        finally:
            # After the outputs, which must not show its placeholders; whatever happened, as the runner ran it.
            if handle is not None:
                self.scheduler.commit(out)
                self._in_flight = (out, handle, seeded)
        self._count_step(out, start, outputs)
        return outputs

    def _async_step_failed(self, out: SchedulerOutput, prev: tuple[SchedulerOutput, Any, list[tuple[Any, Any]]] | None,
                           seeded: list[tuple[Any, Any]]) -> None:
        """Both the step being launched and the one in flight failed: their requests are recomputed, their
        seeded generators back at their states before the older one."""
        for generator, state in seeded + (prev[2] if prev is not None else []):
            generator.set_state(state)
        if prev is not None:
            # First, so that the blocks prev was filling count as unwritten when out's requests are freed.
            self.scheduler.uncommit(prev[0])
        self.scheduler.step_failed(out)
        if prev is not None:
            self.scheduler.step_failed(prev[0])

    def count_steps(self, num_steps: int) -> None:
        """Count ``num_steps`` steps taken outside ``step`` (a simulator's decode run), each of which ran."""
        self.num_steps += num_steps
        self._stalled_steps = 0

    def _check_progress(self, out: SchedulerOutput, done: list[Request], resolved: bool = False) -> None:
        if out.runs or done or resolved or not self.scheduler.has_unfinished_requests():
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
        decode = out.num_decode_tokens
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


def resolve_max_model_len(max_model_len: int | None, model_config: ModelConfig) -> int:
    """``max_model_len``, or for None the model's longest context capped at ``DEFAULT_MAX_MODEL_LEN_CAP``; ValueError
    when it exceeds the model's context."""
    limit, why = model_config.max_context()
    if max_model_len is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {why} of {limit}")
    return max_model_len


def resolve_token_budget(config: EngineConfig, max_model_len: int) -> int:
    """``config.max_num_batched_tokens``, or for None vLLM v0's default: 2048 (at least ``max_num_seqs``), raised to
    ``max_model_len`` for a policy that prefills each prompt whole."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_num_seqs)
    return budget if POLICIES.get(config.policy).chunks_prefills else max(budget, max_model_len)


def check_token_budget(policy: str, max_num_batched_tokens: int, max_model_len: int,
                       max_prompt_len: int | None = None) -> None:
    """ValueError, one line, when ``policy`` prefills each prompt whole and the token budget is below the longest
    prompt it may be sent: ``max_prompt_len`` where the caller knows it, else ``max_model_len`` (vLLM's check)."""
    if POLICIES.get(policy).chunks_prefills:
        return
    budget = max_num_batched_tokens
    if max_prompt_len is None:
        if budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens={budget} is below max_model_len={max_model_len} and policy "
                             f"{policy!r} prefills each prompt whole, so a longer prompt could never run: raise "
                             f"max_num_batched_tokens to >= {max_model_len}, lower max_model_len to <= {budget}, or "
                             f"use a policy that chunks prefills (chunked)")
        return
    longest = min(max_prompt_len, max_model_len)  # a longer one is refused for its length whatever the budget
    if budget < longest:
        raise ValueError(f"max_num_batched_tokens={budget} is below the longest prompt sent ({longest} tokens) and "
                         f"policy {policy!r} prefills each prompt whole, so it could never run: raise "
                         f"max_num_batched_tokens to >= {longest}, send shorter prompts, or use a policy that chunks "
                         f"prefills (chunked)")


def _seeded_generator_states(out: SchedulerOutput) -> list[tuple[Any, Any]]:
    """The generator and its state of each seeded request ``out`` schedules, and of each parallel
    sample still to be forked from one of them (its first token is drawn from its own generator)."""
    return [(r.generator, r.generator.get_state()) for req in out.scheduled for r in (req, *req.forks)
            if r.generator is not None]


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out: Python's, the OS's (ENOMEM, a mapping refused) or torch's (CUDA)."""
    return (isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM)
            or type(exc).__name__ == "OutOfMemoryError")
