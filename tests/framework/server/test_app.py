"""The routes around the generation endpoints: a dead engine's 503s and health, the API key's reach."""
from __future__ import annotations

import json

import httpx

from tests.framework.server.support import API_KEY, ThreadServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_a_failed_engine_answers_503_is_unhealthy_and_the_run_is_failed(chat_ckpt, tmp_path):
    running = ThreadServer(chat_ckpt, tmp_path, f"server.api_key={API_KEY}", "warmup=0")
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("as a bug below would")

        running.server.engine.step = broken
        body = {"model": str(chat_ckpt), "prompt": "w5 w6", "max_tokens": 2}
        for _ in range(2):  # the one in flight when it failed, then one sent to the dead engine
            response = httpx.post(f"{running.url}/v1/completions", json=body, headers=AUTH, timeout=60)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert httpx.get(f"{running.url}/health").status_code == 503
        with httpx.stream("POST", f"{running.url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=60) as streamed:
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[0])["error"]["code"] == 503 and len(events) == 2
    finally:
        summary = running.stop()
    assert summary["status"] == "failed"


def test_cors_preflights_and_open_routes_need_no_api_key(server):
    assert httpx.options(f"{server.url}/v1/completions").status_code != 401
    assert httpx.get(f"{server.url}/version").status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
