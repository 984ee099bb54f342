"""`tether serve` against llama.cpp's `llama-server` on the same weights and threads, in one run.

Four servers run side by side, each measured alone in turn: `tether serve` in float32 and with int8
weights and int8 activations (`models.quantize`'s `w8a8`: the like of llama.cpp's q8 activations),
llama-server on a float32 GGUF of the very weights tether serves
(`models.gguf_export`: like for like), and llama-server on the package's Q4_1 GGUF (its own fast path).
float32 is set against float32, and tether's int8 against llama.cpp's Q4_1 (each one's quantized path).
Each round measures every server at every stream count before the next round starts, so a machine that
slows down mid-run weighs on all of them alike; figures are medians over rounds. A measurement is
`streams` concurrent /v1/completions requests of exactly `max_tokens` greedy tokens (EOS ignored,
counted from each reply's usage), as aggregate tokens/s; then the time to the first streamed token of a
short prompt, and of a long prompt whose prefix the server has just seen (its prefix cache). The harness
only drives HTTP; it builds nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from tether.engine.bench import QUESTIONS, TOPICS
from tether.engine.bench_machine import bench_threads, machine_info
from tether.errors import ConfigError
from tether.machine import load_average
from tether.models.gguf_export import write_f32_gguf
from tether.models.precision import DType
from tether.models.quantize import REFERENCE_TEXT
from tether.models.registry import KNOWN_MODELS
from tether.serving.llama_server import LlamaServerSpec, ServerFailed, find_llama_server, running_server
from tether.web import free_port

Progress = Callable[[str], None]
TETHER = "tether"
TETHER_INT8 = "tether_int8"
LLAMA_F32 = "llama_cpp_f32"
LLAMA_Q4 = "llama_cpp_q4"
SERVED_NAME = "bench"
INT8_QUANTIZATION = "w8a8"
"""tether's quantized contestant (a key of `models.quantize.QUANTIZERS`): llama.cpp's Q4_1 dot products
quantize the activations to 8 bits in blocks of 32 as well."""
# (ratio key, tether server, llama-server): the checks set float32 against float32 and each
# one's quantized path against the other's; tether's float32 against Q4_1 is recorded beside them.
PAIRINGS = (
    ("throughput_vs_llama_cpp_f32", TETHER, LLAMA_F32),
    ("throughput_vs_llama_cpp_q4", TETHER_INT8, LLAMA_Q4),
    ("throughput_fp32_vs_llama_cpp_q4", TETHER, LLAMA_Q4),
)


@dataclass(frozen=True, slots=True)
class PeerBenchConfig:
    cache_dir: Path
    """Cache root: tether's model folder, the float32 GGUF written once, and `make bench`'s llama-server."""
    model: str | Path = "smollm2-135m-instruct"
    """A registered model name or a Hugging Face folder (then `gguf` names its quantized GGUF)."""
    llama_server: Path | None = None
    """llama-server binary (default: on PATH, else the cache's)."""
    gguf: Path | None = None
    """Quantized GGUF llama-server serves (default: the registered model's shipped Q4_1 file)."""
    threads: int | None = None
    """Threads of every server; None: the cores idle at the start."""
    streams: tuple[int, ...] = (1, 16, 32)
    """Concurrent streams of each throughput measurement."""
    max_tokens: int = 64
    """Greedy tokens per request, exactly (EOS ignored). 64, not 128: four servers at 1, 16 and 32 streams
    for 3 rounds then fit the engine bench's 10 minutes on 2 cores; prompts stay far shorter."""
    rounds: int = 3
    """Interleaved rounds; every figure is a median over them."""
    prefix_tokens: int = 1024
    """Shared prefix of the prefix-cache time to first token, in tokens (about: text of this many)."""
    startup_timeout_s: float = 300.0
    """Longest wait for a server to load its model and answer its health check."""
    kv_cache_dtype: str = "float32"
    """tether's KV cache: float32, as its weights, or float16, as llama-server's own default cache (in
    its f32 run too; `llama-server --help`: `--cache-type-k`, default f16)."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "rounds", "prefix_tokens", "threads"):
            value = getattr(self, name)
            if value is None and name == "threads":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"peer bench: {name} = {value!r}: expected an integer of at least 1")
        if not self.streams or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.streams
        ):
            raise ConfigError(f"peer bench: streams = {self.streams!r}: expected integers of at least 1")
        if self.startup_timeout_s <= 0:
            raise ConfigError(f"peer bench: startup_timeout_s = {self.startup_timeout_s!r}: expected > 0")
        DType.parse(self.kv_cache_dtype, "peer bench: kv_cache_dtype")


@dataclass(slots=True)
class ServerSamples:
    """One server's per-round measurements."""

    tok_s: dict[int, list[float]] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    prefix_ttft_s: list[float] = field(default_factory=list)

    def medians(self) -> dict[str, float]:
        figures = {f"tok_s_{streams}": statistics.median(v) for streams, v in self.tok_s.items()}
        figures["ttft_ms"] = 1000 * statistics.median(self.ttft_s)
        figures["prefix_ttft_ms"] = 1000 * statistics.median(self.prefix_ttft_s)
        return figures


def stream_prompts(count: int) -> list[str]:
    """`count` distinct short prompts (the engine benchmark's questions), so no stream shares a prefix."""
    pairs = itertools.islice(itertools.cycle(itertools.product(TOPICS, QUESTIONS)), count)
    return [question.format(topic) + f" ({index})" for index, (topic, question) in enumerate(pairs)]


def prefix_text(tokens: int) -> str:
    """About `tokens` tokens of plain prose (a word is about one and a third tokens in SmolLM2)."""
    words = REFERENCE_TEXT.split()
    return " ".join(itertools.islice(itertools.cycle(words), tokens * 3 // 4))


def _body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,  # llama-server answers to any name
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # both servers honour it: every request makes exactly max_tokens
        "stream": stream,
    }


async def complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    """One greedy completion; its completion tokens as the server counts them."""
    try:
        reply = await client.post(f"{url}/v1/completions", json=_body(prompt, max_tokens, False))
        reply.raise_for_status()
        tokens = reply.json()["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise ServerFailed(f"peer bench: {url}/v1/completions failed: {error!r}") from None
    if tokens != max_tokens:
        raise ServerFailed(
            f"peer bench: {url} made {tokens} tokens, asked {max_tokens}: it did not ignore EOS"
        )
    return int(tokens)


async def aggregate_tok_s(client: httpx.AsyncClient, url: str, prompts: list[str], max_tokens: int) -> float:
    """Tokens/s of all `prompts` as concurrent streams, from the first request to the last reply."""
    started = time.perf_counter()
    tokens = await asyncio.gather(*(complete(client, url, prompt, max_tokens) for prompt in prompts))
    return sum(tokens) / (time.perf_counter() - started)


async def first_token_s(client: httpx.AsyncClient, url: str, prompt: str) -> float:
    """Seconds from sending a streamed request to its first server-sent event with a choice (a token's
    text may be empty: a partial UTF-8 character waits for the next)."""
    started = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(prompt, 8, True)) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                event = line.removeprefix("data: ")
                if line.startswith("data: ") and event != "[DONE]" and json.loads(event).get("choices"):
                    return time.perf_counter() - started  # the first token's event
    except (httpx.HTTPError, ValueError) as error:
        raise ServerFailed(f"peer bench: streaming from {url}/v1/completions failed: {error!r}") from None
    raise ServerFailed(f"peer bench: {url} streamed no token")


async def measure_round(
    urls: dict[str, str], samples: dict[str, ServerSamples], config: PeerBenchConfig, round_index: int
) -> None:
    """One round: every server at every stream count, then each server's two times to first token."""
    prefix = prefix_text(config.prefix_tokens)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)
    ) as client:
        for streams in config.streams:
            prompts = stream_prompts(streams)
            for name, url in urls.items():
                tok_s = await aggregate_tok_s(client, url, prompts, config.max_tokens)
                samples[name].tok_s.setdefault(streams, []).append(tok_s)
        for name, url in urls.items():
            samples[name].ttft_s.append(
                await first_token_s(client, url, f"Round {round_index}: {QUESTIONS[0]}")
            )
            seen = f"Round {round_index}. {prefix}"  # a new prefix each round: no round profits from the last
            await complete(client, url, seen + " What happened in the morning?", 1)
            samples[name].prefix_ttft_s.append(
                await first_token_s(client, url, seen + " What happened in the evening?")
            )


def quantized_gguf(config: PeerBenchConfig) -> Path:
    """The quantized GGUF llama-server serves: `gguf`, or the registered model's shipped file."""
    if config.gguf is not None:
        if not config.gguf.is_file():
            raise ConfigError(f"--gguf {config.gguf}: no such file; expected a GGUF model file")
        return config.gguf
    source = KNOWN_MODELS.get(str(config.model))
    if source is None:
        raise ConfigError(
            f"--model {config.model}: not a registered model, so its GGUF is unknown; pass --gguf PATH"
        )
    from tether.models.cache import locate_gguf

    return locate_gguf(source)


def float32_gguf(quantized: Path, cache_dir: Path, say: Progress) -> Path:
    """The float32 GGUF of `quantized`, written into the cache once."""
    out = cache_dir / "gguf" / f"{quantized.stem}.f32.gguf"
    if not out.is_file() or out.stat().st_mtime < quantized.stat().st_mtime:
        say(f"writing the float32 GGUF {out.name}")
        out.parent.mkdir(parents=True, exist_ok=True)
        write_f32_gguf(quantized, out)
    return out


def tether_command(
    folder: Path,
    port: int,
    threads: int,
    slots: int,
    quantization: str | None = None,
    kv_cache_dtype: str = "float32",
) -> list[str]:
    """`tether serve` through its launcher, pinned to `threads` (the CLI follows the free cores), its
    weights quantized by `quantization` (a key of `models.quantize.QUANTIZERS`) if given, its KV cache
    in `kv_cache_dtype` (a `DType` value)."""
    code = (
        "import torch; from tether.serving.launcher import serve; "
        f"serve({str(folder)!r}, port={port}, threads={threads}, max_num_seqs={slots}, "
        f"kv_cache_mib=512, model_name={SERVED_NAME!r}, log_level='warning', "
        f"quantization={quantization!r}, kv_cache_dtype=torch.{DType.parse(kv_cache_dtype).value})"
    )
    return [sys.executable, "-c", code]


def _servers(
    config: PeerBenchConfig, folder: Path, binary: Path, ggufs: dict[str, Path], threads: int
) -> Iterator[tuple[str, list[str], str, str]]:
    """(name, command, base URL, health URL) of each server; llama.cpp's first, since they start in
    a second and a bad binary should fail before tether loads its model."""
    slots = max(config.streams)
    for name, gguf in ggufs.items():
        port = free_port()
        spec = LlamaServerSpec(
            binary, gguf, threads, slots, config.prefix_tokens + 2 * config.max_tokens + 64
        )
        yield name, spec.command(port), f"http://127.0.0.1:{port}", "/health"
    for name, quantization in ((TETHER, None), (TETHER_INT8, INT8_QUANTIZATION)):
        port = free_port()
        command = tether_command(folder, port, threads, slots, quantization, config.kv_cache_dtype)
        yield name, command, f"http://127.0.0.1:{port}", "/healthz"


def run_peer_bench(config: PeerBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Start the four servers, measure them in interleaved rounds; one JSON-ready dict."""
    from tether.models.loader import resolve

    say = progress or (lambda _line: None)
    started = time.perf_counter()
    load_start = load_average()
    binary = find_llama_server(config.llama_server, config.cache_dir)
    quantized = quantized_gguf(config)
    threads = bench_threads(config.threads)
    folder = resolve(config.model, config.cache_dir, say)
    ggufs = {LLAMA_F32: float32_gguf(quantized, config.cache_dir, say), LLAMA_Q4: quantized}
    samples = {name: ServerSamples() for name in (TETHER, TETHER_INT8, *ggufs)}
    with tempfile.TemporaryDirectory(prefix="tether-peer-bench-") as scratch, ExitStack() as running:
        urls = {}
        for name, command, url, health in _servers(config, folder, binary, ggufs, threads):
            say(f"starting {name}")
            log = Path(scratch) / f"{name}.log"
            running.enter_context(running_server(name, command, url + health, config.startup_timeout_s, log))
            urls[name] = url
        say("warming up")
        # one stream and the widest batch: first-call costs (int8's packed weights, a batch's first
        # shapes) are paid before round 1, which with few rounds would weigh on the medians
        widest = tuple(sorted({1, max(config.streams)}))
        warm = replace(config, streams=widest, max_tokens=4, rounds=1, prefix_tokens=16)
        asyncio.run(measure_round(urls, {name: ServerSamples() for name in urls}, warm, -1))
        for round_index in range(config.rounds):
            say(f"round {round_index + 1}/{config.rounds}: {', '.join(urls)} at {config.streams} streams")
            asyncio.run(measure_round(urls, samples, config, round_index))
    figures = {name: each.medians() for name, each in samples.items()}
    ratios = {  # tokens/s of a tether server over a llama-server's, per pairing and stream count
        f"{key}_{streams}": figures[ours][f"tok_s_{streams}"] / figures[peer][f"tok_s_{streams}"]
        for key, ours, peer in PAIRINGS
        for streams in config.streams
    }
    return {
        "model": str(config.model),
        "llama_server": str(binary),
        "gguf_f32": str(ggufs[LLAMA_F32]),
        "gguf_q4": str(quantized),
        "threads": threads,
        "streams": list(config.streams),
        "max_tokens": config.max_tokens,
        "rounds": config.rounds,
        "prefix_tokens": config.prefix_tokens,
        "tether_kv_cache_dtype": config.kv_cache_dtype,
        "llama_cpp_kv_cache_dtype": "float16",  # llama-server's default, which the bench leaves as it is
        **figures,
        **ratios,
        "duration_s": time.perf_counter() - started,
        "machine": machine_info(threads, load_start),
    }
