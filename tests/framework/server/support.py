"""Starting a real server on a free local port, in this process (a thread) or as a ``python -m framework.serve``."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from framework.server.server import LabServer
from framework.testing.parity import make_hf_checkpoint
from tests.hydra_support import compose_config

ROOT = Path(__file__).resolve().parents[3]
API_KEY = "test-key"
#: A chat template of our own over the word tokenizer's vocabulary (w1 opens a turn, w2 starts the answer).
CHAT_TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}w2{% endif %}")
#: Engine settings small enough for a 2-core CI machine.
ENGINE = ("backend=naive", "engine.max_model_len=256", "engine.max_num_batched_tokens=256", "engine.max_num_seqs=64",
          "plots=false", "progress=false")


def chat_checkpoint(path: Path) -> Path:
    """A tiny random Llama whose tokenizer has ``CHAT_TEMPLATE``."""
    from transformers import AutoTokenizer

    make_hf_checkpoint(path, "llama", with_tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """A ``LabServer`` serving from a thread of this process; ``stop`` shuts it down and returns its summary."""

    def __init__(self, model: Path, run_dir: Path, *overrides: str) -> None:
        cfg = compose_config(f"model.name={model}", *ENGINE, "server.port=0", *overrides)
        self.server = LabServer(cfg, run_dir)
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()
        assert self.server.ready.wait(60), "the server did not start"
        self.url = self.server.url

    def stop(self) -> dict:
        self.server.shutdown()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"
        return self.server.summary


def start_subprocess(model: Path, run_dir: Path, port: int, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "framework.serve", f"model.name={model}", *ENGINE,
                             f"server.port={port}", f"hydra.run.dir={run_dir}", "warmup=0", *overrides],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become healthy in {timeout} s")
