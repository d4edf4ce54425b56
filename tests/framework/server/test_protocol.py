"""The request bodies: omitted sampling fields take the model's generation config, chat content as templates take it."""
from __future__ import annotations

import pytest

from framework.server.protocol import ChatMessage, CompletionRequest

GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
                     "frequency_penalty": 0.25, "repetition_penalty": 1.2}


@pytest.mark.parametrize("name", list(GENERATION_CONFIG))
def test_an_omitted_sampling_field_takes_the_generation_configs_and_a_sent_one_wins(name):
    defaulted = CompletionRequest(prompt="w5").sampling_params(4, None, GENERATION_CONFIG)
    assert getattr(defaulted, name) == GENERATION_CONFIG[name]
    sent = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0}[name]
    assert getattr(CompletionRequest(prompt="w5", **{name: sent}).sampling_params(4, None, GENERATION_CONFIG),
                   name) == sent


def test_a_messages_text_parts_are_joined_by_newlines_as_vllm():
    message = ChatMessage(role="user", content=[{"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w7"}])
    assert message.as_template_input() == {"role": "user", "content": "w5 w6\nw7"}


def test_a_message_without_content_renders_as_empty_text():
    assert ChatMessage(role="assistant", content=None).as_template_input()["content"] == ""
    assert ChatMessage(role="assistant", name="bot").as_template_input() == {"role": "assistant", "content": "",
                                                                            "name": "bot"}
