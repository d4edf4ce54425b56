"""Offline throughput: this engine against transformers' ``generate`` and continuous batching.

Same random-weight tiny Llama (built with transformers, saved with ``save_pretrained`` and loaded
through this project's loader), same deterministic workload, same thread count, greedy,
ignore_eos. Prints useful output tokens per second for each side, the ratios, whether the
greedy outputs agree, and how busy the model's matrix multiplies keep the CPU compared with a
plain large GEMM on the same threads.

    python experiments/bench_throughput.py                 # the issue's workload (256 requests)
    python experiments/bench_throughput.py --num-requests 64 --skip-hf-generate
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from framework import EngineConfig  # noqa: E402
from models import resolve_model  # noqa: E402


def build_checkpoint(path: str, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      initializer_range=0.05)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # ignore_eos on every side
    model.save_pretrained(path)
    return model


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 1024) for _ in range(rng.randint(32, 256))], rng.randint(16, 128)) for _ in range(n)]


def run_engine(path: str, work, args) -> tuple[float, list[list[int]], dict]:
    from framework import LLM, SamplingParams

    llm = LLM(model=path, **engine_kwargs(args))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    linear_time = [0.0]
    if args.profile_linear:
        _time_linears(llm.engine.executor.model, linear_time)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params)
    elapsed = time.perf_counter() - t0
    return elapsed, [o.outputs[0].token_ids for o in outs], {"linear_s": linear_time[0]}


def engine_kwargs(args) -> dict:
    return dict(backend=args.backend, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=512, dtype="float32")


def check_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before any model is built: a bad count or engine option used to end in a
    traceback (torch's set_num_threads, range(), the engine's config), --num-requests 0 in a
    table of zeros."""
    for name in ("num_requests", "threads", "hf_batch", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    from framework import BACKENDS
    from framework.common.registry import UnavailableError

    try:  # the checkpoint has tiny-llama's shapes, so its config is checked alike
        backend = BACKENDS.get(args.backend)
        EngineConfig(model="tiny-llama", **engine_kwargs(args))
        cfg = resolve_model("tiny-llama").config
        # Built here as the engine builds it: one this machine cannot run says why before the checkpoint is made.
        backend(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                scale=cfg.head_dim ** -0.5, block_size=EngineConfig.block_size, dtype=torch.float32,
                device=torch.device("cpu"))
    except (ValueError, UnavailableError) as exc:
        ap.error(str(exc).splitlines()[0])


def _time_linears(model: torch.nn.Module, acc: list[float]) -> None:
    """Wrap every nn.Linear to add its wall time to acc[0] (the model's matrix work)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            forward = module.forward

            def timed(x, _f=forward):
                t = time.perf_counter()
                y = _f(x)
                acc[0] += time.perf_counter() - t
                return y

            module.forward = timed


def run_hf_generate(model, work, batch: int) -> tuple[float, list[list[int]]]:
    """Plain ``generate`` in batches of ``batch`` (left padding), each request cut to its length."""
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=max(m for _, m in chunk), do_sample=False,
                             pad_token_id=0)
        outs += [gen[j, width:width + m].tolist() for j, (_, m) in enumerate(chunk)]
    return time.perf_counter() - t0, outs


#: How long to wait for transformers' continuous batching's next finished request before giving up.
RESULT_TIMEOUT_S = 600


def run_hf_continuous(model, work) -> tuple[float, list[list[int]]]:
    """transformers' continuous batching with each request's own max_new_tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=128, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=m) for p, m in work]
        results = {}
        while len(results) < len(ids):
            # Its requests advance together, so on 2 cores the first may finish only after minutes.
            r = manager.get_result(timeout=RESULT_TIMEOUT_S)
            if r is None:
                raise RuntimeError(f"transformers continuous batching returned no result for {RESULT_TIMEOUT_S} s "
                                   f"({len(results)} of {len(ids)} requests finished)")
            if r.is_finished():
                results[r.request_id] = r
    finally:
        manager.stop(block=True)
    elapsed = time.perf_counter() - t0
    return elapsed, [list(results[i].generated_tokens) for i in ids]


def gemm_peak(threads: int) -> float:
    """FLOP/s of a large float32 GEMM on this machine and thread count."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    n, t0 = 20, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 1024 ** 3 * n / (time.perf_counter() - t0)


def agree(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    return f"{same}/{len(a)} requests identical"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default=EngineConfig.backend, help="attention backend (default: the engine's)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--hf-batch", type=int, default=32, help="batch size for plain generate")
    ap.add_argument("--skip-hf-generate", action="store_true")
    ap.add_argument("--skip-hf-continuous", action="store_true")
    ap.add_argument("--profile-linear", action="store_true", help="time the model's linear layers")
    args = ap.parse_args(argv)
    check_arguments(ap, args)
    torch.set_num_threads(args.threads)
    work = workload(args.num_requests, args.seed)
    useful = sum(m for _, m in work)
    print(f"workload: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, {useful} output tokens; "
          f"threads={args.threads}")
    with tempfile.TemporaryDirectory() as path:
        hf = build_checkpoint(path, args.seed)
        rows = []
        t, ours, extra = run_engine(path, work, args)
        rows.append((f"servelab ({args.backend})", t))
        if not args.skip_hf_generate:
            t_gen, gen = run_hf_generate(hf, work, args.hf_batch)
            rows.append((f"transformers generate (batch {args.hf_batch})", t_gen))
            print(f"greedy agreement with generate: {agree(ours, gen)}")
        if not args.skip_hf_continuous:
            t_cb, cb = run_hf_continuous(hf, work)
            rows.append(("transformers continuous batching", t_cb))
            print(f"greedy agreement with continuous batching: {agree(ours, cb)}")
    base = rows[0][1]
    print(f"\n{'side':44s} {'seconds':>8s} {'out tok/s':>10s} {'servelab x':>10s}")
    for name, t in rows:
        print(f"{name:44s} {t:8.2f} {useful / t:10.0f} {t / base:10.2f}")
    if args.profile_linear:
        cfg = resolve_model("tiny-llama").config  # the same shapes as build_checkpoint's model
        head = cfg.vocab_size * cfg.hidden_size
        body = 2 * (cfg.num_params() - 2 * head)  # per computed token; the embedding is a lookup
        computed = sum(len(p) for p, _ in work) + useful - len(work)  # prompts + fed-back outputs
        flops = body * computed + 2 * head * useful  # the LM head runs only on rows that sample
        peak = gemm_peak(args.threads)
        linear = extra["linear_s"]
        print(f"\nlinear layers: {linear:.2f}s of {base:.2f}s ({100 * linear / base:.0f}%), "
              f"{flops / linear / 1e9:.1f} GFLOP/s vs {peak / 1e9:.1f} GFLOP/s large-GEMM peak "
              f"({100 * flops / linear / peak:.0f}%)")


if __name__ == "__main__":
    main()
