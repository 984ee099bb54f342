"""The chat playground against a real served model (a tiny random Qwen3 behind `tether serve`'s app on a
socket): models listed, replies streamed turn by turn, and a model server's refusals shown in the reply."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.live_server import free_port, live_server
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.engine.async_engine import AsyncEngine
from tether.engine.llm_engine import LLMEngine
from tether.serving.app import create_app as create_serving_app
from tether.testing import make_tiny_model

MODEL = "tiny-qwen3"
HX = {"HX-Request": "true"}


@pytest.fixture(scope="module")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FastAPI]]:
    """The tiny model served as `tether serve` serves it, behind a real uvicorn: the `/v1` base URL, and
    the app (whose metrics count aborted requests)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", seed=0)
    engine, tokenizer = LLMEngine.from_pretrained(folder, kv_cache_mib=4, max_model_len=256)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        app = create_serving_app(async_engine, tokenizer, MODEL)
        with live_server(app) as url:
            yield f"{url}/v1", app
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="module")
def model_url(served_model: tuple[str, FastAPI]) -> str:
    return served_model[0]


def _aborted(app: FastAPI) -> float:
    registry = app.state.server.metrics.registry
    return float(registry.get_sample_value("tether_requests_total", {"status": "aborted"}) or 0)


def _client(*urls: str) -> TestClient:
    return TestClient(create_app(ConsoleConfig(runs=(), model_urls=urls)))


def _turn(client: TestClient, message: str, model: str = f"0|{MODEL}", conversation: str = "") -> str:
    form = {"message": message, "model": model, "max_tokens": "8", "temperature": "0"}
    answer = client.post("/playground/turns", data={**form, "conversation": conversation}, headers=HX)
    assert answer.status_code == 200, answer.text
    return answer.text


def _stream(client: TestClient, fragment: str) -> list[tuple[str, str]]:
    """The events of the reply stream the turn's fragment connects to: (event, data) pairs."""
    found = re.search(r'sse-connect="([^"]+)"', fragment)
    assert found is not None, fragment
    with client.stream("GET", found.group(1)) as answer:
        assert answer.status_code == 200
        body = "".join(answer.iter_text())
    events = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        lines = block.split("\n")
        kind = next((line[7:] for line in lines if line.startswith("event: ")), "")
        data = "\n".join(line[6:] for line in lines if line.startswith("data: "))
        if kind:
            events.append((kind, data))
    return events


def _conversation(fragment: str) -> str:
    found = re.search(r'name="conversation" value="([0-9a-f]+)"', fragment)
    assert found is not None
    return found.group(1)


def test_the_page_lists_each_servers_models_and_says_which_do_not_answer(model_url: str) -> None:
    down = f"http://127.0.0.1:{free_port()}/v1"
    with _client(model_url, down) as client:
        page = client.get("/playground")
        assert page.status_code == 200
        assert f'value="0|{MODEL}"' in page.text
        assert f"no server answers at {down}/models" in page.text
        servers = client.get("/api/playground/models").json()["servers"]
        assert servers[0]["models"] == [MODEL] and servers[1]["problem"].startswith("no server answers")


def test_a_reply_streams_in_pieces_and_the_conversation_goes_on(model_url: str) -> None:
    with _client(model_url) as client:
        first = _turn(client, "hello")
        events = _stream(client, first)
        tokens = [data for kind, data in events if kind == "token"]
        assert len(tokens) >= 2 and events[-1][0] == "end"
        assert "chat-error" not in "".join(tokens)
        conversation = _conversation(first)
        second = _turn(client, "and then?", conversation=conversation)
        assert _conversation(second) == conversation
        assert _stream(client, second)[-1][0] == "end"
        # a reply streams once; a stream asked for again is a 404, not a second reply
        again = re.search(r'sse-connect="([^"]+)"', second)
        assert again is not None and client.get(again.group(1)).status_code == 404


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("0|no-such-model", "answered HTTP 404"),
        ("1|anything", "no server answers at"),
    ],
)
def test_a_model_servers_refusal_or_absence_shows_in_the_reply(model_url: str, model: str, says: str) -> None:
    down = f"http://127.0.0.1:{free_port()}/v1"
    with _client(model_url, down) as client:
        events = _stream(client, _turn(client, "hi", model=model))
        assert events[0][0] == "token" and 'class="chat-error"' in events[0][1] and says in events[0][1]
        assert events[-1][0] == "end"


def test_a_reply_stops_upstream_when_the_page_goes(served_model: tuple[str, FastAPI]) -> None:
    url, app = served_model
    before = _aborted(app)
    with live_server(create_app(ConsoleConfig(runs=(), model_urls=(url,)))) as console:
        form = {"message": "go on", "model": f"0|{MODEL}", "max_tokens": "230", "temperature": "1"}
        fragment = httpx.post(f"{console}/playground/turns", data=form, headers=HX).text
        found = re.search(r'sse-connect="([^"]+)"', fragment)
        assert found is not None
        with httpx.stream("GET", f"{console}{found.group(1)}", timeout=30) as answer:
            next(line for line in answer.iter_lines() if line.startswith("event: token"))
        # the page went away after the first token: the console closes its stream to the model server
        deadline = time.monotonic() + 20
        while _aborted(app) == before:
            assert time.monotonic() < deadline, "the model server kept generating for a page that left"
            time.sleep(0.05)


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ({"model": f"0|{MODEL}"}, "message"),
        ({"message": "   ", "model": f"0|{MODEL}"}, "message"),
        ({"message": "hi", "model": "7|x"}, "model"),
        ({"message": "hi", "model": "zero|x"}, "model"),
        ({"message": "hi", "model": f"0|{MODEL}", "temperature": "9"}, "temperature"),
        ({"message": "hi", "model": f"0|{MODEL}", "max_tokens": "0"}, "max_tokens"),
        ({"message": "hi", "model": f"0|{MODEL}", "conversation": "feedbeef"}, "conversation"),
    ],
)
def test_a_malformed_turn_is_a_clear_flash_not_a_traceback(form: dict[str, str], param: str) -> None:
    with _client("http://127.0.0.1:9/v1") as client:
        answer = client.post("/playground/turns", data=form, headers=HX)
        assert 400 <= answer.status_code < 500 and answer.headers["HX-Retarget"] == "#flash"
        assert param in answer.text and "Traceback" not in answer.text


def test_a_turn_without_the_consoles_header_is_refused() -> None:
    with _client("http://127.0.0.1:9/v1") as client:
        assert client.post("/playground/turns", data={"message": "hi", "model": "0|m"}).status_code == 403


def test_without_model_servers_the_page_says_how_to_add_one() -> None:
    with _client() as client:
        page = client.get("/playground")
        assert page.status_code == 409 and "--model-url" in page.text


def test_a_message_typed_in_chromium_gets_a_streamed_reply(model_url: str, page: object, shots: Path) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    with live_server(create_app(ConsoleConfig(runs=(), model_urls=(model_url,)))) as url:
        page.goto(f"{url}/playground")
        page.fill("textarea[name=system]", "You are terse.")
        page.fill("input[name=max_tokens]", "12")
        for number, message in enumerate(("Hello there", "Tell me more"), start=1):
            page.fill("textarea[name=message]", message)
            page.click("button[type=submit]")
            replies = page.locator('.chat-message[data-role="assistant"]')
            expect(replies).to_have_count(number)
            expect(replies.nth(number - 1).locator(".chat-done")).to_have_count(1, timeout=15_000)
            assert replies.nth(number - 1).inner_text().strip()
            expect(page.locator('.chat-message[data-role="user"]').nth(number - 1)).to_have_text(message)
            expect(page.locator("textarea[name=message]")).to_have_value("")
        assert page.locator(".chat-error").count() == 0
        page.screenshot(path=shots / "playground.png", full_page=True)
