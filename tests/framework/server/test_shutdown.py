"""Stopping: SIGTERM to ``python -m framework.serve`` and SIGINT to a server in the main thread end it cleanly (exit
0), the request in flight aborted and recorded, with the run's files; a bad config is one line and exit 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx

from framework.server.server import LabServer
from tests.framework.server.support import ENGINE, ROOT, ThreadServer, free_port, start_subprocess, wait_healthy
from tests.hydra_support import compose_config, read_csv

MAX_TOKENS = 240


def stream_some(url: str, model: str, got: list[str], started: threading.Event) -> None:
    """A long streamed completion: sets ``started`` after its first chunk and reads on until the stream ends."""
    body = {"model": model, "prompt": "w5 w6", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                got.append(line[6:])
                started.set()


def check_stopped_run(run_dir, got: list[str]) -> None:
    """The stream ended with an aborted chunk and ``[DONE]``; the files record that one request, aborted."""
    assert got[-1] == "[DONE]" and json.loads(got[-2])["choices"][0]["finish_reason"] == "abort"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_requests"] == 1
    rows = read_csv(run_dir / "requests.csv")
    assert [r["status"] for r in rows] == ["abort"] and 0 < int(rows[0]["output_len"]) < MAX_TOKENS
    assert read_csv(run_dir / "steps.csv") and (run_dir / "config.yaml").exists()


def test_sigterm_stops_the_command_with_its_files(chat_ckpt, tmp_path):
    port = free_port()
    proc = start_subprocess(chat_ckpt, tmp_path / "run", port)
    bad = subprocess.Popen([sys.executable, "-m", "framework.serve", "+server.prot=1",
                            f"hydra.run.dir={tmp_path / 'bad'}"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        got, started = [], threading.Event()
        reader = threading.Thread(target=stream_some, args=(url, str(chat_ckpt), got, started), daemon=True)
        reader.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        reader.join(10)
        check_stopped_run(tmp_path / "run", got)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, stderr = bad.communicate(timeout=120)
    assert bad.returncode == 2
    assert stderr.strip().splitlines() == ["error: server: unknown key(s) prot; valid: host, port, api_key, "
                                           "served_model_name"]


def test_sigint_stops_a_server_serving_in_the_main_thread(chat_ckpt, tmp_path):
    server = LabServer(compose_config(f"model.name={chat_ckpt}", *ENGINE, "server.port=0", "warmup=0"), tmp_path)
    got, started = [], threading.Event()

    def client() -> None:
        assert server.ready.wait(60)
        reader = threading.Thread(target=stream_some, args=(server.url, str(chat_ckpt), got, started), daemon=True)
        reader.start()
        if started.wait(60):
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: uvicorn takes it in the main thread
        reader.join(30)

    helper = threading.Thread(target=client, daemon=True)
    helper.start()
    previous = signal.getsignal(signal.SIGINT)
    server.serve()  # returns once stopped, having written the files
    helper.join(30)
    assert signal.getsignal(signal.SIGINT) is previous  # the handlers are given back
    check_stopped_run(tmp_path, got)
    allocator = server.engine.allocator
    assert allocator.num_free_blocks == allocator.num_usable_blocks


def test_a_key_hydra_cannot_override_is_one_line_naming_the_valid_keys(tmp_path):
    done = subprocess.run([sys.executable, "-m", "framework.serve", "server.prot=1", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: server: unknown key prot (did you mean port?); valid: api_key, "
                                                "host, port, served_model_name"]


def test_shutdown_aborts_the_streams_in_flight_and_writes_the_files(chat_ckpt, tmp_path):
    running = ThreadServer(chat_ckpt, tmp_path, "warmup=0")
    got, started = [], threading.Event()
    reader = threading.Thread(target=stream_some, args=(running.url, str(chat_ckpt), got, started), daemon=True)
    reader.start()
    assert started.wait(60)
    running.stop()
    reader.join(30)
    check_stopped_run(tmp_path, got)
