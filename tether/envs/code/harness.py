"""The trusted test harness that runs inside the sandbox as the run's main program (stdlib only).

stdin: a first line naming the mode, then one JSON object.
  calls: {"nonce", "setup", "source", "entry", "calls": [[arg, ...], ...], "call_timeout_s"}
         prints one line `NONCE INDEX JSON` per call; the host compares the values with expectations
         that never enter the sandbox, so the candidate is loaded into this process.
  check: {"nonce", "setup", "source", "entry", "test", "call_timeout_s"}
         runs trusted assertion code (`check(candidate)`, as HumanEval's) against the candidate and
         prints `NONCE verdict JSON`. Here the run holds the secret (the nonce and the verdict), so the
         harness forks before reading the job: the child closes stdin, points stdout and stderr at
         /dev/null, loads the candidate and answers calls over a pipe; the parent runs the test code
         with a proxy. The candidate cannot print a verdict, exit with success, or reach the parent
         (the sandbox denies ptrace and /proc/1/*).
Results travel in a tagged JSON form holding only plain data, so an object whose `__eq__` says True
to everything never reaches a comparison. The host imports this module for `encode`/`decode` only.
"""

from __future__ import annotations

import json
import marshal
import os
import select
import signal
import struct
import sys
import time
from typing import Any

MAX_MESSAGE_BYTES = 8 << 20  # one call's reply; more than any task needs, less than the run's memory
_HEADER = struct.Struct(">I")


class HarnessError(Exception):
    """The candidate failed to answer a call: an exception, a crash, a timeout or an unencodable value."""


def encode(value: Any) -> Any:
    """Plain data as JSON-able data; containers are tagged so that tuples, sets and dicts survive.

    Exact type checks on purpose: a subclass of int or list may override `__eq__`.
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return {"l": [encode(item) for item in value]}
    if kind is tuple:
        return {"t": [encode(item) for item in value]}
    if kind is dict:
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    if kind is set:
        return {"s": [encode(item) for item in value]}
    if kind is frozenset:
        return {"f": [encode(item) for item in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    raise TypeError(f"a value of type {kind.__name__} cannot be returned (plain data only)")


def decode(data: Any) -> Any:
    """The inverse of `encode`; raises ValueError on anything `encode` cannot have produced."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"malformed value {str(data)[:80]!r}")
    [(tag, body)] = data.items()
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2:
        return complex(body[0], body[1])
    if type(body) is not list:
        raise ValueError(f"malformed value {str(data)[:80]!r}")
    if tag == "d":
        if not all(type(pair) is list and len(pair) == 2 for pair in body):
            raise ValueError("malformed dict")
        return {decode(k): decode(v) for k, v in body}
    builders = {"l": list, "t": tuple, "s": set, "f": frozenset}
    if tag not in builders:
        raise ValueError(f"unknown tag {tag!r}")
    try:
        return builders[tag](decode(item) for item in body)
    except TypeError as error:  # an unhashable item in a set
        raise ValueError(str(error)) from None


def _send(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data) :]


def _read_exact(fd: int, size: int, deadline: float) -> bytes:
    chunks, missing = [], size
    while missing:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise HarnessError("timed out")
        chunk = os.read(fd, min(missing, 1 << 20))
        if not chunk:
            raise HarnessError("the candidate's process ended")
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if size > MAX_MESSAGE_BYTES:
        raise HarnessError(f"reply of {size} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _read_exact(fd, size, deadline)


def _serve_candidate(requests: int, replies: int) -> None:
    """The child: load the candidate, then answer each call until the parent closes the pipe."""
    os.close(0)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    setup, source, entry = marshal.loads(_receive(requests, 60.0))
    namespace: dict[str, Any] = {"__name__": "candidate"}  # `if __name__ == "__main__"` blocks stay off
    try:
        exec(compile(setup, "<setup>", "exec"), namespace)
        exec(compile(source, "<answer>", "exec"), namespace)
        if entry and not callable(namespace.get(entry)):
            raise NameError(f"the answer defines no function {entry!r}")
        _send(replies, json.dumps({"ready": True}).encode())
    except BaseException as error:
        _send(replies, json.dumps({"error": f"{type(error).__name__}: {error}"[:500]}).encode())
        return
    while True:
        name, args = marshal.loads(_receive(requests, 3600.0))
        try:
            target: Any = namespace[name.split(".")[0]]
            for part in name.split(".")[1:]:
                target = getattr(target, part)
            reply = {"ok": encode(target(*args))}
        except BaseException as error:
            reply = {"error": f"{type(error).__name__}: {error}"[:500]}
        try:
            payload = json.dumps(reply).encode()
        except (TypeError, ValueError, RecursionError) as error:
            payload = json.dumps({"error": f"unencodable result: {error}"[:500]}).encode()
        _send(replies, payload)


class Candidate:
    """The parent's handle on the child: call it like the candidate's function."""

    def __init__(self, pid: int, requests: int, replies: int, timeout_s: float) -> None:
        self.pid, self.requests, self.replies, self.timeout_s = pid, requests, replies, timeout_s
        self.dead: str | None = None
        self.entry = ""

    def ready(self, setup: str, source: str, entry: str) -> str | None:
        self.entry = entry
        _send(self.requests, marshal.dumps((setup, source, entry)))
        reply = self._reply(max(self.timeout_s, 10.0))
        return reply.get("error") if reply.get("ready") is not True else None

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        if self.dead is not None:
            raise HarnessError(self.dead)
        try:
            reply = json.loads(_receive(self.replies, timeout_s))
        except HarnessError as error:
            self.dead = str(error)
            os.kill(self.pid, signal.SIGKILL)
            raise
        except ValueError as error:
            raise HarnessError(f"malformed reply: {error}") from None
        if not isinstance(reply, dict):
            raise HarnessError("malformed reply")
        return reply

    def raw_call(self, args: tuple[Any, ...], name: str = "") -> dict[str, Any]:
        try:
            _send(self.requests, marshal.dumps((name or self.entry, args)))
        except (ValueError, BrokenPipeError) as error:
            raise HarnessError(f"cannot send the arguments: {error}") from None
        return self._reply(self.timeout_s)

    def __call__(self, *args: Any) -> Any:
        return self.call("", args)

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        reply = self.raw_call(args, name)
        if "error" in reply:
            raise HarnessError(str(reply["error"]))
        try:
            return decode(reply.get("ok"))
        except (ValueError, RecursionError) as error:
            raise HarnessError(f"malformed result: {error}") from None


class ModuleProxy:
    """`proxy.name(*args)` calls `name` (a dotted path in the candidate's namespace) in the child."""

    def __init__(self, candidate: Candidate, prefix: str = "") -> None:
        self._candidate, self._prefix = candidate, prefix

    def __getattr__(self, name: str) -> ModuleProxy:
        return ModuleProxy(self._candidate, f"{self._prefix}.{name}" if self._prefix else name)

    def __call__(self, *args: Any) -> Any:
        return self._candidate.call(self._prefix, args)


class _Alarm(BaseException):
    """Raised by SIGALRM inside a call that ran past its time."""


def _alarm(signum: int, frame: Any) -> None:
    raise _Alarm("timed out")


class InProcessCandidate:
    """The candidate loaded into this process: for `calls`, where the run holds nothing to hide.

    Saves the fork (about half the CPU of a run) and is as safe for that mode: the expected values
    never enter the sandbox, so tampering with this process can only produce outputs that the host
    then finds wrong. Reports go to a private copy of stdout; fd 1 and 2 lead to /dev/null.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.function: Any = None
        null = os.open(os.devnull, os.O_RDWR)
        self.out = os.dup(1)
        os.dup2(null, 1)
        os.dup2(null, 2)
        signal.signal(signal.SIGALRM, _alarm)

    def ready(self, setup: str, source: str, entry: str) -> str | None:
        namespace: dict[str, Any] = {"__name__": "candidate"}
        try:
            signal.setitimer(signal.ITIMER_REAL, max(self.timeout_s, 10.0))
            exec(compile(setup, "<setup>", "exec"), namespace)
            exec(compile(source, "<answer>", "exec"), namespace)
        except BaseException as error:
            return f"{type(error).__name__}: {error}"[:500]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        self.function = namespace.get(entry)
        return None if callable(self.function) else f"the answer defines no function {entry!r}"

    def raw_call(self, args: tuple[Any, ...], name: str = "") -> dict[str, Any]:
        try:
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
            try:
                reply = {"ok": encode(self.function(*args))}
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            json.dumps(reply)
        except BaseException as error:
            reply = {"error": f"{type(error).__name__}: {error}"[:500]}
        return reply


def _emit(fd: int, line: str) -> None:
    data = (line.replace("\n", " ") + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _run_suite(test: str, candidate: Any, load_error: str | None) -> dict[str, Any]:
    """Every `test_*(m)` function of the trusted `test` code, with `m` a proxy for the candidate."""
    namespace: dict[str, Any] = {"__name__": "harness"}
    exec(compile(test, "<tests>", "exec"), namespace)
    names = sorted(name for name, value in namespace.items() if name.startswith("test_") and callable(value))
    results: dict[str, Any] = {}
    for name in names:
        if load_error is not None:
            results[name] = f"load: {load_error}"
            continue
        try:
            namespace[name](ModuleProxy(candidate))
            results[name] = True
        except BaseException as error:
            results[name] = f"{type(error).__name__}: {error}"[:300]
    return {"results": results}


def _read_mode_line() -> str:
    """The first line of stdin, read unbuffered: a buffered read would pull the secret job into the
    memory that the forked child then copies."""
    chars: list[bytes] = []
    while len(chars) < 16:
        char = os.read(0, 1)
        if char in (b"", b"\n"):
            break
        chars.append(char)
    return b"".join(chars).decode(errors="replace")


def _forked_candidate(timeout_s: float) -> Candidate:
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(requests_w)
        os.close(replies_r)
        try:
            _serve_candidate(requests_r, replies_w)
        finally:
            os._exit(0)
    os.close(requests_r)
    os.close(replies_w)
    return Candidate(pid, requests_w, replies_r, timeout_s)


def main() -> int:
    # The job names its mode, but reading the job must wait until a forked child has closed its stdin;
    # so the mode is the first line, and the rest of the job follows it.
    mode = _read_mode_line()
    if mode not in ("calls", "check", "suite"):
        raise ValueError(f"unknown mode {mode!r}")
    candidate: Candidate | InProcessCandidate
    if mode != "calls":
        candidate = _forked_candidate(5.0)
        # The child keeps the working directory on its path (the candidate's modules live there); the
        # trusted side drops it, so a planted module never shadows one the test code imports.
        sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
    job = json.loads(sys.stdin.read())
    nonce, timeout_s = str(job["nonce"]), float(job.get("call_timeout_s", 5.0))
    if mode != "calls":
        candidate.timeout_s = timeout_s
        out = 1
    else:
        candidate = InProcessCandidate(timeout_s)
        out = candidate.out
    try:
        load_error = candidate.ready(job.get("setup", ""), job["source"], job["entry"])
    except HarnessError as error:
        load_error = str(error)
    if mode == "calls":
        for index, args in enumerate(job["calls"]):
            if load_error is not None:
                reply: dict[str, Any] = {"error": f"load: {load_error}"}
            else:
                try:
                    reply = candidate.raw_call(tuple(args))
                except HarnessError as error:
                    reply = {"error": str(error)}
            _emit(out, f"{nonce} {index} {json.dumps(reply)}")
    elif mode == "check":
        verdict: dict[str, Any] = {"passed": False, "error": f"load: {load_error}"}
        if load_error is None:
            namespace: dict[str, Any] = {"__name__": "harness"}
            try:
                exec(compile(job.get("setup", ""), "<setup>", "exec"), namespace)
                namespace[job["entry"]] = candidate  # tests may call the function by its own name
                exec(compile(job["test"], "<test>", "exec"), namespace)
                namespace["check"](candidate)
                verdict = {"passed": True}
            except BaseException as error:
                verdict = {"passed": False, "error": f"{type(error).__name__}: {error}"[:500]}
        _emit(out, f"{nonce} verdict {json.dumps(verdict)}")
    elif mode == "suite":
        _emit(out, f"{nonce} suite {json.dumps(_run_suite(job['test'], candidate, load_error))}")
    if isinstance(candidate, Candidate):
        os.kill(candidate.pid, signal.SIGKILL)
        os.waitpid(candidate.pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
