"""Refusals in OpenAI's error shape, with `Retry-After` where waiting helps."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

from tether.errors import TetherError


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a message quoting a client's lone surrogate still
    encodes (JSONResponse's UTF-8 rendering would fail on it)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


class GatewayError(TetherError):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, str | None]:
        """The `error` object of OpenAI's error shape."""
        return {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return _AsciiJSONResponse({"error": self.body()}, status_code=self.status, headers=headers)
