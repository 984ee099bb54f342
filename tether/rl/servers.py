"""Rollout servers over HTTP: the vLLM and SGLang clients a `RemoteRollouts` source
(`remote_rollouts.py`) spreads a step's prompts over.

A client generates n samples from token ids (token ids, behaviour logprobs and the policy version of every
token come back; nothing is re-tokenized) and loads weights a transport has put somewhere the server sees.
A server reports at most one weight version per response, so a client makes versions exact on its side:
an update waits for the requests in flight and later requests wait for the update (the engine's `wait`
policy). How weights reach the servers (a safetensors folder, or for SGLang a process group) is
`server_weights.py`; vLLM's NCCL and IPC weight-transfer engines are not implemented.
"""

from __future__ import annotations

import asyncio
import math
import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx
import torch

from tether.engine.sampling import SamplingParams
from tether.errors import ConfigError
from tether.rl.sections import URL_PATTERN, RolloutBackend
from tether.rl.server_errors import (
    ServerError,
    ServerHTTPError,
    ServerResponseError,
    ServerTimeoutError,
    ServerUnreachableError,
    ServerWeightsError,
    error_message,
)

if TYPE_CHECKING:
    from tether.rl.server_weights import WeightsGroup

Tensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class ServerSample:
    """One completion: generated token ids with their behaviour logprobs and policy versions."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    """"stop", "length" or "abort", as the server reports it."""
    cached_tokens: int = 0
    """Prompt tokens of its request the server found in its prefix cache, as it reports them (vLLM's
    `usage.prompt_tokens_details.cached_tokens`, SGLang's `meta_info.cached_tokens`); 0 when it does not."""

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs) == len(self.versions)

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.versions)))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    base_url: str
    """The server's root, e.g. http://localhost:8000 (no /v1)."""
    model: str = ""
    """The served model name (vLLM's `model` field)."""
    timeout_s: float = 600.0
    """Longest wait for one HTTP answer, a whole completion included."""
    health_timeout_s: float = 10.0
    """Longest wait for the answer to a health check."""
    api_key: str | None = None
    initial_version: int = 0
    """The version of the weights the server was started with."""

    def __post_init__(self) -> None:
        if not re.match(URL_PATTERN, self.base_url):
            raise ConfigError(f"rollout server: base_url = {self.base_url!r}: expected http(s)://host[:port]")
        for name in ("timeout_s", "health_timeout_s"):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value > 0):
                raise ConfigError(f"rollout server: {name} = {value!r}: expected a number > 0")


class _Gate:
    """Requests and updates exclude each other: an update waits for the requests in flight and holds back
    new ones until it is done, so every token is generated with exactly one known version."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._requests = 0
        self._updating = False

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._requests += 1
        try:
            yield
        finally:
            async with self._changed:
                self._requests -= 1
                self._changed.notify_all()

    @asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            self._updating = True
            await self._changed.wait_for(lambda: self._requests == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._updating = False
                self._changed.notify_all()


@dataclass(slots=True)
class _ServerState:
    version: int
    broken: str | None = None  # why the last update failed: the server's weights are unknown until one works
    loaded: bool = False  # whether this client loaded the weights the server serves (else its own)
    gate: _Gate = field(default_factory=_Gate)


class RolloutServer(ABC):
    """One server of a fleet: one HTTP client, errors mapped to `ServerError`, versions numbered on the
    client and kept exact by its own gate. Subclasses speak one server's dialect, its health route
    included (`tether serve` answers `/healthz`, but takes no weights over HTTP: no client here)."""

    health_path = "/health"

    def __init__(self, config: ServerConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = client or httpx.AsyncClient(
            base_url=config.base_url, timeout=config.timeout_s, headers=headers
        )
        self._state = _ServerState(config.initial_version)

    @property
    def policy_version(self) -> int:
        """The version new requests are generated with (once a pending update is applied)."""
        return self._state.version

    async def aclose(self) -> None:
        await self._client.aclose()

    @property
    def url(self) -> str:
        return self.config.base_url

    async def health(self) -> None:
        """Returns if the server answers its health route with 2xx within `health_timeout_s` (whatever
        the body); raises a `ServerError` saying what it answered otherwise."""
        await self._send("GET", self.health_path, self.config.health_timeout_s)

    async def _post(self, endpoint: str, body: Any = None, params: Mapping[str, str] | None = None) -> Any:
        response = await self._send("POST", endpoint, self.config.timeout_s, body, params)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as error:
            raise ServerResponseError(
                f"{endpoint}: expected a JSON body, got {response.text[:200]!r}"
            ) from error

    async def _send(
        self,
        method: str,
        endpoint: str,
        timeout_s: float,
        body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """The 2xx answer within `timeout_s`, the whole answer included (httpx's timeouts bound each read
        only: a server trickling bytes would never time out)."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._client.request(
                    method, endpoint, json=body, params=params, timeout=timeout_s
                )
        except (httpx.TimeoutException, TimeoutError) as error:
            raise ServerTimeoutError(
                f"{endpoint}: no answer from {self.config.base_url} within {timeout_s} s"
            ) from error
        except httpx.HTTPError as error:
            raise ServerUnreachableError(
                f"{endpoint}: cannot reach {self.config.base_url}: {error!r}"
            ) from error
        if response.status_code >= 400:
            raise ServerHTTPError(endpoint, response.status_code, error_message(response))
        return response

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[ServerSample]:
        """`params.n` samples of one prompt, in sample order; concurrent calls are batched by the server."""
        prompt = _check_prompt(prompt_token_ids)
        async with self._state.gate.request():
            if self._state.broken is not None:
                raise ServerWeightsError(
                    f"the last weight update failed ({self._state.broken}); update again first"
                )
            return await self._generate(prompt, params, self._state.version)

    async def join_group(self, group: WeightsGroup, rank_offset: int) -> None:
        """Join the trainer's weight broadcast group as rank `rank_offset` (returns once it is formed)."""
        raise ServerError(f"{type(self).__name__} does not take weights over a process group")

    async def update_weights(
        self, tensors: Tensors, location: str | WeightsGroup, version: int, reload: bool = False
    ) -> None:
        """Load the weights a transport put at `location` as `version` (above every earlier one; with
        `reload`, the version it holds may be loaded anew, as a server that restarted lost it); returns
        once they serve requests. `tensors` name them (with dtypes and shapes) for the servers that ask."""
        if not tensors:
            raise ServerError("a weight update needs at least one named tensor; got none")
        self._check_version(version, reload)
        async with self._state.gate.update():
            self._check_version(version, reload)  # again: another update may have gone first
            try:
                await self._load(tensors, location, version)
            except BaseException as error:  # cancelled too: the server may hold part of the new weights
                self._state.broken = str(error) or type(error).__name__
                raise
            self._state.version = version
            self._state.broken = None
            self._state.loaded = True

    def _check_version(self, version: int, reload: bool) -> None:
        lowest = self._state.version + (0 if reload else 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < lowest:
            relation = "at least" if reload else "greater than"
            expected = self._state.version
            raise ServerError(f"weight update version {version!r}: expected an integer {relation} {expected}")

    @abstractmethod
    async def _generate(self, prompt: list[int], params: SamplingParams, version: int) -> list[ServerSample]:
        """Samples of one prompt, every token tagged `version` (no update can run meanwhile)."""

    @abstractmethod
    async def _load(self, tensors: Tensors, location: str | WeightsGroup, version: int) -> None:
        """Have the server load the weights the transport put at `location`."""


class VLLMServer(RolloutServer):
    """A vLLM OpenAI-compatible server (`vllm serve`, with `VLLM_SERVER_DEV_MODE=1` for the update endpoints).

    Generation: `POST /v1/completions` with `prompt` as a list of token ids, `logprobs: 0` (the sampled
    token's logprob only), `return_tokens_as_token_ids: true` and vLLM's sampling extensions (`top_k`,
    `min_p`, `seed`, `stop_token_ids`, `ignore_eos`). Read back, per choice: `index`, `finish_reason` and
    `logprobs.tokens` (strings "token_id:<id>") with `logprobs.token_logprobs`; a `token_ids` list, when
    present (`return_token_ids`), must agree. Prompt logprobs are not requested: the learner recomputes.
    Weights: `POST /pause?mode=wait`, `/start_weight_update {"is_checkpoint_format": true}`,
    `/update_weights {"update_info": {names, dtype_names, shapes, packed, location}}`,
    `/finish_weight_update`, `/reset_prefix_cache`, then `/resume`. vLLM keeps no version: the client
    numbers them. Health: `GET /health`, 200 while its engine runs.
    """

    async def _generate(self, prompt: list[int], params: SamplingParams, version: int) -> list[ServerSample]:
        body: dict[str, Any] = {
            "model": self.config.model,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "n": params.n,
            "seed": params.seed,
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        answer = await self._post("/v1/completions", body)
        choices = _field(answer, "choices", list, "/v1/completions")
        if len(choices) != params.n:
            raise ServerResponseError(f"/v1/completions: expected {params.n} choices, got {len(choices)}")
        cached = _reported_count((answer.get("usage") or {}).get("prompt_tokens_details"), "cached_tokens")
        samples: list[ServerSample | None] = [None] * params.n
        for choice in choices:
            index = _field(choice, "index", int, "/v1/completions choice")
            logprobs = _field(choice, "logprobs", dict, "/v1/completions choice")
            strings = _field(logprobs, "tokens", list, "/v1/completions logprobs")
            values = _field(logprobs, "token_logprobs", list, "/v1/completions logprobs")
            ids = [_token_id(text) for text in strings]
            if "token_ids" in choice and choice["token_ids"] is not None and choice["token_ids"] != ids:
                raise ServerResponseError("/v1/completions: token_ids disagree with logprobs.tokens")
            if len(values) != len(ids) or not all(isinstance(v, int | float) for v in values):
                raise ServerResponseError("/v1/completions: expected one numeric logprob per token")
            if not 0 <= index < params.n:
                raise ServerResponseError(f"/v1/completions: choice index {index} of {params.n} samples")
            reason = str(choice.get("finish_reason") or "abort")
            samples[index] = ServerSample(
                ids, [float(v) for v in values], [version] * len(ids), reason, cached
            )
        if any(sample is None for sample in samples):
            raise ServerResponseError("/v1/completions: choice indices repeat")
        return [sample for sample in samples if sample is not None]

    async def _load(self, tensors: Tensors, location: str | WeightsGroup, version: int) -> None:
        assert isinstance(location, str), "the vLLM client loads folders only"
        update_info = {
            "names": [name for name, _ in tensors],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
            "shapes": [list(tensor.shape) for _, tensor in tensors],
            "packed": False,
            "location": location,
        }
        await self._post("/pause", params={"mode": "wait"})
        try:
            await self._post("/start_weight_update", {"is_checkpoint_format": True})
            await self._post("/update_weights", {"update_info": update_info})
            await self._post("/finish_weight_update", {})
            await self._post("/reset_prefix_cache")  # cached KV belongs to the old weights
        finally:
            await self._post("/resume")


class SGLangServer(RolloutServer):
    """An SGLang server, through its native API.

        Generation: `POST /generate` with `input_ids`, `sampling_params` (`max_new_tokens`, `temperature`,
        `top_p`, `top_k`, `min_p`, `stop`, `stop_token_ids`, `ignore_eos`, `sampling_seed`) and
        `return_logprob: true`; one request per sample (seed + i, as our engine seeds sample i). Read back:
        `output_ids`, `meta_info.output_token_logprobs` ([logprob, token_id, text] per token),
        `meta_info.finish_reason.type` and `meta_info.weight_version`, which must be ours once we loaded
    weights. Weights:
        `POST /update_weights_from_disk {"model_path", "weight_version", "flush_cache": true}`, or over a
        group (`server_weights.py`) `POST /init_weights_update_group` once, then per version
        `POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
        "flush_cache": true, "weight_version"}`; each answered `{"success": bool, "message": str}`.
    Health: `GET /health` (not `/health_generate`, whose one-token generation queues behind a full batch
    and would time out on a server that is merely busy).
    """

    async def _generate(self, prompt: list[int], params: SamplingParams, version: int) -> list[ServerSample]:
        one = replace(params, n=1)
        seeds = [None if params.seed is None else params.seed + i for i in range(params.n)]
        requests = [asyncio.ensure_future(self._one(prompt, one, seed, version)) for seed in seeds]
        try:
            return list(await asyncio.gather(*requests))
        finally:  # one sample failed: its siblings must not go on running against the server
            for request in requests:
                request.cancel()
            await asyncio.gather(*requests, return_exceptions=True)

    async def _one(
        self, prompt: list[int], params: SamplingParams, seed: int | None, version: int
    ) -> ServerSample:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
        }
        if seed is not None:
            sampling["sampling_seed"] = seed
        body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        answer = await self._post("/generate", body)
        output_ids = _field(answer, "output_ids", list, "/generate")
        meta = _field(answer, "meta_info", dict, "/generate")
        entries = _field(meta, "output_token_logprobs", list, "/generate meta_info")
        served = meta.get("weight_version")
        # Until we load weights, the server serves its own under its own name ("default").
        if self._state.loaded and served is not None and str(served) != str(version):
            raise ServerWeightsError(
                f"/generate: the server generated with weight version {served!r}, expected {version}: "
                "another client updated its weights"
            )
        if len(entries) != len(output_ids) or any(
            not isinstance(e, list | tuple) or len(e) < 2 or e[1] != t
            for e, t in zip(entries, output_ids, strict=True)
        ):
            raise ServerResponseError("/generate: output_token_logprobs disagree with output_ids")
        finish = meta.get("finish_reason")
        reason = str(finish.get("type", "abort")) if isinstance(finish, dict) else "abort"
        ids = [int(t) for t in output_ids]
        cached = _reported_count(meta, "cached_tokens")
        return ServerSample(ids, [float(e[0]) for e in entries], [version] * len(ids), reason, cached)

    async def join_group(self, group: WeightsGroup, rank_offset: int) -> None:
        body = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.group_name,
            "backend": group.backend.value,
        }
        answer = await self._post("/init_weights_update_group", body)
        _succeeded(answer, "/init_weights_update_group: the server refused to join the weights group")

    async def _load(self, tensors: Tensors, location: str | WeightsGroup, version: int) -> None:
        body: dict[str, Any]
        if isinstance(location, str):
            endpoint = "/update_weights_from_disk"
            body = {"model_path": location, "weight_version": str(version), "flush_cache": True}
        else:
            endpoint = "/update_weights_from_distributed"
            body = {
                "names": [name for name, _ in tensors],
                "dtypes": [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
                "shapes": [list(tensor.shape) for _, tensor in tensors],
                "group_name": location.group_name,
                "flush_cache": True,
                "weight_version": str(version),
            }
        _succeeded(await self._post(endpoint, body), f"{endpoint}: the server refused version {version}")


def _succeeded(answer: object, what: str) -> None:
    """SGLang's `{"success": bool, "message": str}` answers: anything but success is a refusal."""
    if not isinstance(answer, dict) or answer.get("success") is not True:
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise ServerError(f"{what}: {message}")


def _reported_count(container: object, key: str) -> int:
    """A token count a server may report (e.g. cached prompt tokens): 0 when it reports none."""
    value = container.get(key) if isinstance(container, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _check_prompt(prompt_token_ids: Iterable[int]) -> list[int]:
    prompt = list(prompt_token_ids)
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        raise ServerError(f"prompt token ids {prompt[:8]!r}: expected a non-empty list of integers >= 0")
    return prompt


def _token_id(text: object) -> int:
    """vLLM's `return_tokens_as_token_ids` spelling of a token: "token_id:<id>"."""
    if isinstance(text, str) and text.startswith("token_id:") and text[9:].isdigit():
        return int(text[9:])
    raise ServerResponseError(
        f"/v1/completions: token {text!r}: expected 'token_id:<id>' "
        "(does the server support return_tokens_as_token_ids?)"
    )


def _field(container: object, key: str, kind: type, where: str) -> Any:
    value = container.get(key) if isinstance(container, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ServerResponseError(f"{where}: expected {key!r} as {kind.__name__}, got {value!r}")
    return value


# The client class of each remote `rollout.backend`.
SERVERS: dict[RolloutBackend, type[RolloutServer]] = {
    RolloutBackend.VLLM: VLLMServer,
    RolloutBackend.SGLANG: SGLangServer,
}
