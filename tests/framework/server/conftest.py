"""One in-process server for the package's tests: a tiny Llama with a chat template, behind an API key."""
from __future__ import annotations

import pytest

from framework.common.config import EngineConfig
from framework.engine.llm_engine import LLMEngine
from tests.framework.server.support import API_KEY, ThreadServer, chat_checkpoint


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("tiny-llama-chat"))


@pytest.fixture(scope="session")
def server(chat_ckpt, tmp_path_factory):
    running = ThreadServer(chat_ckpt, tmp_path_factory.mktemp("served"), f"server.api_key={API_KEY}")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def async_server(chat_ckpt, tmp_path_factory):
    """The same server with async scheduling (on by default only on CUDA)."""
    running = ThreadServer(chat_ckpt, tmp_path_factory.mktemp("served-async"), f"server.api_key={API_KEY}",
                           "scheduler.async_scheduling=true")
    yield running
    running.stop()


@pytest.fixture
def client(server, chat_ckpt):
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def engine(chat_ckpt):
    """An engine of its own (no server), as the server builds it."""
    return LLMEngine(EngineConfig(model=str(chat_ckpt), backend="naive", max_model_len=256,
                                  max_num_batched_tokens=256))
