"""``LabServer``: what a server cannot run is one line, before anything heavy is built; its URL and its port."""
from __future__ import annotations

import httpx
import pytest

import framework.server.server as server_module
from framework.server.server import LabServer, check_config, listen
from framework.server.settings import ServerSettings
from tests.framework.server.support import ENGINE, ThreadServer, free_port
from tests.hydra_support import compose_config


@pytest.mark.parametrize("override, match", [
    ("executor=sim", "runs on simulated time"),
    ("clock=virtual", "a server runs on the wall clock"),
    ("+cluster=round_robin", "a server runs one engine"),
])
def test_what_a_server_cannot_run_is_refused_before_it_is_built(chat_ckpt, override, match):
    with pytest.raises(ValueError, match=match):
        check_config(compose_config(f"model.name={chat_ckpt}", *ENGINE, override))
    check_config(compose_config(f"model.name={chat_ckpt}", *ENGINE))


def test_a_server_on_an_ipv6_host_is_reached_at_its_url(chat_ckpt, tmp_path):
    running = ThreadServer(chat_ckpt, tmp_path, "server.host=::1", "warmup=0")
    try:
        assert running.url.startswith("http://[::1]:")
        assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200
    finally:
        running.stop()


def test_a_failed_build_gives_the_port_back(chat_ckpt, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the weights do not load")

    monkeypatch.setattr(server_module, "build_cluster", broken)
    port = free_port()
    cfg = compose_config(f"model.name={chat_ckpt}", *ENGINE, f"server.port={port}", "warmup=0")
    with pytest.raises(RuntimeError, match="the weights do not load") as failed:
        LabServer(cfg, tmp_path)
    # The error still holds the failed build's frames (its socket among them): only a close frees the port now.
    listen(ServerSettings(host="127.0.0.1", port=port)).close()
    del failed
