"""`tether gateway bench`: the latency the gateway adds per request, and its own ceiling in requests per
second, both measured in one run against an instant upstream (a raw ASGI app that answers at once).

Upstream, gateway and the measuring client run in three processes, so none steals the others' interpreter.
Requests go alternately through the gateway and straight to the upstream; each pair's difference is one
sample of added latency (pairing cancels slow drift in the machine's load), reported as median and p99.
The gateway process's CPU time per request (Linux only) is the figure least disturbed by other load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

from tether.chat.pricing import Tier
from tether.errors import ConfigError, TetherError
from tether.gateway.config import GatewayConfig, Limits, Pool
from tether.gateway.runtime import open_stores
from tether.machine import load_average, machine_record
from tether.web import free_port

MODEL = "instant"
_ANSWER = json.dumps(
    {
        "id": "cmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 1,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
).encode()

_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


async def instant_upstream(scope: Scope, receive: Receive, send: Send) -> None:
    """An OpenAI-shaped chat completion for every request, as fast as uvicorn can answer."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_ANSWER)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": _ANSWER})


@dataclass(frozen=True, slots=True)
class BenchConfig:
    requests: int = 400
    """Sequential requests per path (direct and through the gateway) for the latency figures."""
    duration_s: float = 5.0
    """How long the throughput phase hammers the gateway."""
    concurrency: int = 32
    warmup: int = 50

    def __post_init__(self) -> None:
        for name in ("requests", "concurrency", "warmup"):
            value = getattr(self, name)
            if value < (0 if name == "warmup" else 1):
                raise ConfigError(f"gateway bench: {name} = {value!r}: expected an integer >= 1")
        if self.duration_s <= 0:
            raise ConfigError(f"gateway bench: duration_s = {self.duration_s!r}: expected > 0")


@dataclass(frozen=True, slots=True)
class BenchResult:
    added_latency_p50_ms: float
    added_latency_p99_ms: float
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    gateway_cpu_ms_per_request: float | None
    """User plus system CPU of the gateway process (ledger writer included) in the latency phase."""
    max_rps: float
    direct_max_rps: float
    requests: int
    concurrency: int
    machine: dict[str, Any]
    """`tether.machine.machine_record`; threads: the gateway's one event loop."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user plus system) process `pid` has used; None where there is no Linux /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def _process(code: str, url: str) -> Iterator[int]:
    """A Python child running `code`, from the moment `url` answers HTTP to the end of the block."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            if child.poll() is not None:
                stderr = child.stderr.read().decode() if child.stderr is not None else ""
                raise TetherError(f"gateway bench: a server exited early: {stderr[-2000:]}")
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TetherError(f"gateway bench: {url} did not come up within 60 s") from None
                time.sleep(0.05)
        yield child.pid
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Connection:
    """A keep-alive HTTP/1.1 connection sending one pre-encoded request: far cheaper per request than a
    general client, so the measuring process is not the bottleneck it measures."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        self.reader, self.writer, self.request = reader, writer, request

    @classmethod
    async def open(cls, base: str, secret: str) -> _Connection:
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {secret}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        return cls(reader, writer, request)

    async def send(self) -> None:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = _CONTENT_LENGTH.search(head)
        if length is None:
            raise TetherError(f"gateway bench: a response without Content-Length: {head[:300]!r}")
        body = await self.reader.readexactly(int(length.group(1)))
        if not head.startswith(b"HTTP/1.1 200"):
            status_line = head.split(b"\r\n")[0]
            raise TetherError(f"gateway bench: {status_line!r}: {body[:500]!r}")

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def _latencies(
    direct: str, gateway: str, secret: str, config: BenchConfig
) -> tuple[list[float], list[float]]:
    connections = {base: await _Connection.open(base, secret) for base in (direct, gateway)}
    times: dict[str, list[float]] = {direct: [], gateway: []}
    try:
        for i in range(config.warmup + config.requests):
            for base in (direct, gateway) if i % 2 else (gateway, direct):
                started = time.perf_counter()
                await connections[base].send()
                if i >= config.warmup:
                    times[base].append(time.perf_counter() - started)
    finally:
        for connection in connections.values():
            await connection.close()
    return times[direct], times[gateway]


async def _throughput(base: str, secret: str, config: BenchConfig) -> float:
    connections = [await _Connection.open(base, secret) for _ in range(config.concurrency)]
    done = 0
    deadline = time.monotonic() + config.duration_s

    async def worker(connection: _Connection) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await connection.send()
            done += 1

    try:
        started = time.monotonic()
        await asyncio.gather(*(worker(c) for c in connections))
        return done / (time.monotonic() - started)
    finally:
        for connection in connections:
            await connection.close()


def run_bench(config: BenchConfig) -> BenchResult:
    load_start = load_average()
    upstream_port, gateway_port = free_port(), free_port()
    direct, gateway = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{gateway_port}"
    with tempfile.TemporaryDirectory(prefix="tether-gw-bench-") as tmp:
        gateway_config = GatewayConfig(
            models={MODEL: "instant"},
            pools={"instant": Pool(urls=[direct], max_in_flight=256, max_queued=1024, send_priority=False)},
            ledger_url=f"sqlite:///{Path(tmp) / 'ledger.db'}",
        )
        keys, _ = open_stores(gateway_config)
        # every limit kind is accounted on every request (as for a real tenant), none ever refuses
        unrefusing = Limits(requests_per_minute=10**9, tokens_per_window=10**12, budget_usd=Decimal(10**6))
        secret, _ = keys.create("bench", Tier.STANDARD, unrefusing)
        keys.engine.dispose()
        config_path = Path(tmp) / "gateway.json"
        config_path.write_text(gateway_config.model_dump_json())
        upstream_code = (
            "import uvicorn; from tether.gateway.bench import instant_upstream; "
            f"uvicorn.run(instant_upstream, port={upstream_port}, log_level='error', access_log=False)"
        )
        gateway_code = (
            "from pathlib import Path; from tether.gateway import load_gateway_config, serve_gateway; "
            f"config = load_gateway_config(Path({str(config_path)!r})); "
            f"serve_gateway(config, '127.0.0.1', {gateway_port}, 'error')"
        )
        with _process(upstream_code, direct), _process(gateway_code, gateway + "/healthz") as pid:
            cpu_before = _cpu_s(pid)
            direct_s, gateway_s = asyncio.run(_latencies(direct, gateway, secret, config))
            cpu_after = _cpu_s(pid)
            direct_rps = asyncio.run(_throughput(direct, secret, config))
            gateway_rps = asyncio.run(_throughput(gateway, secret, config))
    ms = 1000.0
    added = [through - straight for through, straight in zip(gateway_s, direct_s, strict=True)]
    cpu_ms = None
    if cpu_before is not None and cpu_after is not None:
        cpu_ms = (cpu_after - cpu_before) / (config.warmup + config.requests) * ms
    return BenchResult(
        added_latency_p50_ms=statistics.median(added) * ms,
        added_latency_p99_ms=_quantile(added, 0.99) * ms,
        direct_p50_ms=statistics.median(direct_s) * ms,
        direct_p99_ms=_quantile(direct_s, 0.99) * ms,
        gateway_p50_ms=statistics.median(gateway_s) * ms,
        gateway_p99_ms=_quantile(gateway_s, 0.99) * ms,
        gateway_cpu_ms_per_request=cpu_ms,
        max_rps=gateway_rps,
        direct_max_rps=direct_rps,
        requests=config.requests,
        concurrency=config.concurrency,
        machine=machine_record(1, load_start),
    )
