"""Greedy parity with transformers and end-to-end speed on one GPU, for ``experiments/gpu_check.sh``.

    python experiments/gpu_e2e.py parity    # every backend x bf16/fp16/fp32 vs HF generate on CUDA
    python experiments/gpu_e2e.py speed     # random 1.1B Llama (TinyLlama's shape), bf16: LLM.generate vs
                                            # HF generate, CUDA graphs on and off, decode step vs HBM roofline

``--device cpu --tiny`` runs either on a tiny model on the CPU (a dry run of the script itself). Prints one
line per case (``PARITY``/``E2E``); exits non-zero if a parity case fails or differs from HF for real: at its
first differing token, the float32 model (the arbiter: HF in bf16/fp16 is an approximation too) rates this
engine's token below its own first choice by more than that dtype's rounding (``TIE``).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import importlib.util
import pstats
import random
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

import torch
import transformers

from bench_attention import copy_bandwidth  # experiments/ is on sys.path; it puts the repository there too
from framework import BACKENDS, LLM, SamplingParams

#: The float32 logit gap below which a greedy choice in this dtype is rounding, not a bug.
TIE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.03}


def fp32_shortfall(model32: transformers.PreTrainedModel, context: list[int], token: int,
                   device: str) -> tuple[float, int]:
    """How far below the float32 model's best next-token logit after ``context`` ``token``'s is, and its best."""
    with torch.no_grad():
        logits = model32(torch.tensor([context], device=device)).logits[0, -1].double()
    return float(logits.max() - logits[token]), int(logits.argmax())


def checkpoint(cfg: transformers.LlamaConfig, device: str,
               dtype: torch.dtype) -> tuple[transformers.PreTrainedModel, str]:
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg)
    hf = hf.to(dtype).eval()
    hf.generation_config.eos_token_id = None
    path = tempfile.mkdtemp()
    hf.save_pretrained(path)
    return hf, path


def backends(device: str) -> list[str]:
    names = ["torch_paged", "triton", "naive"]
    if device == "cuda" and importlib.util.find_spec("flash_attn"):
        names.append("flash_attn")
    return names


class Case(NamedTuple):
    backend: str
    graphs: bool
    fused: bool
    overlap: bool  # async scheduling
    matmul: str    # executor.decode_matmul
    kind: str      # one of KINDS: "default" is the configuration an engine on this device runs by default
    prefetch_mb: int = 0  # executor.weight_prefetch_mb
    fuse_rotary: bool = False  # backend.fuse_rotary (triton)


#: The speed cases' kinds, in the order they run for each backend (``--cases`` picks among them).
KINDS = ("default", "sync", "torch-ops", "eager", "tuned", "prefetch12", "prefetch24", "prefetch48", "fuse-rotary",
         "fuse-rotary-prefetch24")


def cases(device: str, kinds: tuple[str, ...] = KINDS) -> list[Case]:
    """What to time: every backend as by default, and on CUDA the capturable ones also without async
    scheduling (sync), with torch's operators, with graphs off (eager), with ``decode_matmul=tuned``, and with
    ``weight_prefetch_mb`` 12, 24 and 48 (TinyLlama's q/k/v are 10.5 MB, o 8.4, gate/up 46, down 23); the
    Triton backend also with ``fuse_rotary``, alone and with 24 MiB of prefetch."""
    out = []
    cuda = device == "cuda"
    for name in backends(device):
        if name == "naive":
            continue
        graphs = cuda and BACKENDS.get(name).graph_decode
        out.append(Case(name, graphs, True, cuda, "torch", "default"))
        if graphs:
            out += [Case(name, True, True, False, "torch", "sync"), Case(name, True, False, True, "torch", "torch-ops"),
                    Case(name, False, True, True, "torch", "eager"), Case(name, True, True, True, "tuned", "tuned"),
                    *(Case(name, True, True, True, "torch", f"prefetch{mb}", mb) for mb in (12, 24, 48))]
            if name == "triton":
                out += [Case(name, True, True, True, "torch", "fuse-rotary", 0, True),
                        Case(name, True, True, True, "torch", "fuse-rotary-prefetch24", 24, True)]
    return [case for case in out if case.kind in kinds]


def synced(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def parity(args: argparse.Namespace) -> int:
    size = 64 if args.tiny else 512
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=size, intermediate_size=2 * size, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                                   initializer_range=0.05)
    hf, path = checkpoint(cfg, "cpu", torch.float32)
    rng = random.Random(0)
    shared = [rng.randrange(3, 2048) for _ in range(64)]
    lengths = [rng.randrange(2, 300) for _ in range(10)] + [200 if args.tiny else 1500]
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in lengths]
    prompts += [shared + [5, 6, 7], shared + [rng.randrange(3, 2048) for _ in range(40)]]
    n, bad = args.tokens, 0
    model32 = copy.deepcopy(hf).to(device=args.device, dtype=torch.float32)
    for dtype in ("bfloat16", "float16", "float32"):
        model = copy.deepcopy(hf).to(device=args.device, dtype=getattr(torch, dtype))
        ref = []
        with torch.no_grad():
            for p in prompts:
                g = model.generate(torch.tensor([p], device=args.device), max_new_tokens=n, do_sample=False,
                                   pad_token_id=0)
                ref.append(g[0, len(p):].tolist())
        for name in backends(args.device):
            if name == "flash_attn" and dtype == "float32":
                continue
            try:
                llm = LLM(model=path, backend=name, dtype=dtype, device=args.device, policy="chunked",
                          block_size=256 if name == "flash_attn" else 16, max_model_len=2048, max_num_seqs=16,
                          max_num_batched_tokens=512, kv_cache_memory_gb=args.kv_cache_gb)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                ours = [o.outputs[0].token_ids for o in outs]
                first = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), n) for t, r in zip(ours, ref)]
                real, hf_off = [], 0
                for j, i in enumerate(first):
                    if i < n:
                        short, best = fp32_shortfall(model32, prompts[j] + ref[j][:i], ours[j][i], args.device)
                        hf_off += best != ref[j][i]
                        if short > TIE[dtype]:
                            real.append((j, i, round(short, 3)))
                graphs = llm.engine.executor.runner.decode is not None
                bad += bool(real)
                print(f"PARITY {dtype:8s} {name:11s} graphs={graphs!s:5s} async={llm.engine.async_scheduling!s:5s} "
                      f"{'FAIL' if real else 'PASS'}: "
                      f"{first.count(n)}/{len(prompts)} identical; of {sum(i < n for i in first)} differing, HF's "
                      f"token is not float32's first choice in {hf_off}; real mismatches (prompt, step, float32 "
                      f"shortfall): {real}", flush=True)
                del llm
            except Exception as exc:  # one case's failure is reported, the others still run
                bad += 1
                print(f"PARITY {dtype:8s} {name:11s} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return bad


def timed(fn, device: str):
    synced(device)
    start = time.perf_counter()
    result = fn()
    synced(device)
    return result, time.perf_counter() - start


def replay_ms(llm: LLM, key: tuple[int, int], device: str, rounds: int = 20) -> float | None:
    """The mean time of the decode forward pass alone, its CUDA graph ``key`` (size, bound on the longest
    sequence) replayed over the last decode step's inputs (it rewrites the K/V that step wrote). None without
    CUDA graphs."""
    graphs = llm.engine.executor.runner.decode
    if graphs is None or device != "cuda":
        return None
    graphs.padded_forward(key)
    _, seconds = timed(lambda: [graphs.padded_forward(key) for _ in range(rounds)], device)
    return seconds / rounds * 1e3


def per_round(prof, rounds: int, cuda: bool = True) -> tuple[list[tuple[float, float, str]], float]:
    """A profile's (µs, launches, name) per round, costliest first, by device time (on a CPU, by operator's
    own time), and their total µs."""
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    rows = sorted(((own(e) / rounds, e.count / rounds, e.key) for e in prof.key_averages() if own(e)), reverse=True)
    return rows, sum(r[0] for r in rows)


def print_top(label: str, rows: list[tuple[float, float, str]], total: float) -> None:
    """The 15 costliest of ``per_round``'s rows, one line each under ``label``."""
    for us, count, name in rows[:15]:
        print(f"{label}   {us / 1e3:7.3f} ms {us / max(total, 1e-9):4.0%} x{count:<5.1f} {name[:110]}", flush=True)


def kernel_times(llm: LLM, key: tuple[int, int], rounds: int = 5) -> None:
    """Print the GPU time per replay of the decode graph ``key`` by kernel (torch's profiler over ``rounds``
    replays), the 15 costliest and the total."""
    from torch.profiler import ProfilerActivity, profile

    graphs = llm.engine.executor.runner.decode
    graphs.padded_forward(key)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            graphs.padded_forward(key)
        torch.cuda.synchronize()
    rows, total = per_round(prof, rounds)
    print(f"KERNELS batch {key[0]} (sequences up to {key[1]}): {sum(r[1] for r in rows):.0f} launches, "
          f"{total / 1e3:.3f} ms of GPU time a replay", flush=True)
    print_top("KERNELS", rows, total)


def step_kernel_times(llm: LLM, prompts: list[list[int]], device: str, rounds: int = 10) -> None:
    """Print the device time per engine decode step by kernel (torch's profiler over ``rounds`` steps of
    ``prompts`` decoding together; on a CPU, by operator): the graph's kernels and everything a step launches
    around it, the 15 costliest, their total and the steps' wall time. Against ``kernel_times``, what the
    graph leaves out."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    engine = llm.engine
    params = SamplingParams(max_tokens=rounds + 8, temperature=0.0, ignore_eos=True)
    ids = [f"profiled-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    taken = []
    engine.step_callbacks.append(lambda s, o: taken.append(s))
    try:
        while not taken or taken[-1].num_prefill_tokens or taken[-1].num_decode_tokens < len(prompts):
            engine.step()
        engine.step()  # one decode step more: with async scheduling the next is already launched
        taken.clear()
        synced(device)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(rounds):
                engine.step()
            synced(device)
        wall = (time.perf_counter() - start) / rounds
    finally:
        engine.step_callbacks.pop()
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    decodes = sum(not s.num_prefill_tokens and s.num_decode_tokens == len(prompts) for s in taken)
    rows, total = per_round(prof, rounds, cuda)
    print(f"STEPKERNELS batch {len(prompts)}: {decodes}/{rounds} steps decoded every request; per step "
          f"{sum(r[1] for r in rows):.0f} {'launches' if cuda else 'operators'}, {total / 1e3:.3f} ms of "
          f"{'GPU' if cuda else 'CPU'} time in {wall * 1e3:.3f} ms (profiled)", flush=True)
    print_top("STEPKERNELS", rows, total)


def speed(args: argparse.Namespace) -> int:
    dev, bad = args.device, 0
    if args.tiny:
        cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    else:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                       num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hf, path = checkpoint(cfg, dev, dtype)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    bandwidth = copy_bandwidth(torch.device(dev), 1024 if dev == "cuda" else 16)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * dtype.itemsize
    rng = random.Random(0)
    for num_reqs in args.batches:
        prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(num_reqs)]
        ids = torch.tensor(prompts, device=dev)
        with torch.inference_mode():
            hf.generate(ids[:2, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
            out, t_hf = timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                                  do_sample=False, pad_token_id=0), dev)
        hf_tokens = out[:, args.prompt_len:].tolist()
        # One decode step reads the weights and each request's mean cached K/V once.
        roofline = (weights + num_reqs * (args.prompt_len + args.tokens / 2) * kv_per_token) / bandwidth
        print(f"E2E batch {num_reqs}: hf_generate {num_reqs * args.tokens / t_hf:.0f} tok/s ({t_hf:.2f} s); copy "
              f"bandwidth {bandwidth / 1e9:.0f} GB/s; decode-step HBM roofline {roofline * 1e3:.3f} ms", flush=True)
        for name, graphs, fused, overlap, matmul, kind, prefetch_mb, fuse_rotary in cases(dev, args.cases):
            default = kind == "default"
            label = f"{name:11s} graphs={graphs!s:5s} fused_ops={fused!s:5s} async={overlap!s:5s} matmul={matmul}" \
                + (f" weight_prefetch_mb={prefetch_mb}" if prefetch_mb else "") + (" fuse_rotary" if fuse_rotary else "")
            try:
                start = time.perf_counter()
                llm = LLM(model=path, backend=name, dtype=str(dtype).removeprefix("torch."), device=dev,
                          block_size=256 if name == "flash_attn" else 16, max_model_len=2048, max_num_seqs=num_reqs,
                          max_num_batched_tokens=8192, enable_prefix_caching=False, async_scheduling=overlap,
                          executor_options={"cuda_graphs": graphs, "fused_ops": fused, "decode_matmul": matmul,
                                            "weight_prefetch_mb": prefetch_mb},
                          backend_options={"fuse_rotary": True} if fuse_rotary else {})
                if matmul == "tuned":
                    print(f"E2E batch {num_reqs} {label}: engine start {time.perf_counter() - start:.1f} s with "
                          f"the products timed:", flush=True)
                    for choice in llm.engine.executor.matmul_choices:
                        print(f"E2E   {choice}", flush=True)
                steps = []
                llm.engine.step_callbacks.append(lambda s, o: steps.append(s))
                reqs = [{"prompt_token_ids": p} for p in prompts]
                llm.generate(reqs, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
                steps.clear()
                params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
                outs, t = timed(lambda: llm.generate(reqs, params), dev)
                decode = [s.duration for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens == num_reqs]
                ms = statistics.median(decode) * 1e3 if decode else float("nan")
                same = sum(o.outputs[0].token_ids == h for o, h in zip(outs, hf_tokens))
                graphs = llm.engine.executor.runner.decode
                key = None if graphs is None else graphs.key_for(num_reqs, args.prompt_len + args.tokens)
                replay = None if key is None else replay_ms(llm, key, dev)
                forward = "" if replay is None else (
                    f" (its graph replay {replay:.3f} ms = {roofline * 1e3 / replay:.0%}: the rest is the step's "
                    f"CPU side)")
                if replay is not None and key[1] != graphs.bounds[key[0]][-1]:
                    longest = replay_ms(llm, (key[0], graphs.bounds[key[0]][-1]), dev)
                    forward += f"; the graph for sequences up to max_model_len (key splits) {longest:.3f} ms"
                print(f"E2E batch {num_reqs} {label} {num_reqs * args.tokens / t:8.0f} tok/s "
                      f"= {t_hf / t:.2f}x hf_generate; decode step {ms:.3f} ms = {roofline * 1e3 / ms:.0%} of the "
                      f"roofline{forward}; greedy == HF for {same}/{num_reqs}", flush=True)
                if args.profile and not kind.startswith(("sync", "torch", "eager")):
                    try:
                        if replay is not None:
                            kernel_times(llm, key)
                        step_kernel_times(llm, prompts, dev)
                    except Exception as exc:  # a figure left out, not a failed case
                        print(f"KERNELS batch {num_reqs}: not measured ({type(exc).__name__}: {exc})", flush=True)
                if args.profile and default:
                    profile = cProfile.Profile()
                    profile.runcall(llm.generate, reqs, params)
                    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)
                del llm
                if dev == "cuda":
                    torch.cuda.empty_cache()
            except Exception as exc:
                bad += 1
                print(f"E2E batch {num_reqs} {label} ERROR {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["parity", "speed"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a dry run of the script)")
    parser.add_argument("--tokens", type=int, default=None, help="output tokens (parity 32, speed 128)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--profile", action="store_true",
                        help="speed: after each default case's timed run, one more under cProfile (top 25 by own "
                             "time); and for each graph case its decode graph's replay and its engine's decode "
                             "steps by kernel under torch's profiler")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="parity: each engine's KV cache in GiB (default: sized from free memory, as engines are)")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128])
    parser.add_argument("--cases", type=lambda s: tuple(s.split(",")), default=KINDS,
                        help=f"speed: the kinds of case to time, comma-separated (default: all of {','.join(KINDS)})")
    args = parser.parse_args()
    unknown = [kind for kind in args.cases if kind not in KINDS]
    if unknown:
        parser.error(f"--cases: unknown kind {','.join(unknown)}; choose among {','.join(KINDS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu --tiny for a dry run")
    args.tokens = args.tokens or (32 if args.what == "parity" else 128)
    sys.exit(1 if (parity if args.what == "parity" else speed)(args) else 0)


if __name__ == "__main__":
    main()
