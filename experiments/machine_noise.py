"""Which kind of work slows down with a model's steps when a shared machine's speed moves.

    python experiments/machine_noise.py --seconds 150              # tiny-llama, one request at a time
    python experiments/machine_noise.py --model small-llama --window 100

One process alternates a single-request decode step of ``--model`` (the ``model`` executor, one
torch thread) with four reference probes, everything timed by process CPU time:

- ``python``: a fixed pure-Python loop (interpreter-bound work);
- ``torch_ops``: 30 additions of 256-element tensors (eager PyTorch's per-op overhead, most of a
  tiny model's step);
- ``gemm``: ten 64x256 by 256x768 matrix products (arithmetic);
- ``memory``: a sum over a 16 MB array (memory bandwidth and the shared last-level cache).

Printed: the medians of every ``--window`` steps over time (steps taken at their position's
typical context, see ``measure``), then per probe the max/min ratio of those medians and their
correlation with the steps'. A probe that moves with the steps names the
kind of disturbance behind ``sim_fidelity.py``'s noise floor (docs/simulator.md, "Why the floor
moves"); one that stays flat says that kind of work is not what varies.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

PROMPT = 100  # tokens per request before its decode steps


def make_probes() -> dict[str, Callable[[], None]]:
    import torch

    x, a, w = torch.randn(256), torch.randn(64, 256), torch.randn(256, 768)
    big = np.ones(4 << 20, dtype=np.float32)

    def python() -> None:
        total = 0
        for i in range(20_000):
            total += i * i

    def torch_ops() -> None:
        for _ in range(30):
            x + x

    def gemm() -> None:
        for _ in range(10):
            a @ w

    return {"python": python, "torch_ops": torch_ops, "gemm": gemm, "memory": lambda: big.sum()}


def measure(model: str, seconds: float, max_tokens: int = 400, seed: int = 0) -> dict[str, np.ndarray]:
    """Milliseconds of each decode step and of each probe run right after it, for ``seconds``.
    A request's context grows by a token per step, so steps are reported ``at_typical_context``
    (by their position in their request): what the machine did, not the context length."""
    from framework.common.clock import CPUClock
    from framework.common.config import EngineConfig
    from framework.engine.llm_engine import LLMEngine
    from framework.common.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, executor="model", max_model_len=PROMPT + max_tokens, num_threads=1),
                       clock=CPUClock())
    probes = make_probes()
    times: dict[str, list[float]] = {"step": [], **{name: [] for name in probes}}
    decodes: list[float] = []  # the last step's duration, when it was a decode step
    # One request at a time: a step of one token is a decode step, the prefill is PROMPT tokens.
    engine.step_callbacks.append(
        lambda stats, out: decodes.append(stats.duration) if out.total_num_scheduled_tokens == 1 else None)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    positions: list[int] = []
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        n += 1
        engine.add_request(f"r{n}", rng.integers(3, engine.model_config.vocab_size, PROMPT).tolist(), params)
        position = 0
        while engine.has_unfinished_requests() and time.perf_counter() - started < seconds:
            del decodes[:]
            engine.step()
            if not decodes:
                continue
            times["step"].append(decodes[-1])
            positions.append(position)
            position += 1
            for name, probe in probes.items():
                t0 = time.process_time()
                probe()
                times[name].append(time.process_time() - t0)
    out = {name: np.array(v) * 1e3 for name, v in times.items()}
    out["step"] = at_typical_context(out["step"], np.array(positions))
    return out


def at_typical_context(step: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``step`` divided by the median of the steps at the same position and multiplied by the
    median of all. No steps give no steps (a run too short for one). A position that only one
    request reached has nothing to be compared with (its step would come out exactly typical,
    and a run of one request a flat table): a ValueError."""
    if not len(step):
        return step
    once = int((np.bincount(positions) < 2).sum())
    if once:
        raise ValueError(f"{once} of {positions.max() + 1} step positions were reached by one request only, "
                         f"so those steps have nothing to be compared with: measure longer or lower --max-tokens")
    typical = np.zeros(positions.max() + 1)
    for pos in np.unique(positions):
        typical[pos] = np.median(step[positions == pos])
    return step / typical[positions] * np.median(step)


def summarize(times: dict[str, np.ndarray], window: int) -> dict[str, dict[str, float | list[float]]]:
    """Per series: its window medians, their max/min ratio, and (probes) their correlation with
    the steps' window medians."""
    n = len(times["step"]) // window
    if n < 2:
        raise ValueError(f"{len(times['step'])} steps make fewer than two windows of {window}: measure longer")
    medians = {name: np.median(v[:n * window].reshape(n, window), axis=1) for name, v in times.items()}

    def corr(m: np.ndarray) -> float | None:  # None where a series stays exactly flat
        return float(np.corrcoef(medians["step"], m)[0, 1]) if np.ptp(m) and np.ptp(medians["step"]) else None

    return {name: {"window_medians": m.tolist(), "max_over_min": float(m.max() / m.min()), "corr_with_step": corr(m)}
            for name, m in medians.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="preset or Hugging Face checkpoint directory")
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--window", type=int, default=200, help="steps per window")
    ap.add_argument("--max-tokens", type=int, default=400, help="decode steps per request (after a 100-token prompt)")
    args = ap.parse_args(argv)
    if args.max_tokens < 2 or args.window < 1:
        ap.error("--max-tokens must be >= 2 and --window >= 1")
    if not (0 < args.seconds < float("inf")):
        ap.error(f"--seconds must be a positive number, got {args.seconds}")
    try:
        times = measure(args.model, args.seconds, args.max_tokens)
        summary = summarize(times, args.window)
    except ValueError as exc:  # too few steps or requests for the windows: the arguments' fault, not a crash
        ap.error(f"{exc} (--seconds {args.seconds:g}, --window {args.window})")
    names = list(summary)
    print(f"{len(times['step'])} decode steps of {args.model}; medians (ms) of windows of {args.window}:")
    print("  ".join(f"{name:>9s}" for name in names))
    for row in zip(*(summary[name]["window_medians"] for name in names)):
        print("  ".join(f"{v:9.3f}" for v in row))
    for name in names[1:]:
        c = summary[name]["corr_with_step"]
        print(f"{name:9s}: max/min {summary[name]['max_over_min']:.2f}, "
              f"correlation with the steps {'n/a' if c is None else f'{c:+.2f}'}")
    print(f"{'step':9s}: max/min {summary['step']['max_over_min']:.2f}")
    return summary


if __name__ == "__main__":
    main()
