"""``python -m framework.run [+policy=NAME] [backend=NAME] [key=value ...]``: one experiment.

Composes ``conf/config.yaml`` with Hydra, builds the engine from the selected parts, runs the
workload and prints a summary.
"""
from __future__ import annotations

import random
import time
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from framework.config import EngineConfig
from framework.engine import LLMEngine
from framework.sampling_params import SamplingParams


def _split(group: Any, default_name: str) -> tuple[str, dict[str, Any]]:
    """A config group node is ``{name: ..., **options}``."""
    if group is None:
        return default_name, {}
    d = OmegaConf.to_container(group, resolve=True) if isinstance(group, DictConfig) else dict(group)
    name = d.pop("name", default_name)
    return name, d


def engine_config(cfg: DictConfig) -> EngineConfig:
    """The ``EngineConfig`` a composed Hydra config describes."""
    policy, policy_options = _split(cfg.get("policy"), "fcfs")
    backend, backend_options = _split(cfg.get("backend"), "naive")
    allocator, allocator_options = _split(cfg.get("allocator"), "paged")
    preparer, preparer_options = _split(cfg.get("preparer"), "v1")
    model, model_options = _split(cfg.get("model"), "tiny-llama")
    executor, executor_options = _split(cfg.get("executor"), "model")
    if executor == "sim":  # the simulated executor's device and cost model are top-level groups
        for key in ("hardware", "cost_model"):
            if cfg.get(key) is not None:
                executor_options[key] = OmegaConf.to_container(cfg[key], resolve=True)
    engine = OmegaConf.to_container(cfg.engine, resolve=True)
    return EngineConfig(model=model, model_seed=model_options.get("seed", 0), policy=policy, policy_options=policy_options, backend=backend,
                        backend_options=backend_options, allocator=allocator, allocator_options=allocator_options,
                        preparer=preparer, preparer_options=preparer_options, executor=executor,
                        executor_options=executor_options, **engine)


def synthetic_prompts(w: DictConfig, vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(w.seed)
    out = []
    for _ in range(w.num_requests):
        n = rng.randint(*w.prompt_len)
        prompt = [rng.randrange(3, vocab_size) for _ in range(n)]
        params = SamplingParams(max_tokens=rng.randint(*w.output_len), temperature=w.temperature, ignore_eos=True)
        out.append((prompt, params))
    return out


def run(cfg: DictConfig) -> dict[str, float]:
    engine = LLMEngine(engine_config(cfg))
    work = synthetic_prompts(cfg.workload, engine.model_config.vocab_size)
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(work):
        engine.add_request(str(i), prompt, params, arrival_time=engine.clock.now())
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    ttft = [o.metrics.ttft for o in finished if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in finished if o.metrics.tpot is not None]
    summary = {
        "requests": len(finished),
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "output_throughput_tok_s": out_tokens / elapsed,
        "mean_ttft_ms": 1000 * sum(ttft) / max(len(ttft), 1),
        "mean_tpot_ms": 1000 * sum(tpot) / max(len(tpot), 1),
        "preemptions": engine.scheduler.num_preemptions,
    }
    c = engine.config
    print(f"policy={c.policy} backend={c.backend} allocator={c.allocator} preparer={c.preparer} model={c.model}")
    for k, v in summary.items():
        print(f"  {k:26s} {v:.2f}" if isinstance(v, float) else f"  {k:26s} {v}")
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
