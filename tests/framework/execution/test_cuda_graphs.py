"""Decode steps at padded batch sizes: on a CPU the padded forward runs eagerly (the Triton backend
interpreted), which checks the padding and the device-side decode launch; the ``gpu`` cases capture
and replay the CUDA graphs themselves."""
import pytest
import torch

from framework import BACKENDS, LLM, SamplingParams
from framework.execution.cuda_graphs import PaddedDecode, capture_sizes, is_graph_decode
from framework.testing.parity import hf_greedy, parity_prompts

MAX_TOKENS = 12


@pytest.mark.parametrize("max_num_seqs, sizes", [(1, [1]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]),
                                                 (20, [1, 2, 4, 8, 16, 20]), (24, [1, 2, 4, 8, 16, 24])])
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def generate(path, device="cpu", padded=False, backend="triton", block_size=8, frozen_metadata=False, sampling=None,
             packed=False, **kwargs):
    """Greedy outputs (or ``sampling``'s: SamplingParams options) of six prompts of 12, 10, .., 2 output tokens
    (decode steps of 6 requests down to 1), the padding rows of each decode step run at a padded size, and the
    KV cache. ``packed``: the preparer packs its arrays as it does for a GPU (pin_memory must be patched out)."""
    max_len = max(128, block_size)
    llm = LLM(model=str(path), backend=backend, block_size=block_size, max_model_len=max_len,
              max_num_batched_tokens=max_len, num_gpu_blocks_override=64 * 8 // block_size + 2, max_num_seqs=6,
              device=device, **kwargs)
    runner = llm.engine.executor.runner
    runner.preparer.on_cpu = not packed
    if padded:
        runner.decode = PaddedDecode(runner.model, runner.backend, runner.kv_cache, capture_sizes(6), max_len,
                                     block_size)
    if frozen_metadata:
        # As a captured graph keeps it: built once per size, every later step only refilling the buffers.
        build, built = runner.backend.build_graph_metadata, {}
        runner.backend.build_graph_metadata = lambda meta: built.setdefault(meta.num_reqs, build(meta))
    sizes = []
    if runner.decode is not None:
        run = runner.decode.run

        def counted(inputs):
            sizes.append(runner.decode.size_for(inputs.attn_metadata.num_reqs) - inputs.attn_metadata.num_reqs)
            return run(inputs)

        runner.decode.run = counted
    kv_cache = runner.kv_cache
    sampling = sampling or {"temperature": 0.0}
    params = [SamplingParams(max_tokens=MAX_TOKENS - 2 * i, ignore_eos=True, **sampling) for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in parity_prompts(6, seed=3)], params)
    if sampling.get("logprobs"):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], sizes, kv_cache
    return [o.outputs[0].token_ids for o in outs], sizes, kv_cache


@pytest.mark.parametrize("preparer", ["v1", "v0"])
def test_padded_decode_steps_take_a_packed_steps_token_rows_in_one_copy(llama_ckpt, monkeypatch, preparer):
    """As on a GPU, the preparer sends its arrays in one packed transfer (forced here on the CPU): a decode step's
    token ids, positions, slots, lengths and computed counts are the rows of one ``token_rows`` tensor, which
    ``fill`` copies at once, and the padded steps sample what the eager steps sample. After each fill, the first
    rows hold the step's inputs and the rest are padding rows."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    path, _ = llama_ckpt
    seen = []
    fill = PaddedDecode.fill

    def recorded(self, inputs, size):
        rows, meta = inputs.token_rows, inputs.attn_metadata
        seen.append(rows is not None)
        if rows is not None:
            for row, tensor in zip(rows, (inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens,
                                          meta.num_computed_tokens)):
                assert row.data_ptr() == tensor.data_ptr() and torch.equal(row, tensor)
        fill(self, inputs, size)
        n = meta.num_reqs
        assert torch.equal(self.token_rows[:, :n], torch.stack([inputs.input_ids, inputs.positions, meta.slot_mapping,
                                                                meta.seq_lens, meta.num_computed_tokens]))
        assert self.token_rows[2:, n:size].tolist() == [[0] * (size - n), [1] * (size - n), [0] * (size - n)], \
            "a padding row: slot 0 of the null block, one key, none computed"
        assert torch.equal(self.block_table[:n, : meta.block_table.shape[1]], meta.block_table)

    monkeypatch.setattr(PaddedDecode, "fill", recorded)
    eager, _, eager_cache = generate(path, preparer=preparer)
    packed, pads, packed_cache = generate(path, padded=True, packed=True, preparer=preparer)
    assert packed == eager
    assert seen == [True] * (MAX_TOKENS - 1) and sum(pads) == 4
    assert torch.allclose(packed_cache[:, :, 1:], eager_cache[:, :, 1:], atol=1e-5)


def test_padded_decode_steps_copy_an_unpacked_steps_inputs_into_the_first_rows(llama_ckpt, monkeypatch):
    fill, unpacked = PaddedDecode.fill, []

    def recorded(self, inputs, size):
        fill(self, inputs, size)
        meta, n = inputs.attn_metadata, inputs.attn_metadata.num_reqs
        unpacked.append(inputs.token_rows is None)
        assert torch.equal(self.token_rows[:, :n], torch.stack([inputs.input_ids, inputs.positions, meta.slot_mapping,
                                                                meta.seq_lens, meta.num_computed_tokens]))

    monkeypatch.setattr(PaddedDecode, "fill", recorded)
    generate(llama_ckpt[0], padded=True)
    assert unpacked and all(unpacked)


@pytest.mark.parametrize("frozen_metadata", [False, True])
def test_padded_decode_steps_give_the_eager_steps_tokens_and_cache(llama_ckpt, frozen_metadata):
    """Decode steps run at a padded size (dummy rows in the null block) sample what the same steps run
    unpadded sample, and leave every request's cache blocks as the eager run does; also when the Triton
    backend's graph metadata is built once per size, as a replayed graph uses it (nothing read on the host)."""
    path, _ = llama_ckpt
    eager, _, eager_cache = generate(path)
    padded, pads, padded_cache = generate(path, padded=True, frozen_metadata=frozen_metadata)
    assert padded == eager
    # Decode step k runs the requests with more than k tokens to make: 6, 5 (padded to 6), 5, 4, 4, 3 (to 4) ..
    running = [sum(MAX_TOKENS - 2 * i > k for i in range(6)) for k in range(1, MAX_TOKENS)]
    assert pads == [{5: 1, 3: 1}.get(n, 0) for n in running] and sum(pads) == 4
    # Only the null block (0) differs: the dummy rows write their key there.
    assert torch.allclose(padded_cache[:, :, 1:], eager_cache[:, :, 1:], atol=1e-5)


def test_greedy_padded_decode_steps_take_the_argmax_of_the_forward_pass(llama_ckpt, monkeypatch):
    """A greedy decode step with no penalties or logprobs takes its tokens from the padded forward pass's
    argmax (inside the graph on a GPU): the sampler runs for the prefill steps alone."""
    from framework.execution.sampler import Sampler

    path, _ = llama_ckpt
    calls = []
    sample = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, meta: calls.append(len(logits)) or sample(
        self, logits, meta))
    eager, _, _ = generate(path)
    eager_calls, calls[:] = list(calls), []
    padded, pads, _ = generate(path, padded=True)
    assert padded == eager
    assert len(pads) == MAX_TOKENS - 1, "every decode step should have run padded"
    assert len(eager_calls) == len(calls) + len(pads) and calls == eager_calls[: len(calls)]


def test_every_size_writes_its_logits_and_argmax_into_one_pair_of_buffers(llama_ckpt):
    """A graph's own outputs would each stay in the shared memory pool (a [size, vocab] float32 tensor per
    graph): every size's forward pass writes into the first rows of buffers the largest one made."""
    path, _ = llama_ckpt
    llm = LLM(model=str(path), backend="triton", block_size=8, max_model_len=128, num_gpu_blocks_override=66,
              max_num_seqs=6)
    runner = llm.engine.executor.runner
    decode = runner.decode = PaddedDecode(runner.model, runner.backend, runner.kv_cache, capture_sizes(6), 128, 8)
    outputs = {size: decode.forward(size, 128) for size in (6, 4, 1)}
    vocab = llm.engine.model_config.vocab_size
    assert decode.logits.shape == (6, vocab) and decode.greedy.shape == (6,)
    for size, out in outputs.items():
        assert out.logits.data_ptr() == decode.logits.data_ptr() and out.logits.shape == (size, vocab)
        assert out.greedy.data_ptr() == decode.greedy.data_ptr() and out.greedy.shape == (size,)
    fresh = decode.forward(4, 128)
    assert torch.equal(fresh.greedy, fresh.logits.argmax(dim=-1))
    assert torch.equal(fresh.logits, runner.model.compute_logits(fresh.hidden))


@pytest.mark.parametrize("sampling", [{"temperature": 0.8, "seed": 7}, {"temperature": 0.8, "top_k": 5},
                                      {"temperature": 0.0, "logprobs": 3},
                                      {"temperature": 0.0, "repetition_penalty": 1.5, "frequency_penalty": 0.5}])
def test_padded_decode_steps_sample_from_the_forward_pass_logits(llama_ckpt, sampling):
    """Sampling, logprobs and penalties run on the padded forward pass's logits: the padded steps sample what
    the eager steps sample (seeded rows from their own generator; the others share the engine's, drawn in
    the same order), with the same logprobs."""
    path, _ = llama_ckpt
    eager, _, _ = generate(path, sampling=sampling)
    padded, pads, _ = generate(path, padded=True, sampling=sampling)
    assert sum(pads) == 4, "the decode steps should have run padded"
    if "logprobs" not in sampling:
        assert padded == eager
        return
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(padded, eager):
        assert tokens == eager_tokens
        for step, eager_step in zip(logprobs, eager_logprobs):
            assert step.keys() == eager_step.keys()
            assert all(step[t].rank == eager_step[t].rank for t in step)
            assert [step[t].logprob for t in step] == pytest.approx([eager_step[t].logprob for t in step], abs=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_each_step_runs_the_graph_bound_by_its_longest_sequence(llama_ckpt, monkeypatch, device):
    """With several bounds per size (``graph_max_seq_lens``), each padded step (on a GPU: each replayed graph)
    runs at the smallest bound at or above its longest sequence, where the Triton launch splits keys by that
    bound (1, 2 or 3 ranges here): the tokens and cache are the eager run's, and every bound is used."""
    from backends.triton_paged import load_kernels

    path, _ = llama_ckpt
    bounds = [44, 72, 128]
    monkeypatch.setattr(load_kernels(torch.device(device)), "num_splits",
                        lambda programs, longest, block_n, device: 1 + sum(longest > b for b in bounds))
    common = dict(device=device, dtype="float32")
    eager, _, eager_cache = generate(path, executor_options={"cuda_graphs": False}, **common)
    monkeypatch.setattr(BACKENDS.get("triton"), "graph_max_seq_lens", lambda self, num_reqs, max_len: bounds)
    used = []
    key_for = PaddedDecode.key_for

    def recorded(self, num_reqs, max_seq_len):
        key = key_for(self, num_reqs, max_seq_len)
        used.append((max_seq_len, key[1]))
        return key

    monkeypatch.setattr(PaddedDecode, "key_for", recorded)
    padded, _, padded_cache = generate(path, padded=device == "cpu", **common)
    assert padded == eager
    assert torch.allclose(padded_cache[:, :, 1:], eager_cache[:, :, 1:], atol=1e-5)
    assert all(bound == min(b for b in bounds if b >= longest) for longest, bound in used)
    assert {bound for _, bound in used} == set(bounds)


def test_only_decode_only_steps_within_the_largest_size_are_padded(llama_ckpt):
    path, _ = llama_ckpt
    llm = LLM(model=str(path), backend="triton", block_size=8, max_model_len=64, num_gpu_blocks_override=32,
              max_num_seqs=4)
    preparer = llm.engine.executor.runner.preparer
    seen = []
    prepare = preparer.prepare

    def recorded(out):
        inputs = prepare(out)
        seen.append((inputs.attn_metadata.max_query_len, is_graph_decode(inputs, 4), is_graph_decode(inputs, 1)))
        return inputs

    preparer.prepare = recorded
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
                 SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert seen[0] == (3, False, False), "the prefill step"
    assert seen[1:] == [(1, True, False)] * 2, "two decode steps of two requests"


def test_cuda_graphs_are_refused_where_they_cannot_run(llama_ckpt):
    path, _ = llama_ckpt
    common = dict(model=str(path), max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="executor.cuda_graphs=true needs a CUDA device, not cpu"):
        LLM(backend="triton", executor_options={"cuda_graphs": True}, **common)
    with pytest.raises(ValueError, match="executor.cuda_graphs must be auto, true or false, got 'yes'"):
        LLM(executor_options={"cuda_graphs": "yes"}, **common)
    llm = LLM(backend="triton", **common)  # auto: no graphs on a CPU
    assert llm.engine.executor.runner.decode is None


def test_a_backend_without_a_capturable_decode_says_so():
    backend = BACKENDS.create("torch_paged", num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, block_size=8,
                              dtype=torch.float32, device="cpu")
    assert not backend.graph_decode
    with pytest.raises(NotImplementedError, match="'torch_paged' has no capturable decode"):
        backend.build_graph_metadata(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend, dtype, sampling", [("triton", "float32", None), ("triton", "bfloat16", None),
                                                     ("flash_attn", "bfloat16", None),
                                                     ("triton", "float32", {"temperature": 0.8, "seed": 7})])
def test_on_a_gpu_replayed_graphs_give_the_eager_tokens(llama_ckpt, backend, dtype, sampling):
    """The captured graphs (default on CUDA) sample what eager decode steps sample (greedy: the graph's own
    argmax; seeded: from the graph's logits), every decode step through them, and leave the cache blocks as
    the eager run does."""
    block_size = 8
    if backend == "flash_attn":
        from backends.flash_attn import missing_requirements

        block_size = 256
        if missing_requirements(block_size, torch.bfloat16, torch.device("cuda"), 32):
            pytest.skip("flash-attn cannot run here")
    path, _ = llama_ckpt
    common = dict(device="cuda", backend=backend, block_size=block_size, dtype=dtype, sampling=sampling)
    eager, none, eager_cache = generate(path, executor_options={"cuda_graphs": False}, **common)
    graphs, pads, graph_cache = generate(path, **common)
    assert none == [] and len(pads) == MAX_TOKENS - 1, "every decode step should have replayed a graph"
    assert graphs == eager
    atol = 1e-5 if dtype == "float32" else 2e-2
    assert torch.allclose(graph_cache[:, :, 1:].float(), eager_cache[:, :, 1:].float(), atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_on_a_gpu_a_decode_step_runs_no_synchronising_operation(llama_ckpt, async_scheduling):
    """A decode step's only wait is for sampled tokens, copied to pinned memory and waited for on an event (the
    step's own, or with async scheduling the step before's): torch's sync debug mode, which warns at each
    synchronising call, finds none."""
    import warnings

    from framework import EngineConfig, LLMEngine

    path, _ = llama_ckpt
    engine = LLMEngine(EngineConfig(model=str(path), backend="triton", device="cuda", block_size=16, max_model_len=128,
                                    num_gpu_blocks_override=64, max_num_seqs=4, async_scheduling=async_scheduling))
    for i in range(3):
        engine.add_request(str(i), [5 + i, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], [str(w.message) for w in syncs]
    engine.abort_request([str(i) for i in range(3)])
    engine.step()


def test_a_lone_request_decodes_padded_from_its_own_blocks(llama_ckpt):
    """Its first decode step finds the persistent block table untouched, and it ends in the last, partial block of a
    max_model_len that is no whole number of blocks: the padded steps read its own blocks, its tokens are
    transformers'."""
    path, hf_model = llama_ckpt
    llm = LLM(model=str(path), backend="triton", block_size=8, max_model_len=60, num_gpu_blocks_override=16,
              max_num_seqs=4)
    runner = llm.engine.executor.runner
    runner.decode = PaddedDecode(runner.model, runner.backend, runner.kv_cache, capture_sizes(4), 60, 8)
    prompt = list(range(3, 49))  # 46 + 12 tokens: 8 blocks, the last of max_model_len's 7.5
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                     ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)
