"""Replicas at work: health checks take a dead replica out and bring it back, a request that fails before
any byte reached the client goes to another replica, and none is retried once its stream began."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.live_server import free_port, live_server
from tether.chat.pricing import Tier
from tether.gateway.config import Limits, Pool, Routing
from tether.gateway.metrics import GatewayMetrics
from tether.gateway.replicas import ReplicaPool, Streamed, Whole
from tether.gateway.routing import Health
from tether.gateway.upstream import Target, UpstreamError

from .conftest import TINY, live_gateway, make_config
from .helpers import serve

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


class FakeResponse:
    def __init__(self, status_code: int, chunks: list[bytes], broken_after: int | None = None) -> None:
        self.status_code, self.chunks, self.broken_after = status_code, chunks, broken_after
        self.closed = False

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.chunks):
            if i == self.broken_after:
                raise UpstreamError("the upstream closed the connection before its response ended")
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


class FakeUpstream:
    """Replicas by host: each either refuses connections, or answers with a scripted response."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.answers: dict[str, FakeResponse] = {}
        self.posts: list[str] = []

    def _host(self, target: Target) -> str:
        host = target.origin[1]
        if host in self.down:
            raise UpstreamError(f"cannot connect to {host}: ConnectionRefusedError")
        return host

    async def post(self, target: Target, body: bytes) -> FakeResponse:
        host = self._host(target)
        self.posts.append(host)
        return self.answers.get(host) or FakeResponse(200, [b'{"ok": true}'])

    async def get(self, target: Target) -> FakeResponse:
        self._host(target)
        return FakeResponse(200, [b'{"status": "ok"}'])

    async def aclose(self) -> None:
        pass


def pool(fake: FakeUpstream, **settings: Any) -> ReplicaPool:
    settings = {"urls": URLS, "routing": "round_robin", **settings}
    return ReplicaPool("engines", Pool.model_validate(settings), fake, GatewayMetrics())  # type: ignore[arg-type]


def metric(replicas: ReplicaPool, name: str, **labels: str) -> float:
    value = replicas.metrics.registry.get_sample_value(name, {"pool": "engines", **labels})
    return value or 0.0


async def test_failed_checks_take_a_replica_out_and_a_passed_one_brings_it_back() -> None:
    fake = FakeUpstream()
    replicas = pool(fake, unhealthy_after=2)
    fake.down.add("10.0.0.2")
    await replicas.check_once()
    assert replicas.healthy == 3  # one failure is not yet an outage
    await replicas.check_once()
    assert replicas.router.replicas[1].health is Health.DOWN and replicas.healthy == 2
    assert metric(replicas, "tether_gateway_replica_up", replica=URLS[1]) == 0
    for _ in range(6):
        assert await replicas.send("chat", b"{}", None, stream=False) == Whole(200, b'{"ok": true}')
    assert "10.0.0.2" not in fake.posts
    fake.down.clear()
    await replicas.check_once()
    assert replicas.healthy == 3
    assert metric(replicas, "tether_gateway_replica_up", replica=URLS[1]) == 1


async def test_the_background_checks_find_a_dead_replica_within_a_few_intervals() -> None:
    fake = FakeUpstream()
    replicas = pool(fake, health_interval_s=0.02, unhealthy_after=2)
    fake.down.add("10.0.0.3")
    replicas.start_health_checks()
    try:
        async with asyncio.timeout(2):
            while replicas.router.replicas[2].health is Health.UP:
                await asyncio.sleep(0.01)
        fake.down.clear()
        async with asyncio.timeout(2):
            while replicas.router.replicas[2].health is Health.DOWN:
                await asyncio.sleep(0.01)
    finally:
        await replicas.aclose()


async def test_a_refused_connection_is_retried_on_another_replica_and_counts_against_it() -> None:
    fake = FakeUpstream()
    replicas = pool(fake, unhealthy_after=1)
    fake.down.add("10.0.0.1")  # round-robin's first choice
    assert await replicas.send("chat", b"{}", None, stream=False) == Whole(200, b'{"ok": true}')
    assert fake.posts in (["10.0.0.2"], ["10.0.0.3"])
    assert replicas.router.replicas[0].health is Health.DOWN
    assert metric(replicas, "tether_gateway_retries_total", reason="connection") == 1
    assert metric(replicas, "tether_gateway_routed_total", by="failover") == 1
    assert all(r.in_flight == 0 for r in replicas.router.replicas)


async def test_a_5xx_is_retried_but_the_last_replicas_answer_is_returned_as_it_is() -> None:
    fake = FakeUpstream()
    replicas = pool(fake, max_attempts=2)
    busy = FakeResponse(503, [b'{"error": {"message": "engine overloaded"}}'])
    fake.answers = {"10.0.0.1": busy, "10.0.0.2": busy, "10.0.0.3": busy}
    answer = await replicas.send("chat", b"{}", None, stream=False)
    assert answer == Whole(503, b'{"error": {"message": "engine overloaded"}}')
    assert len(fake.posts) == 2 and len(set(fake.posts)) == 2  # max_attempts: the third is not tried
    assert metric(replicas, "tether_gateway_retries_total", reason="http_503") == 1


async def test_a_whole_answer_cut_off_is_retried_elsewhere() -> None:
    fake = FakeUpstream()
    replicas = pool(fake)
    fake.answers["10.0.0.1"] = FakeResponse(200, [b'{"ok":', b" true}"], broken_after=1)
    assert await replicas.send("chat", b"{}", None, stream=False) == Whole(200, b'{"ok": true}')
    assert fake.posts[0] == "10.0.0.1" and len(fake.posts) == 2


async def test_a_stream_cut_before_its_first_chunk_is_retried_but_one_that_began_is_not() -> None:
    fake = FakeUpstream()
    replicas = pool(fake)
    fake.answers["10.0.0.1"] = FakeResponse(200, [b"data: 1\n\n"], broken_after=0)
    began = FakeResponse(200, [b"data: 1\n\n", b"data: 2\n\n"], broken_after=1)
    fake.answers.update({"10.0.0.2": began, "10.0.0.3": began})
    streamed = await replicas.send("chat", b"{}", None, stream=True)
    assert isinstance(streamed, Streamed) and fake.posts[0] == "10.0.0.1" and len(fake.posts) == 2
    second = replicas.router.replicas[URLS.index(f"http://{fake.posts[1]}:8000")]
    assert second.in_flight == 1  # running until the relay closes it
    chunks = []
    with pytest.raises(UpstreamError):
        async for chunk in streamed.aiter_bytes():
            chunks.append(chunk)
    await streamed.aclose()
    await streamed.aclose()
    assert chunks == [b"data: 1\n\n"] and len(fake.posts) == 2  # not sent a third time
    assert second.in_flight == 0


async def test_when_every_replica_fails_the_error_says_how_many_were_tried() -> None:
    fake = FakeUpstream()
    fake.down.update({"10.0.0.1", "10.0.0.2", "10.0.0.3"})
    with pytest.raises(UpstreamError, match=r"tried 3 of 3 replicas"):
        await pool(fake).send("chat", b"{}", None, stream=False)


# through the gateway, on real sockets


def _replica_app(status: int, posts: list[str], stream_then_drop: bool = False) -> Any:
    """A fake engine that answers `status` (an OpenAI error unless 200), or streams one chunk and dies;
    it records the paths of the completions it was sent."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        posts.append(scope["path"])
        kind = b"text/event-stream" if stream_then_drop else b"application/json"
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
        if stream_then_drop:
            chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
            await send(
                {"type": "http.response.body", "body": f"data: {chunk}\n\n".encode(), "more_body": True}
            )
            raise RuntimeError("the replica dies mid-stream")
        body = json.dumps({"error": {"message": "overloaded", "type": "server_error"}}).encode()
        await send({"type": "http.response.body", "body": body})

    return app


def _routed(served: Any, by: str) -> float:
    value = served.gateway.metrics.registry.get_sample_value(
        "tether_gateway_routed_total", {"pool": "engine", "by": by}
    )
    return value or 0.0


@pytest.mark.parametrize("failure", ["refused", "503"])
async def test_a_chat_through_the_gateway_succeeds_on_another_replica(
    tiny_engine_url: str, tmp_path: Path, failure: str
) -> None:
    posts: list[str] = []
    with live_server(_replica_app(503, posts)) as busy:
        first = f"http://127.0.0.1:{free_port()}" if failure == "refused" else busy
        config = make_config(first, f"sqlite:///{tmp_path / 'ledger.db'}")
        pools = {"engine": Pool(urls=[first, tiny_engine_url], routing=Routing.ROUND_ROBIN)}
        async with serve(config.model_copy(update={"pools": pools})) as served:
            client = served.openai(served.key())
            reply = await client.chat.completions.create(
                model=TINY, messages=[{"role": "user", "content": "hello"}], max_tokens=3
            )
            assert reply.usage is not None and reply.usage.completion_tokens >= 1
            assert _routed(served, "failover") == 1
            if failure == "refused":  # the health checks take it out within a few seconds
                async with asyncio.timeout(10):
                    while (await served.http.get("/healthz")).json()["replicas"]["engine"] != {
                        "healthy": 1,
                        "total": 2,
                    }:
                        await asyncio.sleep(0.1)
    assert posts == ([] if failure == "refused" else ["/v1/chat/completions"])


async def test_a_stream_that_began_is_not_retried_and_the_client_sees_it_end_short(tmp_path: Path) -> None:
    dying: list[str] = []
    other: list[str] = []
    dying_app, spare_app = _replica_app(200, dying, stream_then_drop=True), _replica_app(503, other)
    with live_server(dying_app) as broken, live_server(spare_app) as spare:
        config = make_config(broken, f"sqlite:///{tmp_path / 'ledger.db'}")
        pools = {"engine": Pool(urls=[broken, spare], routing=Routing.ROUND_ROBIN)}
        with live_gateway(config.model_copy(update={"pools": pools})) as (url, gateway):
            secret, _ = gateway.keys.create("acme", Tier.STANDARD, Limits())
            body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            received: list[bytes] = []
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                with pytest.raises(httpx.RemoteProtocolError):  # the gateway cuts the client's stream
                    async with client.stream(
                        "POST",
                        "/v1/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {secret}"},
                    ) as response:
                        assert response.status_code == 200
                        async for chunk in response.aiter_bytes():
                            received.append(chunk)
            routed = gateway.metrics.registry.get_sample_value(
                "tether_gateway_routed_total", {"pool": "engine", "by": "failover"}
            )
    assert b'"content": "hi"' in b"".join(received)
    assert dying == ["/v1/chat/completions"] and other == [] and not routed
