"""The listening socket's errors name the setting to change."""
import socket

import pytest

from framework.server.server import listen
from framework.server.settings import ServerSettings


def test_a_taken_port_names_server_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^cannot listen on 127.0.0.1:{port}: .*; pick another with "
                                             r"server.port=N$"):
            listen(ServerSettings(host="127.0.0.1", port=port))


@pytest.mark.parametrize("host", ["999.1.1.1", "203.0.113.1"], ids=["unresolvable", "not-this-machines"])
def test_an_address_that_is_not_this_machines_names_server_host(host):
    with pytest.raises(ValueError, match=rf"^cannot listen on {host}:0: .*; give one of this machine's addresses "
                                         r"with server.host=ADDRESS$"):
        listen(ServerSettings(host=host, port=0))
