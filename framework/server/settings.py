"""``ServerSettings``: the ``server`` node of the composed config, checked before anything heavy is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.common.config import is_int

SERVER_KEYS = ("host", "port", "api_key", "served_model_name")


@dataclass(frozen=True)
class ServerSettings:
    """Where the server listens, the API key ``/v1/*`` needs (None: none) and the model name clients send
    (None: the engine's model)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"server.host must be a host name or address (127.0.0.1, 0.0.0.0), got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be an integer in [0, 65535], got {self.port!r}")
        for name in ("api_key", "served_model_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"server.{name} must be null or a non-empty string, got {value!r}")

    @classmethod
    def from_node(cls, node: Any) -> ServerSettings:
        """From the config's ``server`` node (a dict, or None for the defaults); ValueError naming an unknown key."""
        if node is None:
            return cls()
        if not isinstance(node, dict):
            raise ValueError(f"server must be a node of {', '.join(SERVER_KEYS)} (server.port=8001), got {node!r}")
        unknown = sorted(set(node) - set(SERVER_KEYS))
        if unknown:
            raise ValueError(f"server: unknown key(s) {', '.join(map(str, unknown))}; valid: {', '.join(SERVER_KEYS)}")
        if is_int(node.get("api_key")):  # server.api_key=123 reaches here as a number
            node = {**node, "api_key": str(node["api_key"])}
        return cls(**node)
