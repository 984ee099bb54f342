"""Servers on real sockets for tests: an ASGI app behind uvicorn in a thread (HTTP clients, fake upstreams),
or `tether serve` (or a fleet of `tether sandbox serve`) in their own processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tether.web import free_port

__all__ = ["free_port", "live_server", "sandbox_fleet", "served_process"]


@contextmanager
def live_server(app: Any, port: int = 0) -> Iterator[str]:
    """`app` behind a real uvicorn on a free local port (or `port`: a server restarted where another was),
    in a background thread with its own loop."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def served_process(model: str, *options: str, ready_s: float = 120.0) -> Iterator[str]:
    """`tether serve --model MODEL OPTIONS` in its own process on a free port, once `/healthz` answers;
    terminated on exit. A server that exits or never gets healthy fails the test with its stderr."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "tether"), "serve", "--model", model, "--port", str(port)]
    process = subprocess.Popen(
        [*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tether serve did not become healthy"
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _start_sandbox(options: tuple[str, ...]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [str(Path(sys.executable).parent / "tether"), "sandbox", "serve", "--port", str(port)]
    process = subprocess.Popen(
        [*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy()
    )
    return process, f"http://127.0.0.1:{port}"


def _wait_healthy(process: subprocess.Popen[bytes], url: str, deadline: float) -> None:
    while True:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"tether sandbox serve at {url} did not become healthy"
        time.sleep(0.1)


@contextmanager
def sandbox_fleet(
    count: int, *options: str, ready_s: float = 60.0
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """`count` processes of `tether sandbox serve OPTIONS`, each on a free port, started together and
    yielded once every `/healthz` answers: (process, URL) pairs, so a test can kill one by pid. Those
    still running are terminated on exit."""
    servers = [_start_sandbox(options) for _ in range(count)]
    try:
        deadline = time.monotonic() + ready_s
        for process, url in servers:
            _wait_healthy(process, url, deadline)
        yield servers
    finally:
        for process, _ in servers:
            if process.poll() is None:
                process.terminate()
        for process, _ in servers:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
