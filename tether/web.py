"""What tether's HTTP servers (sandbox, engine, gateway) share: a JSON response that still renders when
an error message quotes a client's lone UTF-16 surrogate (`tether.errors.lone_surrogate` finds one), and
a free local port for the servers a benchmark or test starts.

JSON's `\\ud800` escapes carry such a surrogate into a Python string, and a refusal that names the bad
value would then fail to encode as UTF-8 (a 500 in place of the 400); escaping every non-ASCII
character keeps the body valid JSON with the same content.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from fastapi.responses import JSONResponse


class AsciiJSONResponse(JSONResponse):
    """JSONResponse with every non-ASCII character escaped (`\\uXXXX`), so any string encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may take it before the caller binds)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
