"""The ``server`` node: checked, one line naming the key, before anything is built."""
from __future__ import annotations

import pytest

from framework.server.settings import ServerSettings


@pytest.mark.parametrize("node, match", [
    ({"port": 65536}, "server.port must be an integer in"),
    ({"port": -1}, "server.port must be an integer in"),
    ({"host": ""}, "server.host must be"),
    ({"api_key": ""}, "server.api_key must be null or a non-empty string"),
    ({"served_model_name": ""}, "server.served_model_name must be null or a non-empty string"),
    ({"prot": 1}, r"^server: unknown key\(s\) prot; valid: host, port, api_key, served_model_name$"),
])
def test_a_bad_server_node_is_one_line_naming_the_key(node, match):
    with pytest.raises(ValueError, match=match):
        ServerSettings.from_node(node)


def test_the_highest_port_and_a_numeric_api_key_are_taken():
    settings = ServerSettings.from_node({"port": 65535, "api_key": 123})
    assert settings.port == 65535 and settings.api_key == "123"
