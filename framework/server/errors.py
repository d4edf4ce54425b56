"""``APIError`` and OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``, as vLLM sends it."""
from __future__ import annotations

import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

#: The option a ``SamplingParams`` error names (``SamplingParams.top_p must be ...``).
_PARAM = re.compile(r"SamplingParams\.(\w+)")


class APIError(Exception):
    """A request the server refuses: its HTTP status (400 unless said), OpenAI's error type and the field at fault."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, error_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.error_type = error_type or _TYPES.get(self.status, "BadRequestError")
        self.param = param

    @classmethod
    def from_value_error(cls, exc: ValueError, param: str | None = None, fields: Mapping[str, str] = {}) -> APIError:
        """The engine's one-line ValueError as a 400, naming the sampling option it is about when it names one,
        by the request field that set it (``fields``: option -> field, where the two differ)."""
        message = str(exc)
        found = _PARAM.search(message)
        option = found.group(1) if found else None
        if option in fields:
            message = message.replace(found.group(0), fields[option], 1)
            option = fields[option]
        return cls(message, param=param or option)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.error_type, self.param)


_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


def error_body(message: str, status: int, error_type: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type or _TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}
