"""Messages between the host-side pool and a sandbox worker, and their framing.

Frames are a 4-byte big-endian length followed by UTF-8 JSON; binary payloads travel base64-encoded.
JSON (never pickle) because the worker shares a namespace with untrusted code: the host must be able
to parse whatever the worker sends without executing it. Nothing here performs I/O beyond framing.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
from dataclasses import dataclass, field

TYPE_CHECKING = False  # not typing's: the worker imports this module and has no other use for typing
if TYPE_CHECKING:
    from typing import Any

MAX_FRAME_BYTES = 256 * 1024 * 1024
_HEADER = struct.Struct(">I")


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


@dataclass(slots=True)
class WorkerInit:
    """Everything a freshly started worker needs to build its isolated root and run code."""

    readonly_paths: list[str]
    device_nodes: list[str]
    preload_modules: list[str]
    seccomp_bpf_b64: str
    run_uid: int
    run_gid: int
    workdir: str
    skeleton_dir: str
    loopback_up: bool = True


@dataclass(slots=True)
class StepRequest:
    """One process to run inside a run directory: a compiler, an interpreter, or warm Python."""

    argv: list[str]
    inline_python: str | None = None  # path of a script the forked warm interpreter executes in-process
    stdin_b64: str = ""
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 30.0
    output_limit_bytes: int = 1024 * 1024
    cpu_time_limit_s: int = 60
    open_files_max: int = 256
    file_size_max_bytes: int = 64 * 1024 * 1024
    cgroup_fd_count: int = 0


@dataclass(slots=True)
class RunRequest:
    dir_id: str
    disk_mib: int
    files: dict[str, str]  # path as the run sees it (see paths.py) -> base64 content
    steps: list[StepRequest]
    program: dict[str, str] = field(default_factory=dict)  # file name in PROGRAM_DIR -> base64 content
    collect: list[str] = field(default_factory=list)
    keep_dir: bool = False
    stop_after_failure: bool = True


@dataclass(slots=True)
class StepOutcome:
    exit_code: int | None
    signal: int | None
    timed_out: bool
    output_exceeded: bool
    stdout_b64: str
    stderr_b64: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_ms: float
    setup_error: str | None = None
    cpu_ms: float = 0.0


@dataclass(slots=True)
class RunReply:
    steps: list[StepOutcome]
    files: dict[str, str]
    missing_files: list[str]
    fingerprint: str
    error: str | None = None


def to_json(message: Any) -> dict[str, Any]:
    """Shallow-convert a message dataclass (and lists of them) to JSON-ready dicts, faster than asdict."""
    result: dict[str, Any] = {}
    for name in message.__dataclass_fields__:
        value = getattr(message, name)
        if isinstance(value, list) and value and hasattr(value[0], "__dataclass_fields__"):
            value = [to_json(item) for item in value]
        result[name] = value
    return result


def step_request_from(data: dict[str, Any]) -> StepRequest:
    return StepRequest(**data)


def run_request_from(data: dict[str, Any]) -> RunRequest:
    steps = [step_request_from(s) for s in data.pop("steps")]
    return RunRequest(steps=steps, **data)


def run_reply_from(data: dict[str, Any]) -> RunReply:
    steps = [StepOutcome(**s) for s in data.pop("steps")]
    return RunReply(steps=steps, **data)


def encode_frame(payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return _HEADER.pack(len(body)) + body


def decode_header(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"peer announced a {length}-byte frame, over the {MAX_FRAME_BYTES}-byte limit")
    return int(length)


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise EOFError("peer closed the connection")
        chunks += chunk
    return bytes(chunks)


def send_frame(sock: socket.socket, payload: dict[str, Any]) -> None:
    sock.sendall(encode_frame(payload))


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    length = decode_header(_recv_exactly(sock, _HEADER.size))
    message = json.loads(_recv_exactly(sock, length))
    if not isinstance(message, dict):
        raise ValueError("frame does not hold a JSON object")
    return message
