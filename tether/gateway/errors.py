"""Refusals in OpenAI's error shape, with `Retry-After` where waiting helps."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from tether.errors import TetherError
from tether.web import AsciiJSONResponse


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
        return AsciiJSONResponse({"error": self.body()}, status_code=self.status, headers=headers)


def ledger_unavailable() -> GatewayError:
    """The refusal of a request whose reservation or charge the ledger cannot record right now."""
    return GatewayError(
        503,
        "the usage ledger cannot record this request right now, so it is not served; retry shortly",
        "ledger_unavailable",
        "server_error",
        retry_after_s=1.0,
    )
