"""A server fleet that loses servers (`RemoteRollouts` with `fleet.py`): a fake vLLM killed by pid mid-step
leaves the step to the others and rejoins, once restarted, after loading the current weights; servers
answering 500s, hanging past the timeout or failing their health check leave the rotation; a prompt no
server serves comes back infra-failed; a fleet that is all down fails fast, naming every server."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.live_server import live_server
from tether.envs.context import ScoringContext
from tether.errors import ConfigError
from tether.rl.config import TrainConfig, parse_config
from tether.rl.fleet import FleetHealth, FleetUnavailableError, Served, Unserved, spread
from tether.rl.remote_rollouts import RemoteRollouts, server_rollouts
from tether.rl.rollout import PromptPlan
from tether.rl.server_errors import ServerHTTPError, ServerTimeoutError, server_failed
from tether.rl.servers import ServerConfig
from tether.rl.sources import Generated
from tether.rl.trainer import sampling_params
from tether.web import free_port

from .fake_envs import fake_registry
from .fake_sglang import FakeSGLangState, create_fake_sglang
from .fake_vllm import FakeState, create_fake_vllm, logprob_of, token_of
from .test_trainer import tiny_config

WEIGHTS = [("model.norm.weight", torch.ones(8)), ("lm_head.weight", torch.zeros(4, 8))]
REMOVED = "rollout/servers_removed"
HEALTHY = "rollout/servers_healthy"


def retried(out: Generated) -> int:
    """Samples of a step re-issued after a server failed them."""
    return sum(r.retry_reasons.count("engine_failure") for r in out.rollouts)


def fleet_config(model: Path, out_dir: Path, urls: list[str], **rollout: object) -> TrainConfig:
    settings = {"base_urls": urls, "served_model": "fake", "max_new_tokens": 6, **rollout}
    return tiny_config(model, out_dir, rollout={"backend": "vllm", **settings})


def open_fleet(config: TrainConfig) -> RemoteRollouts:
    return server_rollouts(config, fake_registry(), ScoringContext(), sampling_params(config.rollout))


def plans(count: int) -> list[PromptPlan]:
    return [PromptPlan("test/vowels", seed, seed, 100 + seed) for seed in range(count)]


@contextmanager
def fake_vllm_process(port: int, delay_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """The fake vLLM in its own process, a test can kill by pid, once `/health` answers; killed on exit."""
    command = [sys.executable, "-m", "tests.rl.fake_vllm", str(port), str(delay_s)]
    process = subprocess.Popen(command, cwd=Path(__file__).parents[2], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not _healthy(port):
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
            assert time.monotonic() < deadline, "the fake vLLM process did not start"
            time.sleep(0.05)
        yield process
    finally:
        process.kill()
        process.wait()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_server_killed_mid_step_leaves_the_step_to_the_other_and_rejoins_after_loading_the_weights(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    survivor, port = FakeState(delay_s=0.6), free_port()
    with live_server(create_fake_vllm(survivor)) as first, fake_vllm_process(port, delay_s=0.6) as doomed:
        config = fleet_config(
            tiny_model("llama"), tmp_path, [first, f"http://127.0.0.1:{port}"], server_probe_s=0.2
        )
        rollouts = open_fleet(config)
        try:

            def kill_mid_step() -> None:  # by pid, once the step's requests are out (0.6 s each)
                while len(survivor.requests) < 2:
                    time.sleep(0.01)
                time.sleep(0.1)
                doomed.kill()

            killer = threading.Thread(target=kill_mid_step, daemon=True)
            killer.start()
            out = rollouts.generate(plans(4))
            killer.join()
            # Every sample came from the survivor: its own two prompts, then the killed server's.
            assert sorted(r["seed"] for r in survivor.requests) == [100, 101, 102, 103]
            assert [r.seed for r in out.rollouts] == [s for s in range(4) for _ in range(4)]
            for rollout in out.rollouts:
                assert rollout.infra_failure is None and rollout.versions == [0] * 6
                sample = out.rollouts.index(rollout) % 4
                assert rollout.completion_ids == [token_of(rollout.prompt_ids, i, sample) for i in range(6)]
            assert sorted(r.retries for r in out.rollouts) == [0] * 8 + [1] * 8
            assert out.counters == {REMOVED: 1, HEALTHY: 1}
            assert retried(out) == 2 * 4

            rollouts.load(iter(WEIGHTS), 1)  # the killed server is out: only the survivor loads it
            time.sleep(0.25)
            still_down = rollouts.generate(plans(2))  # its probe fails: the step goes on without it
            assert still_down.counters == {REMOVED: 0, HEALTHY: 1}
            assert retried(still_down) == 0

            time.sleep(0.45)  # the wait doubled after the failed probe
            restarted = FakeState()  # a fresh server where the killed one was, on its starting weights
            with live_server(create_fake_vllm(restarted), port):
                back = rollouts.generate(plans(2))
        finally:
            rollouts.close()
    assert back.counters == {REMOVED: 0, HEALTHY: 2}
    assert retried(back) == 0
    # It loaded version 1 before it got a request, so its samples are version 1's.
    assert [Path(u["location"]).name for u in restarted.updates] == ["v1"] and restarted.version == 1
    assert [r["seed"] for r in restarted.requests] == [101]
    assert all(r.versions == [1] * 6 and r.logprobs == [logprob_of(1)] * 6 for r in back.rollouts)
    assert [p.name for p in (tmp_path / "tiny" / "weights").iterdir()] == ["v1"]


@pytest.fixture
def fleet() -> Iterator[list[tuple[FakeState, str]]]:
    """Two fake vLLM servers in this process, each behind its own socket."""
    states = [FakeState(), FakeState()]
    with (
        live_server(create_fake_vllm(states[0])) as first,
        live_server(create_fake_vllm(states[1])) as second,
    ):
        yield [(states[0], first), (states[1], second)]


@pytest.mark.parametrize(
    ("failure", "reissued", "error"),
    [
        ({"broken": {"/v1/completions": 500}}, 2, "/v1/completions: the server failed with HTTP 500"),
        ({"delay_s": 1.5}, 2, "/v1/completions: no answer from http://127.0.0.1:\\d+ within 0.5 s"),
        ({"broken": {"/health": 503}}, 0, "health check: /health: the server failed with HTTP 503"),
    ],
    ids=["500s", "hangs", "unhealthy"],
)
def test_a_failing_server_is_removed_and_its_prompts_served_by_the_other(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    fleet: list[tuple[FakeState, str]],
    failure: dict[str, Any],
    reissued: int,
    error: str,
) -> None:
    (good, _), (bad, _) = fleet
    for key, value in failure.items():
        setattr(bad, key, value)
    config = fleet_config(tiny_model("llama"), tmp_path, [url for _, url in fleet], timeout_s=0.5)
    rollouts = open_fleet(config)
    try:
        start = time.monotonic()
        out = rollouts.generate(plans(4))
        took_s = time.monotonic() - start
    finally:
        rollouts.close()
    assert took_s < 2.5, "a hanging server costs one timeout, not one per request"
    assert sorted(r["seed"] for r in good.requests) == [100, 101, 102, 103]
    assert len(bad.requests) == (2 if "delay_s" in failure else 0)  # the fake records what it answers
    assert all(r.infra_failure is None and len(r.completion_ids) == 6 for r in out.rollouts)
    assert out.counters == {REMOVED: 1, HEALTHY: 1}
    assert retried(out) == reissued * 4
    [removed] = [server for server in rollouts.fleet.servers if server.last_error is not None]
    assert re.search(error, removed.last_error or "")


def test_an_unhealthy_sglang_server_is_left_out_of_the_step(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    states = [FakeSGLangState(), FakeSGLangState(healthy=False)]
    with (
        live_server(create_fake_sglang(states[0])) as first,
        live_server(create_fake_sglang(states[1])) as second,
    ):
        config = fleet_config(
            tiny_model("llama"), tmp_path, [first, second], backend="sglang", weight_sync="safetensors"
        )
        rollouts = open_fleet(config)
        try:
            out = rollouts.generate(plans(2))
        finally:
            rollouts.close()
    assert len(states[0].requests) == 2 * 4 and not states[1].requests  # SGLang: a request per sample
    assert out.counters == {REMOVED: 1, HEALTHY: 1}
    assert retried(out) == 0


def test_a_prompt_no_server_serves_in_its_attempts_comes_back_infra_failed_and_unscored(
    tiny_model: Callable[[str], Path], tmp_path: Path, fleet: list[tuple[FakeState, str]]
) -> None:
    fleet[1][0].broken["/v1/completions"] = 503
    urls = [url for _, url in fleet]
    rollouts = open_fleet(fleet_config(tiny_model("llama"), tmp_path, urls, server_attempts=1))
    try:
        out = rollouts.generate(plans(2))
    finally:
        rollouts.close()
    served, failed = out.rollouts[:4], out.rollouts[4:]
    assert all(r.infra_failure is None and "share" in r.components for r in served)
    for rollout in failed:
        assert rollout.infra_failure == "engine_failure" and rollout.seed == 1
        assert rollout.completion_ids == rollout.logprobs == rollout.versions == []
        assert rollout.components == {} and rollout.retries == 0  # never scored
        assert "no server served it in 1 attempts: /v1/completions: the server failed with HTTP 503" in (
            rollout.error or ""
        )
    assert out.counters == {REMOVED: 1, HEALTHY: 1}
    assert retried(out) == 0


def test_a_server_failing_a_weight_update_is_removed_until_it_loads_the_current_version(
    tiny_model: Callable[[str], Path], tmp_path: Path, fleet: list[tuple[FakeState, str]]
) -> None:
    (first, _), (second, _) = fleet
    urls = [url for _, url in fleet]
    rollouts = open_fleet(fleet_config(tiny_model("llama"), tmp_path, urls, server_probe_s=0.2))
    try:
        rollouts.load(iter(WEIGHTS), 1)
        second.fail["/update_weights"] = 500
        rollouts.load(iter(WEIGHTS), 2)  # the fleet goes on without it
        # Only v2 is kept: the server that failed loads the current version, not v1, to come back.
        assert [p.name for p in (tmp_path / "tiny" / "weights").iterdir()] == ["v2"]
        during = rollouts.generate(plans(2))
        assert [r["seed"] for r in second.requests] == []
        time.sleep(0.25)
        after = rollouts.generate(plans(2))
    finally:
        rollouts.close()
    assert during.counters == {REMOVED: 1, HEALTHY: 1}
    assert retried(during) == 0
    assert after.counters == {REMOVED: 0, HEALTHY: 2}
    assert retried(after) == 0
    assert [Path(u["location"]).name for u in first.updates] == ["v1", "v2"]
    assert [Path(u["location"]).name for u in second.updates] == ["v1", "v2"]
    assert [r["seed"] for r in second.requests] == [101]
    assert all(r.versions == [2] * 6 for r in after.rollouts)


def test_a_request_the_server_rejects_fails_the_step_with_its_own_error(
    tiny_model: Callable[[str], Path], tmp_path: Path, fleet: list[tuple[FakeState, str]]
) -> None:
    fleet[1][0].fail["/v1/completions"] = 400  # a bad request would be rejected by any server
    rollouts = open_fleet(fleet_config(tiny_model("llama"), tmp_path, [url for _, url in fleet]))
    try:
        with pytest.raises(ServerHTTPError, match="rejected the request with HTTP 400"):
            rollouts.generate(plans(2))
        assert len(rollouts.fleet.in_rotation()) == 2
    finally:
        rollouts.close()


def test_a_fleet_that_is_all_down_fails_the_step_fast_naming_every_server(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    rollouts = open_fleet(fleet_config(tiny_model("llama"), tmp_path, urls))
    try:
        start = time.monotonic()
        with pytest.raises(FleetUnavailableError) as caught:
            rollouts.generate(plans(2))
        assert time.monotonic() - start < 5
    finally:
        rollouts.close()
    message = str(caught.value)
    assert "no rollout server is healthy, so the fleet cannot serve 2 of the step's 2 requests" in message
    for url in urls:
        assert f"{url}: health check: /health: cannot reach {url}" in message


def test_a_removed_server_is_probed_after_a_wait_that_doubles_with_each_failed_probe() -> None:
    now = [100.0]
    fleet = FleetHealth(["http://a:1", "http://b:1"], probe_s=10.0, clock=lambda: now[0])
    assert fleet.remove(1, "reset") and not fleet.remove(1, "reset again")
    assert fleet.take_removals() == 1 and fleet.take_removals() == 0
    assert fleet.in_rotation() == [0] and fleet.servers[1].last_error == "reset"
    waits = []
    for _ in range(8):
        start = now[0]
        while not fleet.due_for_probe():
            now[0] += 1.0
        waits.append(now[0] - start)
        fleet.probe_failed(1, "refused")
    assert waits == [10, 20, 40, 80, 160, 320, 600, 600]  # doubling, at most 10 minutes
    fleet.rejoin(1)
    assert fleet.in_rotation() == [0, 1] and fleet.servers[1].last_error is None


async def test_spread_reissues_a_removed_servers_requests_and_bounds_each_ones_attempts() -> None:
    fleet = FleetHealth(["http://a:1", "http://b:1", "http://c:1"], probe_s=1.0, clock=time.monotonic)
    timeout = ServerTimeoutError("/v1/completions: no answer")

    async def send(request: int, server: int) -> str:
        if server == 0 and request == 0:
            raise timeout
        if server == 0:
            await asyncio.sleep(60)  # request 3 would hang on it: cancelled when request 0 fails
        if server == 2 and request == 0:
            raise ServerHTTPError("/v1/completions", 503, "overloaded")
        await asyncio.sleep(0.05)
        return f"{request}@{server}"

    result = await spread(4, fleet, send, attempts=2, server_failed=server_failed)
    # Request 0: a timed out, then c failed it (its second attempt, the last); 3 (on a) and 2 (on c)
    # were cancelled with their servers and served by b, the one left.
    assert result.outcomes == [
        Unserved("/v1/completions: the server failed with HTTP 503: overloaded", 2),
        Served("1@1", 1),
        Served("2@1", 2),
        Served("3@1", 2),
    ]
    assert result.reissued == 3 and fleet.in_rotation() == [1]
    assert [server.last_error for server in fleet.servers] == [
        str(timeout),
        None,
        str(result.outcomes[0].error),
    ]


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"server_attempts": 0}, "rollout.server_attempts = 0: Input should be greater than or equal to 1"),
        ({"health_timeout_s": 0}, "rollout.health_timeout_s = 0: Input should be greater than 0"),
        ({"server_probe_s": float("inf")}, "rollout.server_probe_s = inf"),
        (
            {"backend": "local", "base_urls": [], "server_attempts": 5},
            "rollout.server_attempts is read only with rollout.back",
        ),
    ],
)
def test_bad_failover_settings_are_named(rollout: dict[str, object], message: str) -> None:
    remote = {"backend": "vllm", "base_urls": ["http://h:1"]}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"envs": {"weights": {"math/arithmetic": 1.0}}, "rollout": {**remote, **rollout}})


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True])
def test_a_bad_health_timeout_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="health_timeout_s"):
        ServerConfig("http://h:1", health_timeout_s=value)  # type: ignore[arg-type]
