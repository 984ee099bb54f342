"""`tether gateway bench --routing`: prefix-aware routing against round-robin over real engine replicas,
and what killing a replica costs, measured in one run.

It starts `replicas` `tether serve` processes whose KV caches each hold about `kv_prefixes` of the
workload's distinct system prompts (the size computed from the model's config.json, as the engine
computes it), and a gateway in this process in front of them. The workload is `prompts` long seeded
system prompts x `requests_per_prompt` short questions, in one seeded random order, streamed with a small
`max_tokens` by `concurrency` clients. It runs once routed by prefix and once round-robin, each on freshly
started replicas (cold caches), then a third phase routed by prefix kills one replica (SIGKILL) once a
quarter of its requests are done, and counts the requests that failed before their first byte (the
gateway should have retried them elsewhere) and the streams cut after it (allowed: no retry once a byte
went out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

from tether.chat.pricing import Tier
from tether.errors import ConfigError, TetherError
from tether.gateway.config import GatewayConfig, Limits, Pool, Routing
from tether.gateway.prefix_key import load_tokenizer
from tether.gateway.runtime import open_stores, running_gateway
from tether.machine import load_average, machine_record
from tether.web import free_port

_TEXT = """river stone lantern orbit maple signal harbor quartz meadow ember vector canyon saddle prism
glacier thistle beacon cobalt falcon ledger summit willow kernel harvest tunnel velvet anchor mirror compass
marble thunder pepper granite island violet copper rocket shadow garden planet silver forest candle"""
_WORDS = tuple(_TEXT.split())
_BLOCK = 16
"""`tether serve`'s KV block size."""


@dataclass(frozen=True, slots=True)
class RoutingBenchConfig:
    model: Path
    """A model folder (`tether serve --model` and the gateway's tokenizer)."""
    prompts: int = 8
    requests_per_prompt: int = 50
    replicas: int = 3
    prompt_tokens: int = 1100
    """Each system prompt's length in tokens, at least."""
    kv_prefixes: float = 3.0
    """System prompts one replica's KV cache holds."""
    max_tokens: int = 4
    concurrency: int = 8
    kill_requests_per_prompt: int = 5
    """Requests per prompt in the phase that kills a replica."""
    seed: int = 0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in (
            "prompts",
            "requests_per_prompt",
            "replicas",
            "prompt_tokens",
            "max_tokens",
            "concurrency",
            "kill_requests_per_prompt",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"gateway bench --routing: {name} = {value!r}: expected an integer >= 1")
        if self.replicas < 2:
            raise ConfigError(
                f"gateway bench --routing: replicas = {self.replicas}: expected at least 2 (one is killed)"
            )
        if not self.kv_prefixes > 0:
            raise ConfigError(f"gateway bench --routing: kv_prefixes = {self.kv_prefixes!r}: expected > 0")
        if not (self.model / "config.json").is_file():
            raise ConfigError(f"gateway bench --routing: model {str(self.model)!r}: no config.json there")


@dataclass(slots=True)
class _Outcome:
    ok: bool = False
    started: bool = False
    """A byte of the answer reached the client."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class _Phase:
    outcomes: list[_Outcome]
    wall_s: float

    @property
    def ok(self) -> list[_Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def cached_share(self) -> float:
        prompt = sum(o.prompt_tokens for o in self.ok)
        return sum(o.cached_tokens for o in self.ok) / prompt if prompt else 0.0

    @property
    def rps(self) -> float:
        return len(self.ok) / self.wall_s

    def median(self, name: str) -> float | None:
        values = [getattr(o, name) for o in self.ok if getattr(o, name) is not None]
        return statistics.median(values) if values else None


@dataclass(frozen=True, slots=True)
class RoutingBenchResult:
    cached_share_prefix: float
    cached_share_round_robin: float
    cached_share_ratio: float
    throughput_ratio: float
    failed_requests_after_kill: int
    """Requests of the kill phase that failed before any byte reached the client (the gateway retries
    those elsewhere, so this should be 0)."""
    streams_cut_by_kill: int
    """Requests of the kill phase cut after their first byte (never retried, by design)."""
    requests_per_s_prefix: float
    requests_per_s_round_robin: float
    median_latency_s_prefix: float | None
    median_latency_s_round_robin: float | None
    median_ttft_s_prefix: float | None
    median_ttft_s_round_robin: float | None
    failed_requests_prefix: int
    failed_requests_round_robin: int
    requests_after_kill: int
    retries_after_kill: int
    model: str
    replicas: int
    prompts: int
    requests_per_prompt: int
    concurrency: int
    max_tokens: int
    prompt_tokens_min: int
    kv_cache_mib: int
    kv_prefixes_per_replica: float
    wall_s: float
    machine: dict[str, Any]
    """`tether.machine.machine_record`; threads: the engine replicas sharing the cores."""
    routed_prefix_pool: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_bytes_per_token(model: Path) -> int:
    """Float32 K and V of every layer for one token, from the model's config.json (as the engine sizes
    its cache)."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return int(2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 4)


def system_prompts(tokenizer: Any, count: int, tokens: int, seed: int) -> list[str]:
    """`count` distinct seeded texts of at least `tokens` tokens each."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"Handbook {i}, {rng.choice(_WORDS)} edition."]
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
            words.extend(rng.choice(_WORDS) for _ in range(32))
        prompts.append(" ".join(words))
    return prompts


@contextmanager
def _replicas(config: RoutingBenchConfig, kv_mib: int) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """`tether serve` processes on free ports and their URLs, from the moment each answers /healthz."""
    ports = [free_port() for _ in range(config.replicas)]
    processes = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "tether", "serve", "--model", str(config.model), "--port", str(port)),
                *("--kv-cache-mib", str(kv_mib), "--max-num-seqs", str(config.concurrency)),
                *("--max-num-batched-tokens", str(max(512, config.concurrency))),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for port in ports
    ]
    try:
        deadline = time.monotonic() + config.startup_timeout_s
        for process, port in zip(processes, ports, strict=True):
            while True:
                if process.poll() is not None:
                    stderr = process.stderr.read().decode() if process.stderr else ""
                    raise TetherError(f"gateway bench --routing: a replica exited early: {stderr[-2000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TetherError(
                        f"gateway bench --routing: a replica did not start in {config.startup_timeout_s:g} s"
                    )
                time.sleep(0.3)
        yield [(process, f"http://127.0.0.1:{port}") for process, port in zip(processes, ports, strict=True)]
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def _request(
    client: httpx.AsyncClient, model: str, system: str, question: str, max_tokens: int
) -> _Outcome:
    outcome = _Outcome()
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            buffer = b""
            async for chunk in response.aiter_bytes():
                if not outcome.started:
                    outcome.started, outcome.ttft_s = True, time.monotonic() - started
                buffer += chunk
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {buffer[:300]!r}"
                return outcome
    except httpx.HTTPError as error:
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    for event in buffer.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        payload = json.loads(event.removeprefix(b"data: "))
        if "error" in payload:
            outcome.error = str(payload["error"])[:300]
            return outcome
        usage = payload.get("usage")
        if usage:
            outcome.prompt_tokens = usage["prompt_tokens"]
            outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    outcome.ok = outcome.prompt_tokens > 0 and buffer.rstrip().endswith(b"data: [DONE]")
    if not outcome.ok:
        outcome.error = "the stream ended without usage and [DONE]"
    outcome.latency_s = time.monotonic() - started
    return outcome


async def _phase(
    client: httpx.AsyncClient,
    model: str,
    work: list[tuple[str, str]],
    config: RoutingBenchConfig,
    at_quarter: Any = None,
) -> _Phase:
    outcomes: list[_Outcome] = []
    queue = list(reversed(work))
    quarter = max(1, len(work) // 4)

    async def worker() -> None:
        while queue:
            system, question = queue.pop()
            outcomes.append(await _request(client, model, system, question, config.max_tokens))
            if at_quarter is not None and len(outcomes) == quarter:
                at_quarter()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    return _Phase(outcomes, time.monotonic() - started)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _workload(config: RoutingBenchConfig, prompts: list[str]) -> tuple[list[tuple[str, str]], ...]:
    """The measured phases' requests (one seeded order, the same for both) and the kill phase's."""
    rng = random.Random(config.seed)
    work = [
        (prompts[p], f"Question {q}: what does section {rng.randrange(1000)} say about {rng.choice(_WORDS)}?")
        for p in range(config.prompts)
        for q in range(config.requests_per_prompt)
    ]
    rng.shuffle(work)
    kill_work = [
        (prompts[p], f"Follow-up {q}: summarize the {rng.choice(_WORDS)} part.")
        for p in range(config.prompts)
        for q in range(config.kill_requests_per_prompt)
    ]
    rng.shuffle(kill_work)
    return work, kill_work


@dataclass(frozen=True, slots=True)
class _Measured:
    phase: _Phase
    metrics: str
    """The gateway's /metrics at the phase's end."""


async def _through_gateway(
    config: RoutingBenchConfig,
    urls: list[str],
    routing: Routing,
    work: list[tuple[str, str]],
    tmp: Path,
    at_quarter: Any = None,
) -> _Measured:
    """`work` through a gateway (in this process, on a local port) routing over `urls` by `routing`."""
    import uvicorn

    from tether.gateway.app import create_gateway_app

    pool = Pool(urls=urls, max_in_flight=256, tokenizer=str(config.model), routing=routing)
    gateway_config = GatewayConfig(
        models={config.model.name: "engines"},
        pools={"engines": pool},
        ledger_url=f"sqlite:///{tmp / f'{routing.value}-ledger.db'}",
        upstream_timeout_s=300,
    )
    keys, _ = open_stores(gateway_config)
    unrefusing = Limits(requests_per_minute=10**9, tokens_per_window=10**12, budget_usd=Decimal(10**6))
    secret, _ = keys.create("bench", Tier.STANDARD, unrefusing)
    keys.engine.dispose()
    port = free_port()
    async with running_gateway(gateway_config) as gateway:
        server = uvicorn.Server(
            uvicorn.Config(create_gateway_app(gateway), host="127.0.0.1", port=port, log_level="critical")
        )
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.05)
        headers = {"Authorization": f"Bearer {secret}"}
        limits = httpx.Limits(max_connections=config.concurrency * 2)
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=600, limits=limits
            ) as client:
                phase = await _phase(client, config.model.name, work, config, at_quarter)
                metrics = (await client.get("/metrics")).text
        finally:
            server.should_exit = True
            await serving
    return _Measured(phase, metrics)


def _measure(
    config: RoutingBenchConfig,
    kv_mib: int,
    routing: Routing,
    work: list[tuple[str, str]],
    tmp: Path,
    kill: bool = False,
) -> _Measured:
    """One phase on freshly started replicas (cold caches), killing the first a quarter of the way in."""
    with _replicas(config, kv_mib) as served:

        def kill_one() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(served[0][0].pid, signal.SIGKILL)

        urls = [url for _, url in served]
        return asyncio.run(_through_gateway(config, urls, routing, work, tmp, kill_one if kill else None))


def run_routing_bench(config: RoutingBenchConfig) -> RoutingBenchResult:
    began = time.monotonic()
    load_start = load_average()
    tokenizer = load_tokenizer(str(config.model), "bench")
    prompts = system_prompts(tokenizer, config.prompts, config.prompt_tokens, config.seed)
    per_prompt = max(len(tokenizer.encode(p)) for p in prompts) + 64  # the template and the question
    kv_mib = max(1, round(config.kv_prefixes * per_prompt * kv_bytes_per_token(config.model) / 2**20))
    kv_tokens = kv_mib * 2**20 // kv_bytes_per_token(config.model) // _BLOCK * _BLOCK
    work, kill_work = _workload(config, prompts)
    with tempfile.TemporaryDirectory(prefix="tether-routing-bench-") as folder:
        tmp = Path(folder)
        by_prefix = _measure(config, kv_mib, Routing.PREFIX, work, tmp)
        by_turn = _measure(config, kv_mib, Routing.ROUND_ROBIN, work, tmp)
        killed = _measure(config, kv_mib, Routing.PREFIX, kill_work, tmp, kill=True)
    prefix, round_robin = by_prefix.phase, by_turn.phase
    routed = {
        by: int(_metric(by_prefix.metrics, "tether_gateway_routed_total", by=by))
        for by in ("prefix", "spill", "least_loaded", "failover")
    }
    after_kill = killed.phase.outcomes[max(1, len(killed.phase.outcomes) // 4) :]
    return RoutingBenchResult(
        cached_share_prefix=round(prefix.cached_share, 4),
        cached_share_round_robin=round(round_robin.cached_share, 4),
        cached_share_ratio=round(prefix.cached_share / round_robin.cached_share, 3)
        if round_robin.cached_share
        else math.inf,
        throughput_ratio=round(prefix.rps / round_robin.rps, 3) if round_robin.rps else math.inf,
        failed_requests_after_kill=sum(not o.ok and not o.started for o in killed.phase.outcomes),
        streams_cut_by_kill=sum(not o.ok and o.started for o in killed.phase.outcomes),
        requests_per_s_prefix=round(prefix.rps, 3),
        requests_per_s_round_robin=round(round_robin.rps, 3),
        median_latency_s_prefix=prefix.median("latency_s"),
        median_latency_s_round_robin=round_robin.median("latency_s"),
        median_ttft_s_prefix=prefix.median("ttft_s"),
        median_ttft_s_round_robin=round_robin.median("ttft_s"),
        failed_requests_prefix=len(prefix.outcomes) - len(prefix.ok),
        failed_requests_round_robin=len(round_robin.outcomes) - len(round_robin.ok),
        requests_after_kill=len(after_kill),
        retries_after_kill=int(_metric(killed.metrics, "tether_gateway_retries_total")),
        model=config.model.name,
        replicas=config.replicas,
        prompts=config.prompts,
        requests_per_prompt=config.requests_per_prompt,
        concurrency=config.concurrency,
        max_tokens=config.max_tokens,
        prompt_tokens_min=min((o.prompt_tokens for o in prefix.ok), default=0),
        kv_cache_mib=kv_mib,
        kv_prefixes_per_replica=round(kv_tokens / per_prompt, 2),
        wall_s=round(time.monotonic() - began, 1),
        machine=machine_record(config.replicas, load_start),
        routed_prefix_pool=routed,
    )
