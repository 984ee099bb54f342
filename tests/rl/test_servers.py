"""Rollout server clients: vLLM's against a fake vLLM server over real HTTP (token ids in, token ids,
logprobs and versions out; version bumps; errors and timeouts as clear exceptions), SGLang's against a
fake speaking its native API over real HTTP, and the safetensors folder that keeps only live versions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.live_server import live_server
from tether.engine.sampling import SamplingParams
from tether.errors import ConfigError
from tether.rl.server_errors import ServerError, ServerHTTPError, ServerResponseError, ServerTimeoutError
from tether.rl.server_weights import SafetensorsDirTransport
from tether.rl.servers import RolloutServer, ServerConfig, ServerSample, SGLangServer, VLLMServer

from .fake_sglang import FakeSGLangState, create_fake_sglang
from .fake_vllm import FakeState, create_fake_vllm, logprob_of, token_of

PROMPT = [5, 9, 13, 2, 7]
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3)
WEIGHTS = {"model.norm.weight": torch.ones(8), "lm_head.weight": torch.zeros(4, 8)}


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeState, str]]:
    state = FakeState()
    with live_server(create_fake_vllm(state)) as url:
        yield state, url


@pytest.fixture
def state(fake: tuple[FakeState, str]) -> FakeState:
    """The shared fake, reset to a fresh server's state for each test."""
    fresh = FakeState()
    for name in fresh.__slots__:
        setattr(fake[0], name, getattr(fresh, name))
    return fake[0]


def vllm(fake: tuple[FakeState, str], timeout_s: float = 30.0) -> VLLMServer:
    return VLLMServer(ServerConfig(fake[1], model="fake", timeout_s=timeout_s))


async def push(server: RolloutServer, tmp_path: Path, version: int) -> None:
    """`WEIGHTS` as `version`, through the safetensors folder."""
    tensors = list(WEIGHTS.items())
    location = await SafetensorsDirTransport(tmp_path).send(tensors, version)
    await server.update_weights(tensors, location, version)


def assert_versions_match_logprobs(samples: list[ServerSample]) -> None:
    for sample in samples:
        assert sample.logprobs == [logprob_of(v) for v in sample.versions]


async def test_vllm_server_sends_token_ids_and_reads_back_ids_logprobs_and_versions(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    backend = vllm(fake)
    samples = await backend.generate(PROMPT, PARAMS)
    await backend.aclose()
    assert [s.token_ids for s in samples] == [[token_of(PROMPT, i, j) for i in range(6)] for j in range(2)]
    assert all(s.versions == [0] * 6 and s.finish_reason == "length" for s in samples)
    assert_versions_match_logprobs(samples)
    [body] = state.requests
    assert body["prompt"] == PROMPT and body["n"] == 2 and body["seed"] == 3 and body["logprobs"] == 0


@pytest.mark.parametrize(("reported", "cached"), [(None, 0), (4, 4)])
async def test_vllm_cached_prompt_tokens_are_read_from_usage_and_zero_when_not_reported(
    fake: tuple[FakeState, str], state: FakeState, reported: int | None, cached: int
) -> None:
    state.cached_tokens = reported
    backend = vllm(fake)
    samples = await backend.generate(PROMPT, PARAMS)
    await backend.aclose()
    assert [s.cached_tokens for s in samples] == [cached, cached]


async def test_vllm_weight_update_bumps_the_version_of_later_tokens(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    backend = vllm(fake)
    await push(backend, tmp_path, 4)
    samples = await backend.generate(PROMPT, PARAMS)
    await backend.aclose()
    assert backend.policy_version == 4 and state.version == 1 and not state.paused
    assert all(s.versions == [4] * 6 for s in samples)
    [info] = state.updates
    assert info["names"] == list(WEIGHTS) and info["shapes"] == [[8], [4, 8]]
    assert info["dtype_names"] == ["float32", "float32"]


async def test_vllm_updates_wait_for_requests_in_flight_so_no_completion_mixes_versions(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    state.delay_s = 0.05
    backend = vllm(fake)

    async def request(i: int) -> list[ServerSample]:
        await asyncio.sleep(0.015 * i)
        return await backend.generate([i + 1, 2, 3], PARAMS)

    async def update(version: int) -> None:
        await asyncio.sleep(0.03 * version)
        await push(backend, tmp_path, version)

    results, _ = await asyncio.gather(
        asyncio.gather(*(request(i) for i in range(10))), asyncio.gather(*(update(v) for v in (1, 2, 3)))
    )
    await backend.aclose()
    samples = [sample for batch in results for sample in batch]
    assert state.overlaps == 0 and state.version == state.cache_resets == 3
    assert len({sample.versions[0] for sample in samples}) > 1, "requests ran before and after updates"
    assert all(len(sample.policy_versions) == 1 for sample in samples)
    assert_versions_match_logprobs(samples)  # the fake's own count of updates agrees with every tag


@pytest.mark.parametrize(
    ("failure", "error", "message"),
    [
        ({"/v1/completions": 400}, ServerHTTPError, "rejected the request with HTTP 400: injected failure"),
        ({"/v1/completions": 503}, ServerHTTPError, "failed with HTTP 503: injected failure"),
        ({"malformed": True}, ServerResponseError, "return_tokens_as_token_ids"),
        ({"delay_s": 1.0}, ServerTimeoutError, "within 0.3 s"),
    ],
    ids=["4xx", "5xx", "malformed", "timeout"],
)
async def test_vllm_errors_surface_as_clear_exceptions(
    fake: tuple[FakeState, str],
    state: FakeState,
    tmp_path: Path,
    failure: dict[str, Any],
    error: type[ServerError],
    message: str,
) -> None:
    if "malformed" in failure or "delay_s" in failure:
        for key, value in failure.items():
            setattr(state, key, value)
    else:
        state.fail.update(failure)
    backend = vllm(fake, timeout_s=0.3)
    with pytest.raises(error, match=message):
        await backend.generate(PROMPT, PARAMS)
    await backend.aclose()


async def test_an_unreachable_server_is_a_server_error() -> None:
    backend = VLLMServer(ServerConfig("http://127.0.0.1:9", timeout_s=5))
    with pytest.raises(ServerError, match=r"cannot reach http://127\.0\.0\.1:9"):
        await backend.generate(PROMPT, PARAMS)
    await backend.aclose()


async def test_a_failed_update_resumes_the_server_and_blocks_generation_until_one_succeeds(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    backend = vllm(fake)
    state.fail["/update_weights"] = 500
    with pytest.raises(ServerHTTPError, match="/update_weights: the server failed with HTTP 500"):
        await push(backend, tmp_path, 1)
    assert backend.policy_version == 0 and not state.paused
    with pytest.raises(ServerError, match="last weight update failed"):
        await backend.generate(PROMPT, PARAMS)
    await push(backend, tmp_path, 1)
    samples = await backend.generate(PROMPT, PARAMS)
    await backend.aclose()
    assert all(s.versions == [1] * 6 for s in samples)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.update_weights(list(WEIGHTS.items()), "/w", version=0), "greater than 0"),
        (lambda b: b.update_weights(list(WEIGHTS.items()), "/w", version=True), "greater than 0"),
        (lambda b: b.update_weights([], "/w", version=1), "at least one named tensor"),
        (lambda b: b.generate([], PARAMS), "non-empty list of integers"),
        (lambda b: b.generate([1, -2], PARAMS), "non-empty list of integers"),
        (lambda b: b.generate(["a"], PARAMS), "non-empty list of integers"),
    ],
    ids=["same version", "bool version", "no tensors", "empty prompt", "negative id", "text prompt"],
)
async def test_remote_bad_inputs_are_refused_before_reaching_the_server(
    fake: tuple[FakeState, str], state: FakeState, call: Callable[[Any], Any], message: str
) -> None:
    backend = vllm(fake)
    with pytest.raises(ServerError, match=message):
        await call(backend)
    await backend.aclose()
    assert not state.requests and not state.updates


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_url": "localhost:8000"}, "base_url"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": "1"}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
    ],
)
def test_bad_remote_config_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**{"base_url": "http://h:1", **kwargs})


async def test_sglang_server_speaks_the_native_api(tmp_path: Path) -> None:
    state = FakeSGLangState()
    with live_server(create_fake_sglang(state)) as url:
        server = SGLangServer(ServerConfig(url))
        params = SamplingParams(max_tokens=3, n=2, seed=10)
        before = await server.generate(PROMPT, params)  # the server's own weights: "default"
        await push(server, tmp_path, 1)
        after = await server.generate(PROMPT, params)
        assert [s.token_ids for s in before] == [
            [token_of(PROMPT, i, seed % 7) for i in range(3)] for seed in (10, 11)
        ]
        assert [s.versions for s in before + after] == [[0] * 3] * 2 + [[1] * 3] * 2
        assert before[0].logprobs == [logprob_of(0)] * 3 and after[0].logprobs == [logprob_of(1)] * 3
        assert before[0].finish_reason == "length"
        seeds = [r["sampling_params"]["sampling_seed"] for r in state.requests]
        assert sorted(seeds[:2]) == sorted(seeds[2:]) == [10, 11]  # one request per sample, concurrently
        [update] = state.updates
        assert update["weight_version"] == "1" and sorted(update["names"]) == sorted(WEIGHTS)
        assert update["model_path"] == str((tmp_path / "v1").absolute())
        state.weight_version = "7"  # someone else updated the server
        with pytest.raises(ServerError, match="weight version '7', expected 1"):
            await server.generate(PROMPT, params)
        state.refuse = True
        with pytest.raises(ServerError, match="refused version 2: shape mismatch"):
            await push(server, tmp_path, 2)
        await server.aclose()


def test_the_safetensors_folder_keeps_only_the_version_the_servers_hold(tmp_path: Path) -> None:
    transport = SafetensorsDirTransport(tmp_path / "weights")
    tensors = list(WEIGHTS.items())
    for version in (1, 2, 3):
        asyncio.run(transport.send(tensors, version))
    (tmp_path / "weights" / "notes").mkdir()  # not a version: left alone
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["notes", "v1", "v2", "v3"]
    transport.keep_only(3)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["notes", "v3"]
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "weights" / "v3" / "model.safetensors"))
    assert all(torch.equal(stored[name], tensor) for name, tensor in WEIGHTS.items())
    SafetensorsDirTransport(tmp_path / "absent").keep_only(1)  # nothing written yet: nothing to delete


async def test_a_reload_loads_the_version_the_client_holds_again_as_a_restarted_server_needs(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    backend = vllm(fake)
    await push(backend, tmp_path, 1)
    tensors = list(WEIGHTS.items())
    with pytest.raises(ServerError, match="expected an integer greater than 1"):
        await backend.update_weights(tensors, str(tmp_path / "v1"), 1)
    await backend.update_weights(tensors, str(tmp_path / "v1"), 1, reload=True)
    with pytest.raises(ServerError, match="expected an integer at least 1"):
        await backend.update_weights(tensors, str(tmp_path / "v0"), 0, reload=True)
    await backend.aclose()
    assert [Path(u["location"]).name for u in state.updates] == ["v1", "v1"] and backend.policy_version == 1


async def test_an_sglang_sample_that_fails_cancels_its_siblings_instead_of_leaving_them_running() -> None:
    state = FakeSGLangState(fail_seed=11, delay_s=1.0)
    with live_server(create_fake_sglang(state)) as url:
        server = SGLangServer(ServerConfig(url))
        with pytest.raises(ServerHTTPError, match="/generate: the server failed with HTTP 500: injected"):
            await server.generate(PROMPT, SamplingParams(max_tokens=3, n=2, seed=10))
        assert asyncio.all_tasks() == {asyncio.current_task()}  # seed 10's request is not left behind
        await server.aclose()
