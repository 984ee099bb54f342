"""The rollout interface: the in-process back end on a tiny engine, the vLLM back end against a fake vLLM
server over real HTTP (token ids in, token ids, logprobs and versions out; version bumps; errors and
timeouts as clear exceptions), and the SGLang back end against a handler speaking its native API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.live_server import live_server
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import WeightUpdateError
from tether.engine.sampling import SamplingParams
from tether.engine.weight_update import WeightUpdateConfig
from tether.errors import ConfigError
from tether.rl.backends import (
    BackendError,
    BackendHTTPError,
    BackendResponseError,
    BackendTimeoutError,
    LocalBackend,
    RemoteConfig,
    RolloutBackend,
    SafetensorsDirTransport,
    Sample,
    SGLangBackend,
    VLLMBackend,
)

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


def vllm(fake: tuple[FakeState, str], tmp_path: Path, timeout_s: float = 30.0) -> VLLMBackend:
    config = RemoteConfig(fake[1], model="fake", timeout_s=timeout_s)
    return VLLMBackend(config, SafetensorsDirTransport(tmp_path))


def assert_versions_match_logprobs(samples: list[Sample]) -> None:
    for sample in samples:
        assert sample.logprobs == [logprob_of(v) for v in sample.versions]


async def test_vllm_backend_sends_token_ids_and_reads_back_ids_logprobs_and_versions(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    backend = vllm(fake, tmp_path)
    samples = await backend.generate(PROMPT, PARAMS)
    await backend.aclose()
    assert isinstance(backend, RolloutBackend)
    assert [s.token_ids for s in samples] == [[token_of(PROMPT, i, j) for i in range(6)] for j in range(2)]
    assert all(s.versions == [0] * 6 and s.finish_reason == "length" for s in samples)
    assert_versions_match_logprobs(samples)
    [body] = state.requests
    assert body["prompt"] == PROMPT and body["n"] == 2 and body["seed"] == 3 and body["logprobs"] == 0


async def test_vllm_weight_update_bumps_the_version_of_later_tokens(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    backend = vllm(fake, tmp_path)
    await backend.update_weights(WEIGHTS, version=4)
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
    backend = vllm(fake, tmp_path)

    async def request(i: int) -> list[Sample]:
        await asyncio.sleep(0.015 * i)
        return await backend.generate([i + 1, 2, 3], PARAMS)

    async def update(version: int) -> None:
        await asyncio.sleep(0.03 * version)
        await backend.update_weights(WEIGHTS, version=version)

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
        ({"/v1/completions": 400}, BackendHTTPError, "rejected the request with HTTP 400: injected failure"),
        ({"/v1/completions": 503}, BackendHTTPError, "failed with HTTP 503: injected failure"),
        ({"malformed": True}, BackendResponseError, "return_tokens_as_token_ids"),
        ({"delay_s": 1.0}, BackendTimeoutError, "within 0.3 s"),
    ],
    ids=["4xx", "5xx", "malformed", "timeout"],
)
async def test_vllm_errors_surface_as_clear_exceptions(
    fake: tuple[FakeState, str],
    state: FakeState,
    tmp_path: Path,
    failure: dict[str, Any],
    error: type[BackendError],
    message: str,
) -> None:
    if "malformed" in failure or "delay_s" in failure:
        for key, value in failure.items():
            setattr(state, key, value)
    else:
        state.fail.update(failure)
    backend = vllm(fake, tmp_path, timeout_s=0.3)
    with pytest.raises(error, match=message):
        await backend.generate(PROMPT, PARAMS)
    await backend.aclose()


async def test_an_unreachable_server_is_a_backend_error(tmp_path: Path) -> None:
    backend = VLLMBackend(RemoteConfig("http://127.0.0.1:9", timeout_s=5), SafetensorsDirTransport(tmp_path))
    with pytest.raises(BackendError, match=r"cannot reach http://127\.0\.0\.1:9"):
        await backend.generate(PROMPT, PARAMS)
    await backend.aclose()


async def test_a_failed_update_resumes_the_server_and_blocks_generation_until_one_succeeds(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path
) -> None:
    backend = vllm(fake, tmp_path)
    state.fail["/update_weights"] = 500
    with pytest.raises(BackendHTTPError, match="/update_weights: the server failed with HTTP 500"):
        await backend.update_weights(WEIGHTS, version=1)
    assert backend.policy_version == 0 and not state.paused
    with pytest.raises(BackendError, match="last weight update failed"):
        await backend.generate(PROMPT, PARAMS)
    await backend.update_weights(WEIGHTS, version=1)
    samples = await backend.generate(PROMPT, PARAMS)
    await backend.aclose()
    assert all(s.versions == [1] * 6 for s in samples)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.update_weights(WEIGHTS, version=0), "greater than 0"),
        (lambda b: b.update_weights(WEIGHTS, version=True), "greater than 0"),
        (lambda b: b.update_weights({}, version=1), "at least one named tensor"),
        (lambda b: b.generate([], PARAMS), "non-empty list of integers"),
        (lambda b: b.generate([1, -2], PARAMS), "non-empty list of integers"),
        (lambda b: b.generate(["a"], PARAMS), "non-empty list of integers"),
    ],
    ids=["same version", "bool version", "no tensors", "empty prompt", "negative id", "text prompt"],
)
async def test_remote_bad_inputs_are_refused_before_reaching_the_server(
    fake: tuple[FakeState, str], state: FakeState, tmp_path: Path, call: Callable[[Any], Any], message: str
) -> None:
    backend = vllm(fake, tmp_path)
    with pytest.raises(BackendError, match=message):
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
        RemoteConfig(**{"base_url": "http://h:1", **kwargs})


def sglang_handler(server: dict[str, Any]) -> Callable[[httpx.Request], httpx.Response]:
    """SGLang's native /generate and /update_weights_from_disk, as its docs describe them."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        server["bodies"].append((request.url.path, body))
        if request.url.path == "/update_weights_from_disk":
            if server.get("refuse"):
                return httpx.Response(200, json={"success": False, "message": "shape mismatch"})
            server["version"] = body["weight_version"]
            return httpx.Response(
                200, json={"success": True, "message": "Succeeded to update model weights."}
            )
        ids = [
            token_of(body["input_ids"], i, body["sampling_params"].get("sampling_seed", 0)) for i in range(3)
        ]
        meta = {
            "finish_reason": {"type": "length", "length": 3},
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "weight_version": server["version"],
        }
        return httpx.Response(200, json={"text": "abc", "output_ids": ids, "meta_info": meta})

    return handle


async def test_sglang_backend_speaks_the_native_api(tmp_path: Path) -> None:
    server: dict[str, Any] = {"version": "0", "bodies": []}
    client = httpx.AsyncClient(
        transport=httpx.MockTransport(sglang_handler(server)), base_url="http://sglang"
    )
    backend = SGLangBackend(RemoteConfig("http://sglang"), SafetensorsDirTransport(tmp_path), client)
    params = SamplingParams(max_tokens=3, n=2, seed=10)
    before = await backend.generate(PROMPT, params)
    await backend.update_weights(WEIGHTS, version=1)
    after = await backend.generate(PROMPT, params)
    assert [s.token_ids for s in before] == [
        [token_of(PROMPT, i, seed) for i in range(3)] for seed in (10, 11)
    ]
    assert [s.versions for s in before + after] == [[0] * 3] * 2 + [[1] * 3] * 2
    assert before[0].logprobs == [-0.5] * 3 and before[0].finish_reason == "length"
    path, update = server["bodies"][2]
    assert path == "/update_weights_from_disk" and update["weight_version"] == "1"
    assert (Path(update["model_path"]) / "model.safetensors").is_file()
    server["version"] = "7"  # someone else updated the server
    with pytest.raises(BackendError, match="weight version '7', expected 1"):
        await backend.generate(PROMPT, params)
    server["refuse"] = True
    with pytest.raises(BackendError, match="refused version 2: shape mismatch"):
        await backend.update_weights(WEIGHTS, version=2)
    await backend.aclose()


@pytest.fixture(scope="module")
def tiny_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


async def test_local_backend_matches_the_engine_and_tags_versions(tiny_path: Path) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, n=2, seed=7, ignore_eos=True)
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, block_size=4, max_model_len=64)
    [expected] = engine.generate([PROMPT], params)
    backend = LocalBackend.start(
        LLMEngine.from_pretrained(
            tiny_path,
            kv_cache_mib=1,
            block_size=4,
            max_model_len=64,
            weight_update=WeightUpdateConfig("wait"),
        )[0]
    )
    try:
        assert isinstance(backend, RolloutBackend)
        samples = await backend.generate(PROMPT, params)
        assert [s.token_ids for s in samples] == [c.token_ids for c in expected.completions]
        assert [s.logprobs for s in samples] == [c.logprobs for c in expected.completions]
        assert all(s.versions == [0] * 5 for s in samples)
        name = "model.norm.weight"
        weight = dict(backend.engine.engine.runner.model.named_parameters())[name].detach() * 2
        await backend.update_weights({name: weight}, version=3)
        assert backend.policy_version == 3
        after = await backend.generate(PROMPT, params)
        assert all(s.versions == [3] * 5 for s in after)
        with pytest.raises(WeightUpdateError, match="greater than 3"):
            await backend.update_weights({name: weight}, version=3)
    finally:
        backend.close()
