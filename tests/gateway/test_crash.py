"""A gateway killed with SIGKILL mid-race loses no charge: 60 clients hammer one budget through a gateway
process, it is killed, a new one takes over on the same ledger, and in the end the ledger bills every
response the clients received (whole answers, and streams that reached `[DONE]`) exactly, beyond them only
requests the kill cut short after their charge was committed, and never more than the budget: the
restarted instance counts the requests cut short before their charge at their worst case."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.live_server import live_server
from tether.chat import Usage
from tether.gateway import GatewayConfig, Limits, Tier, build_gateway
from tether.gateway.bench import Receive, Scope, Send
from tether.gateway.ledger import PICO_PER_USD, Charge, Reservation
from tether.gateway.runtime import open_stores
from tether.gateway.usage_log import Refused
from tether.web import free_port

from .conftest import drop_tables, make_config
from .helpers import expected_cost, serve

MODEL = "fake"
CLIENTS = 60
KILL_AFTER = 60
# a request reserves its worst case, 2 prompt token ids x 1.80 + 1 x 9.50 = 13.10 micro-USD, and costs
# 9.86 to 13.10 (0 to 2 cache hits): this budget runs out after some 150 requests, well after the kill
BUDGET = Decimal("0.0018")
BUDGET_CODES = {"budget_exhausted", "request_exceeds_budget"}


async def fake_engine(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers `/v1/completions` after a few milliseconds (so that requests are in flight at the kill),
    with 0-2 of the 2 prompt tokens cached; streams as the engine does: a chunk, the usage, `[DONE]`."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.loads(b"".join(chunks))
    await asyncio.sleep(random.uniform(0, 0.005))
    usage = {
        "prompt_tokens": len(body["prompt"]),
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": random.randint(0, len(body["prompt"]))},
    }
    envelope = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": MODEL}
    if body.get("stream"):
        events = [
            {**envelope, "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]},
            {**envelope, "choices": [], "usage": usage},
        ]
        content = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        content_type = b"text/event-stream"
    else:
        choice = {"index": 0, "text": "ok", "finish_reason": "length"}
        content = json.dumps({**envelope, "choices": [choice], "usage": usage}).encode()
        content_type = b"application/json"
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(content))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": content})


@contextmanager
def gateway_process(config_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The gateway served from `config_path` in a child process, from the moment it answers until the
    block ends (started as `tether gateway serve` does, without importing the whole CLI)."""
    port = free_port()
    command = (
        "import sys; from pathlib import Path; from tether.gateway import load_gateway_config, serve_gateway;"
        " serve_gateway(load_gateway_config(Path(sys.argv[1])), '127.0.0.1', int(sys.argv[2]), 'warning')"
    )
    log = config_path.with_name(f"gateway-{port}.log")
    with log.open("wb") as stderr:
        child = subprocess.Popen([sys.executable, "-c", command, str(config_path), str(port)], stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert child.poll() is None, log.read_text()
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.05)
        yield url, child
    finally:
        child.kill()
        child.wait()


async def post(url: str, body: dict[str, Any], secret: str) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection (`Connection: close`), read to the server's end of it: status,
    headers and the body as the client received it, de-chunked. A response the server did not finish
    raises `ConnectionError`. Plain streams rather than an HTTP client: it sees a response within a
    millisecond or so of the gateway sending it, so the kill lands while the last answers are fresh."""
    host, port = url.removeprefix("http://").split(":")
    content = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {secret}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + content)
        raw = await reader.read(-1)
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    if not head:
        raise ConnectionError("no response")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "content-length" in headers:
        if len(rest) != int(headers["content-length"]):
            raise ConnectionError("the body ended early")
        return int(lines[0].split()[1]), headers, rest
    body_parts = []
    while True:  # chunked
        size_line, _, rest = rest.partition(b"\r\n")
        if not size_line:
            raise ConnectionError("the chunked body ended early")
        size = int(size_line, 16)
        if size == 0:
            return int(lines[0].split()[1]), headers, b"".join(body_parts)
        body_parts.append(rest[:size])
        rest = rest[size + 2 :]


class Race:
    """Clients sending until the budget refuses them, through whichever gateway is up."""

    def __init__(self, url: str, secret: str, kill: Any) -> None:
        self.url, self.secret, self.kill = url, secret, kill
        self.first_url = url
        self.killed_at = float("inf")
        self.received: dict[str, Usage] = {}
        self.cut_short = 0
        self.after_restart = 0
        self.restarted = asyncio.Event()

    async def client(self, number: int) -> None:
        stream = number % 3 == 0
        body: dict[str, Any] = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        while True:
            url = self.url
            try:
                got = await self.send(url, body)
            except ConnectionError:  # refused, reset, or cut short: OSError subclasses all
                assert url == self.first_url, f"a request failed against the restarted gateway {url}"
                self.cut_short += 1
                await self.restarted.wait()
                continue
            if got is None:
                return
            request_id, usage = got
            self.received[request_id] = usage
            self.after_restart += self.restarted.is_set()
            if len(self.received) == KILL_AFTER:
                self.killed_at = time.time()
                self.kill()

    async def send(self, url: str, body: dict[str, Any]) -> tuple[str, Usage] | None:
        """The request id and usage of a response received whole; None once the budget refuses."""
        status, headers, content = await post(url, body, self.secret)
        if status != 200:
            code = json.loads(content)["error"]["code"]
            assert code in BUDGET_CODES, content
            return None
        request_id = headers["x-tether-request-id"]
        if not body["stream"]:
            return request_id, Usage.from_openai(json.loads(content)["usage"])
        events = [e.removeprefix(b"data: ") for e in content.split(b"\n\n") if e]
        if events[-1] != b"[DONE]":  # an unfinished stream was not received
            raise ConnectionError("the stream ended before [DONE]")
        return request_id, Usage.from_openai(json.loads(events[-2])["usage"])


def ledger_rows(config: GatewayConfig) -> dict[str, tuple[Usage, Decimal, float]]:
    """Request id -> (usage, cost, time charged) of every row in the ledger."""
    _, ledger = open_stores(config)
    c = ledger.rows.c
    query = sa.select(c.request_id, c.prompt_tokens, c.cached_tokens, c.completion_tokens, c.cost_pusd, c.at)
    with ledger.engine.connect() as conn:
        rows = {
            str(rid): (Usage(int(p), int(h), int(o)), Decimal(int(pico)) / PICO_PER_USD, float(at))
            for rid, p, h, o, pico, at in conn.execute(query)
        }
    ledger.engine.dispose()
    return rows


async def test_a_killed_gateway_billed_every_answer_its_clients_received_and_kept_the_budget(
    ledger_url: str, tmp_path: Path
) -> None:
    with live_server(fake_engine) as upstream:
        pool = {"max_in_flight": CLIENTS, "send_priority": False}
        config = make_config(upstream, ledger_url, model=MODEL, pool=pool, key_cache_s=60.0)
        config_path = tmp_path / "gateway.json"
        config_path.write_text(config.model_dump_json())
        keys, _ = open_stores(config)
        secret, _ = keys.create("acme", Tier.STANDARD, Limits(budget_usd=BUDGET, budget_period_s=3600))
        keys.engine.dispose()
        try:
            with gateway_process(config_path) as (url, first):
                race = Race(url, secret, lambda: os.kill(first.pid, signal.SIGKILL))
                clients = [asyncio.create_task(race.client(i)) for i in range(CLIENTS)]
                await asyncio.to_thread(first.wait, 60)
                # the clients in flight at the kill are waiting for the restarted gateway
                with gateway_process(config_path) as (race.url, _):
                    race.restarted.set()
                    await asyncio.gather(*clients)
            rows = ledger_rows(config)
        finally:
            drop_tables(config)
    assert race.cut_short > 0 and race.after_restart > 0  # the kill was mid-race, and the race went on
    billed = {rid: usage for rid, (usage, _, _) in rows.items()}
    assert {rid: billed.get(rid) for rid in race.received} == race.received  # every answer, exactly
    # beyond them only requests the kill cut short after their charge was committed: they ran upstream,
    # and no server can know whether its last bytes arrived before it died
    unreceived = [at for rid, (_, _, at) in rows.items() if rid not in race.received]
    assert len(unreceived) <= race.cut_short and all(at <= race.killed_at for at in unreceived)
    assert all(cost == expected_cost(usage, Tier.STANDARD) for usage, cost, _ in rows.values())
    assert sum(cost for _, cost, _ in rows.values()) <= BUDGET


async def test_a_request_whose_charge_cannot_be_recorded_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with live_server(fake_engine) as upstream:
        async with serve(make_config(upstream, f"sqlite:///{tmp_path / 'ledger.db'}", model=MODEL)) as served:
            secret = served.key(budget_usd="1")
            ledger = served.gateway.ledger
            record = ledger.record

            def charges_fail(
                charges: Sequence[Charge],
                reserved: Sequence[Reservation] = (),
                released: Sequence[str] = (),
                refused: Sequence[Refused] = (),
            ) -> None:
                if charges:
                    raise OSError("disk full")
                record(charges, reserved, released, refused)

            monkeypatch.setattr(ledger, "record", charges_fail)
            served.gateway.writer.backoff_s = 0
            headers = {"Authorization": f"Bearer {secret}"}
            body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}
            whole = await served.http.post("/v1/completions", json=body, headers=headers)
            assert whole.status_code == 503 and whole.json()["error"]["code"] == "ledger_unavailable"
            assert "choices" not in whole.json()
            stream = await served.http.post("/v1/completions", json={**body, "stream": True}, headers=headers)
            events = [e.removeprefix(b"data: ") for e in stream.content.split(b"\n\n") if e]
            assert b"[DONE]" not in events
            assert json.loads(events[-1])["error"]["code"] == "ledger_unavailable"
            assert ledger.report("acme", since=0) == []
            # both ran upstream: their worst case stays reserved, in the limits and in the ledger
            assert [r.spend_nano_usd for r in ledger.open_reservations(since=0)] == [13_100, 13_100]


async def test_reservations_a_crash_left_open_count_at_their_worst_case_after_a_restart(
    tmp_path: Path,
) -> None:
    config = make_config("http://127.0.0.1:9", f"sqlite:///{tmp_path / 'ledger.db'}", model=MODEL)
    keys, ledger = open_stores(config)
    _, key = keys.create("acme", Tier.STANDARD, Limits(budget_usd=BUDGET, tokens_per_window=1000))
    ledger.record([], reserved=[Reservation("cut-short", time.time(), "acme", key.key_id, 3, 13_100)])
    keys.engine.dispose()
    restarted = build_gateway(config)
    try:
        logs = restarted.limits.core.logs  # type: ignore[attr-defined]
        assert logs[f"key:{key.key_id}:spend"].total == 13_100 and logs[f"key:{key.key_id}:tokens"].total == 3
    finally:
        await restarted.aclose()
