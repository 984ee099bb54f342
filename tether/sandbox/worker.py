"""Host-side handle of one sandbox worker process: start it, map its ids, send runs, stop it.

All the host's privileged acts for a worker happen here: writing its uid/gid maps and handing it
cgroup descriptors. The worker itself is treated as untrusted input: its replies are parsed as JSON
and a worker that misbehaves or stalls is killed, which kills every run inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

from tether.sandbox import protocol
from tether.sandbox.launch import Launch, launch
from tether.sandbox.protocol import RunReply, RunRequest, WorkerInit

SKELETON_PREFIX = "tether-root-"


def remove_stale_skeletons() -> int:
    """Remove the empty mount-point directories left by host processes that died without closing."""
    removed = 0
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        owner = name[len(SKELETON_PREFIX) :].split("-", 1)[0]
        if name.startswith(SKELETON_PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(base, name))
                removed += 1
    return removed


class WorkerError(RuntimeError):
    """The worker failed to start, answered out of protocol, or died."""


class WorkerProcess:
    """The worker's launcher process, started without an event loop and awaited through its pidfd."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        self._popen.kill()

    async def wait(self) -> int:
        """Wait until the process ends, without blocking the loop, and reap it."""
        if self._popen.poll() is not None:
            return self._popen.wait()
        try:
            pidfd = os.pidfd_open(self._popen.pid)  # valid until reaped, and only `poll`/`wait` reap
        except ProcessLookupError:  # reaped behind Popen's back (a wait for any child): nothing to wait
            return self._popen.wait()
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def wake() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(pidfd, wake)
        try:
            await ended
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return self._popen.wait()


@dataclass(frozen=True, slots=True)
class IdMap:
    """The worker's namespace root and run user, each mapped to an unprivileged host id."""

    host_base: int
    run_id: int

    def lines(self) -> str:
        return f"0 {self.host_base} 1\n{self.run_id} {self.host_base + self.run_id} 1\n"


class Channel:
    """Framed JSON over the worker's control socket, on asyncio streams (the socket stays registered)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    async def send(self, payload: dict[str, Any]) -> None:
        self.writer.write(protocol.encode_frame(payload))
        await self.writer.drain()

    async def receive(self) -> dict[str, Any]:
        try:
            length = protocol.decode_header(await self.reader.readexactly(4))
            message = json.loads(await self.reader.readexactly(length))
        except asyncio.IncompleteReadError:
            raise EOFError("worker closed its control socket") from None
        if not isinstance(message, dict):
            raise WorkerError("worker sent a frame that is not a JSON object")
        return message

    def close(self) -> None:
        self.writer.close()


class Worker:
    def __init__(self, name: str, init: WorkerInit, ids: IdMap, python_executable: str) -> None:
        self.name = name
        self.init = init
        self.ids = ids
        self.python_executable = python_executable
        self.baseline_fingerprint = ""
        self.process: WorkerProcess | None = None
        self._control: Channel | None = None
        self._fds: socket.socket | None = None
        self._skeleton: str | None = None
        self.runs_served = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, timeout_s: float = 30.0, launched: Launch | None = None) -> None:
        """Start the worker, or finish starting the one `launched` ahead (see `launch`)."""
        launched = launched or launch(self.python_executable)
        self.process, self._fds = WorkerProcess(launched.popen), launched.fds
        try:
            self._skeleton = tempfile.mkdtemp(prefix=f"{SKELETON_PREFIX}{os.getpid()}-")
            os.chmod(self._skeleton, 0o755)
            init = WorkerInit(**{**protocol.to_json(self.init), "skeleton_dir": self._skeleton})
            launched.fds.setblocking(False)
            self._control = await Channel.open(launched.control)
            await asyncio.wait_for(self._handshake(init), timeout_s)
        except BaseException:
            if self._control is None:  # else the channel's transport owns the socket and closes it
                launched.control.close()
            await self.kill()
            raise

    async def _handshake(self, init: WorkerInit) -> None:
        assert self._control is not None and self.process is not None
        await self._control.send(protocol.to_json(init))
        message = await self._expect("map_ids")
        pid = self.process.pid
        with open(f"/proc/{pid}/uid_map", "w") as handle:
            handle.write(self.ids.lines())
        with open(f"/proc/{pid}/gid_map", "w") as handle:
            handle.write(self.ids.lines())
        await self._control.send({"op": "ids_mapped"})
        message = await self._expect("ready")
        self.baseline_fingerprint = str(message["fingerprint"])

    async def _expect(self, op: str) -> dict[str, Any]:
        assert self._control is not None
        try:
            message = await self._control.receive()
        except EOFError:
            raise WorkerError(f"worker {self.name} exited while starting") from None
        if message.get("op") == "error":
            raise WorkerError(f"worker {self.name} failed: {message.get('error')}")
        if message.get("op") != op:
            raise WorkerError(f"worker {self.name} sent {message.get('op')!r}, expected {op!r}")
        return message

    async def run(self, request: RunRequest, cgroup_fds: list[int]) -> RunReply:
        assert self._control is not None and self._fds is not None
        await self._control.send({"op": "run", **protocol.to_json(request)})
        if cgroup_fds:
            socket.send_fds(self._fds, [b"f"], cgroup_fds)
        message = await self._expect("result")
        message.pop("op")
        self.runs_served += 1
        try:
            return protocol.run_reply_from(message)
        except (TypeError, KeyError) as error:
            raise WorkerError(f"worker {self.name} sent a malformed result: {error}") from None

    async def download(self, dir_id: str, paths: list[str]) -> tuple[dict[str, str], list[str]]:
        assert self._control is not None
        await self._control.send({"op": "download", "dir_id": dir_id, "paths": paths})
        message = await self._expect("files")
        return dict(message["files"]), list(message["missing"])

    async def release(self, dir_id: str) -> str:
        assert self._control is not None
        await self._control.send({"op": "release", "dir_id": dir_id})
        return str((await self._expect("released"))["fingerprint"])

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        if self._control is not None:
            self._control.close()
        if self._fds is not None:
            self._fds.close()
        self._control = self._fds = None
        if self._skeleton is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._skeleton)
            self._skeleton = None

    async def stop(self) -> None:
        if self._control is not None and self.alive:
            with contextlib.suppress(OSError):
                await self._control.send({"op": "shutdown"})
            assert self.process is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 2.0)
        await self.kill()
