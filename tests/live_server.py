"""Servers on real sockets for tests: an ASGI app behind uvicorn in a thread (HTTP clients, fake upstreams),
or `tether serve` in its own process."""

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


@contextmanager
def live_server(app: Any) -> Iterator[str]:
    """`app` behind a real uvicorn on a free local port, in a background thread with its own loop."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
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


def free_port() -> int:
    """A local TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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


@contextmanager
def sandbox_server(*options: str, ready_s: float = 60.0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`tether sandbox serve OPTIONS` in its own process on a free port, once `/healthz` answers; yields
    the process (tests kill it by pid) and its URL; terminated on exit if still running."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "tether"), "sandbox", "serve", "--port", str(port)]
    process = subprocess.Popen(
        [*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tether sandbox serve did not become healthy"
            time.sleep(0.1)
        yield process, url
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
