"""Weights to SGLang servers over a process group (`server_weights.py`) against fake servers that join it as
SGLang does (torch's own group helper) and receive real broadcasts: the bytes arrive in every server of a
fleet, versions advance, and a refusal fails the update, names the server's reason and is not retried on a
group left halfway."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from tests.live_server import live_server
from tether.engine.weight_sync import SyncBackend
from tether.rl.server_errors import ServerError
from tether.rl.server_weights import CollectiveTransport, WeightsGroup
from tether.rl.servers import ServerConfig, SGLangServer

from .fake_sglang import FakeSGLangState, create_fake_sglang


@pytest.fixture
def fleet() -> Iterator[list[tuple[FakeSGLangState, str]]]:
    states = [FakeSGLangState(), FakeSGLangState(torch_helper=False)]
    with live_server(create_fake_sglang(states[0])) as one, live_server(create_fake_sglang(states[1])) as two:
        yield [(states[0], one), (states[1], two)]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 4, generator=generator)),
        ("model.norm.weight", torch.randn(4, generator=generator)),
    ]


async def test_a_broadcast_brings_every_server_of_the_fleet_the_bytes_sent(
    fleet: list[tuple[FakeSGLangState, str]],
) -> None:
    servers = [SGLangServer(ServerConfig(url)) for _, url in fleet]
    transport = CollectiveTransport("127.0.0.1", SyncBackend.GLOO, timeout_s=30)
    try:
        for version in (1, 2):
            await transport.deliver(servers, _weights(version), version)
            assert [server.policy_version for server in servers] == [version, version]
    finally:
        for server in servers:
            await server.aclose()
    assert transport.group is not None and transport.group.world_size == 3
    for state, _ in fleet:
        assert state.weight_version == "2" and list(state.received) == ["1", "2"]
        for version in (1, 2):
            got = state.received[str(version)]
            assert list(got) == [name for name, _ in _weights(version)]
            for name, tensor in _weights(version):
                assert torch.equal(got[name], tensor), name
        update = state.updates[0]
        assert update["dtypes"] == ["float32", "float32"] and update["shapes"] == [[11, 4], [4]]
        assert update["group_name"] == transport.group.group_name and update["flush_cache"] is True


async def test_a_refused_update_names_the_server_and_leaves_the_group_unusable(
    fleet: list[tuple[FakeSGLangState, str]],
) -> None:
    (state, url), _ = fleet
    server = SGLangServer(ServerConfig(url))
    transport = CollectiveTransport("127.0.0.1", SyncBackend.GLOO, timeout_s=2)
    try:
        await transport.deliver([server], _weights(1), 1)
        state.refuse = True
        with pytest.raises(
            ServerError, match="update_weights_from_distributed: the server refused version 2: shape mismatch"
        ):
            await transport.deliver([server], _weights(2), 2)
        assert server.policy_version == 1
        with pytest.raises(ServerError, match="group is unusable since an update failed"):
            await transport.deliver([server], _weights(3), 3)
    finally:
        await server.aclose()
    assert list(state.received) == ["1"]


def test_the_fleet_moves_as_one() -> None:
    async def partial() -> None:
        transport = CollectiveTransport("127.0.0.1", SyncBackend.GLOO, timeout_s=2)
        transport.group = WeightsGroup("127.0.0.1", 1, 3, "g", SyncBackend.GLOO)  # formed with 2 servers
        with pytest.raises(ServerError, match="reaches the whole fleet of 2 servers; 1 of them"):
            await transport.deliver([SGLangServer(ServerConfig("http://127.0.0.1:9"))], _weights(1), 1)

    asyncio.run(partial())
