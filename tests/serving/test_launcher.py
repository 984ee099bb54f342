"""`tether serve` end to end as a process: a taken port fails at once, before any model is pulled or loaded;
a free one serves."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tether.testing import make_tiny_model
from tether.web import free_port

TETHER = str(Path(sys.executable).parent / "tether")


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_taken_port_fails_before_any_model_is_loaded(taken_port: int, tmp_path: Path) -> None:
    # An empty folder cannot load as a model: its error would come first if the model were loaded first.
    command = [TETHER, "serve", "--model", str(tmp_path), "--port", str(taken_port)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert (
        output
        == f"error: cannot listen on 127.0.0.1:{taken_port}: the port is already in use; pass another --port"
    )


def test_free_port_serves_the_model(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "qwen3", seed=0)
    port = free_port()
    command = [TETHER, "serve", "--model", str(folder), "--port", str(port), "--kv-cache-mib", "4"]
    log = tmp_path / "serve.log"
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "tether serve did not become healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [card["id"] for card in models["data"]] == [folder.name]
        assert f"Uvicorn running on http://127.0.0.1:{port}" in log.read_text()
    finally:
        process.terminate()
        process.wait(30)
