"""What a sandbox server and its clients put on the wire: request bodies, errors, back-pressure.

Code and stdin travel as UTF-8 text, files as base64; an error is `{"error": {"message", "type",
"field"}}`; a 503 with Retry-After means the server is full (its bounded queue, or no slot for a
session), not broken.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from tether.errors import ConfigError
from tether.sandbox.spec import SandboxSpec


def _text(value: str | bytes, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError as error:
        raise ConfigError(f"{name} is not UTF-8 text ({error}); the HTTP API carries it as text") from None


def encode_files(files: Mapping[str, str | bytes]) -> dict[str, str]:
    return {
        path: base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")
        for path, data in files.items()
    }


def run_body(
    code: str | bytes,
    language: str,
    stdin: str | bytes,
    files: Mapping[str, str | bytes],
    collect: Sequence[str],
    spec: SandboxSpec | None,
) -> dict[str, Any]:
    """The JSON body of a session's run (the server's `SessionRunBody`); `/v1/run` adds warm and client."""
    body: dict[str, Any] = {
        "code": _text(code, "code"),
        "language": language,
        "stdin": _text(stdin, "stdin"),
        "files": encode_files(files),
        "collect": list(collect),
    }
    if spec is not None:
        body["spec"] = spec.model_dump(mode="json")
    return body


def retry_after_s(response: httpx.Response) -> float:
    try:
        return max(float(response.headers.get("Retry-After", "1")), 0.0)
    except ValueError:
        return 1.0


def is_back_pressure(response: httpx.Response) -> bool:
    """503 with Retry-After: the instance is full (its queue or its slots), not broken."""
    return response.status_code == 503 and "Retry-After" in response.headers


def error_of(response: httpx.Response) -> tuple[str, str]:
    """The server's error message and type (`{"error": {"message", "type"}}`), or the raw text."""
    try:
        error = response.json()["error"]
        return str(error["message"]), str(error.get("type") or "")
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase, ""
