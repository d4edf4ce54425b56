"""``check_config``: what a server cannot run is one line, before anything heavy is built."""
from __future__ import annotations

import pytest

from framework.server.server import check_config
from tests.framework.server.support import ENGINE
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
