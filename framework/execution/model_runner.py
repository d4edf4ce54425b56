"""Runs one step on the device: block copies, input preparation, forward pass, sampling."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.execution.attention import AttentionBackend
from framework.execution.cuda_graphs import PaddedDecode, is_graph_decode
from framework.execution.executor import ExecutorOutput
from framework.execution.input_preparer import InputPreparer, ModelInput
from framework.execution.sampler import LogprobsTensors, Sampler
from framework.scheduling.output import SchedulerOutput


class ModelRunner:
    """Owns the KV cache ``[2, layers, blocks, block_size, kv_heads, head_dim]`` (seed 003) and, from
    the first swap, a CPU swap cache of the same layout. Decode-only steps that ``decode`` (CUDA graphs)
    takes run through it; every other step runs the model eagerly. Prompt logprobs take the logits of at
    most ``max_logit_rows`` positions at once (the most rows the memory profile samples; None: no limit)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, preparer: InputPreparer,
                 sampler: Sampler, kv_cache: torch.Tensor, num_cpu_blocks: int,
                 decode: PaddedDecode | None = None, max_logit_rows: int | None = None) -> None:
        self.model = model
        self.backend = backend
        self.preparer = preparer
        self.sampler = sampler
        self.kv_cache = kv_cache
        self.num_cpu_blocks = num_cpu_blocks
        self.decode = decode
        self.max_logit_rows = max_logit_rows
        self._cpu_cache: torch.Tensor | None = None
        self._last: LaunchedStep | None = None  # the last launched step, until collected

    @property
    def cpu_cache(self) -> torch.Tensor:
        if self._cpu_cache is None:
            shape = list(self.kv_cache.shape)
            shape[2] = self.num_cpu_blocks
            self._cpu_cache = torch.zeros(shape, dtype=self.kv_cache.dtype,
                                          pin_memory=self.kv_cache.device.type == "cuda")
        return self._cpu_cache

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """Apply the step's swap-out, swap-in and copy lists, every list reading its sources before any
        writes: within one step a block one list frees (a swapped-out block, a copy-on-write source whose
        other holders were preempted) may be another list's destination."""
        dev = self.kv_cache.device
        incoming = copied = None
        if out.blocks_to_swap_in:
            cpu_src, dev_dst = (torch.tensor(x) for x in zip(*out.blocks_to_swap_in))
            incoming = self.cpu_cache[:, :, cpu_src].to(dev)
        if out.blocks_to_copy:
            copy_src, copy_dst = (torch.tensor(x, device=dev) for x in zip(*out.blocks_to_copy))
            copied = self.kv_cache[:, :, copy_src]
        if out.blocks_to_swap_out:
            src, dst = (torch.tensor(x) for x in zip(*out.blocks_to_swap_out))
            self.cpu_cache[:, :, dst] = self.kv_cache[:, :, src.to(dev)].cpu()
        if incoming is not None:
            self.kv_cache[:, :, dev_dst.to(dev)] = incoming
        if copied is not None:
            self.kv_cache[:, :, copy_dst] = copied

    def execute(self, out: SchedulerOutput) -> ExecutorOutput:
        """Run ``out`` and return its sampled tokens (``launch`` then ``collect``)."""
        return self.collect(self.launch(out, defer=False))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, defer: bool = True) -> LaunchedStep:
        """Queue ``out``'s forward pass and sampling on the device and return without waiting for them. With
        ``defer`` its sampled tokens stay there until ``collect`` (the next step, launched before that, reads
        them from the device); at most one launched step is left uncollected when the next is launched."""
        prev = self._last
        try:
            if prev is not None and self.preparer.needs_known_tokens():
                self.collect(prev)  # a penalised row reads its whole history on the host
            self.apply_block_ops(out)
            inputs = self.preparer.prepare(out)
            if inputs is None:
                return LaunchedStep(None, ExecutorOutput())
            if inputs.deferred_tokens is not None:
                if prev is None or prev.sampled is None:
                    raise RuntimeError("a step reads deferred sampled tokens but none are in flight")
                dst, src = inputs.deferred_tokens
                inputs.input_ids[dst] = prev.sampled[src].to(inputs.input_ids.dtype)
            step = self._run(inputs)
            if defer and inputs.sample_req_ids:
                self.preparer.defer_sampled(inputs)
            self._last = step
            return step
        except BaseException:
            self._abandon()
            raise

    def _run(self, inputs: ModelInput) -> LaunchedStep:
        """Queue the forward pass, logits and sampling of a prepared step."""
        decoded = None
        if self.decode is not None and is_graph_decode(inputs, self.decode.sizes[-1]):
            decoded = self.decode.run(inputs)
            hidden = decoded.hidden
        else:
            meta = self.backend.build_metadata(inputs.attn_metadata)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, meta)
        output = ExecutorOutput()
        prompt = inputs.prompt_logprobs
        if prompt is not None:
            # Logits of the prompt positions whose logprobs are asked for, besides the sampled rows (read on
            # the host here: such a step does not overlap the next one's scheduling).
            def logits_of(rows: slice) -> torch.Tensor:
                return self.model.compute_logits(hidden.index_select(0, prompt.indices[rows]))

            output.prompt_logprobs = dict(zip(prompt.req_ids, self.sampler.prompt_logprobs(
                logits_of, prompt, self.max_logit_rows)))
        step = LaunchedStep(inputs, output)
        if not inputs.sample_req_ids:
            return step
        # index_select: 2.5x faster than advanced indexing for these rows on a CPU; on a graph's output
        # it also copies the rows out of the buffers its next replay overwrites.
        rows = inputs.logits_indices
        if decoded is not None and inputs.sampling.argmax_only:
            step.sampled = decoded.greedy.index_select(0, rows)
        else:
            logits = (decoded.logits.index_select(0, rows) if decoded is not None
                      else self.model.compute_logits(hidden.index_select(0, rows)))
            sampler_output = self.sampler.sample(logits, inputs.sampling)
            step.sampled, step.logprobs = sampler_output.sampled, sampler_output.logprobs
        if step.sampled.device.type == "cuda":
            # Copied as soon as sampled, into pinned memory: collect then waits for this copy alone.
            step.host = torch.empty(step.sampled.shape, dtype=step.sampled.dtype, pin_memory=True)
            step.host.copy_(step.sampled, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record(torch.cuda.current_stream(step.sampled.device))
        return step

    def collect(self, step: LaunchedStep) -> ExecutorOutput:
        """Wait for a launched step's sampled tokens and return its output (again, if collected before)."""
        if step.collected:
            return step.output
        output, inputs = step.output, step.inputs
        try:
            if inputs is not None and step.sampled is not None:
                if step.ready is not None:
                    step.ready.synchronize()
                    tokens = step.host.numpy()
                else:
                    tokens = step.sampled.cpu().numpy()
                self.preparer.record_sampled(inputs, tokens)
                output.sampled = dict(zip(inputs.sample_req_ids, tokens.tolist()))
                if step.logprobs is not None:
                    sampling = inputs.sampling
                    assert sampling.logprob_rows_cpu is not None and sampling.num_logprobs is not None
                    rids = map(inputs.sample_req_ids.__getitem__, sampling.logprob_rows_cpu.tolist())
                    output.logprobs = dict(zip(rids, step.logprobs.to_dicts(sampling.num_logprobs)))
        except BaseException:
            self._abandon()
            raise
        step.collected = True
        if self._last is step:
            self._last = None
        return output

    def _abandon(self) -> None:
        """After a failure: no launched step's tokens will be collected (its requests are recomputed)."""
        self._last = None
        self.preparer.cancel_deferred()


@dataclass
class LaunchedStep:
    """A step queued on the device: its input, output so far, and sampled tokens on the device (with their
    pinned host copy and the event marking it complete, on CUDA)."""

    inputs: ModelInput | None
    output: ExecutorOutput
    sampled: torch.Tensor | None = None
    logprobs: LogprobsTensors | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    collected: bool = False
