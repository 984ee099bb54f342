"""How a rollout server's failures read (`servers.py` raises them): every one is a `ServerError`, and
`server_failed` says which ones mean the server is unwell, so another server may take the request
(`fleet.py`), rather than that the request itself was wrong."""

from __future__ import annotations

import httpx

from tether.errors import TetherError


class ServerError(TetherError):
    """A rollout server failed, refused a request or answered something unusable."""


class ServerHTTPError(ServerError):
    """The server answered with an error status; `status` and the server's own message are kept."""

    def __init__(self, endpoint: str, status: int, message: str) -> None:
        kind = "rejected the request" if status < 500 else "failed"
        super().__init__(f"{endpoint}: the server {kind} with HTTP {status}: {message}")
        self.endpoint = endpoint
        self.status = status


class ServerTimeoutError(ServerError):
    """No complete answer within `timeout_s`."""


class ServerUnreachableError(ServerError):
    """No connection to the server, or it closed the connection before answering (refused, reset)."""


class ServerWeightsError(ServerError):
    """The server's weights are not known to be the version this client numbers: its last update failed,
    or another client changed them."""


class ServerResponseError(ServerError):
    """The server answered 2xx with a body that lacks what the client relies on."""


def server_failed(error: BaseException) -> bool:
    """Whether `error` says the server is unwell (unreachable, reset, timed out, a 5xx, weights in doubt),
    so another server may serve the same request; a 4xx or an unusable 2xx body would fail anywhere."""
    if isinstance(error, ServerHTTPError):
        return error.status >= 500
    return isinstance(error, ServerTimeoutError | ServerUnreachableError | ServerWeightsError)


def error_message(response: httpx.Response) -> str:
    """The message of vLLM's {"message"}, FastAPI's {"detail"} or SGLang's {"error": {"message"}} bodies."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:300]
