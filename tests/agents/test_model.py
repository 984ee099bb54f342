"""Model adapters: the scripted replay, text tool-call parsing, and the OpenAI-compatible client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tether.agents.model import (
    ModelError,
    ModelRequest,
    OpenAIChatModel,
    ScriptedModel,
    open_model,
    parse_text_tool_calls,
)
from tether.errors import ConfigError


def request(step_no: int) -> ModelRequest:
    return ModelRequest([{"role": "user", "content": "hi"}], [], step_no, 64)


async def test_scripted_model_answers_by_step_number_not_by_call_count(tmp_path: Path) -> None:
    script = tmp_path / "s.jsonl"
    script.write_text(
        '{"content": "zero"}\n\n{"tool_calls": [{"name": "shell", "arguments": {"command": "ls"}}]}\n'
    )
    model = ScriptedModel(script)
    second = await model.complete(request(1))
    assert second.message["tool_calls"][0]["id"] == "call_1_0"
    assert json.loads(second.message["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
    assert (await model.complete(request(0))).message["content"] == "zero"
    assert await model.complete(request(1)) == second  # replay gives the same reply
    assert (await model.complete(request(9))).message == {"role": "assistant", "content": "done"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "s.jsonl:1: not a JSON object"),
        ('{"text": "x"}', "expected an object with 'content' and/or 'tool_calls'"),
        ('{"tool_calls": [{"arguments": {}}]}', "tool_calls must be a list of {name, arguments}"),
        ('{"tool_calls": {"name": "x"}}', "tool_calls must be a list"),
    ],
)
def test_bad_script_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    script = tmp_path / "s.jsonl"
    script.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        ScriptedModel(script)


@pytest.mark.parametrize(
    ("model", "base_url", "message"),
    [
        ("scripted:/no/such/file.jsonl", None, "does not exist"),
        ("scripted:x.jsonl", "http://h/v1", "do not also give --base-url"),
        (None, None, "no model"),
        ("m", "ftp://h", "expected http"),
    ],
)
def test_bad_model_choices_are_explained(
    model: str | None, base_url: str | None, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        open_model(model, base_url, tmp_path)


def test_fenced_blocks_and_finish_lines_become_tool_calls() -> None:
    text = "Plan:\n```bash\necho hi > a.txt\n```\nthen\n```python\nprint(1)\n```\nFINISH: wrote it\n"
    calls = parse_text_tool_calls(text, 3)
    assert [c["function"]["name"] for c in calls] == ["bash", "python", "finish"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "echo hi > a.txt\n"}
    assert [c["id"] for c in calls] == ["call_3_0", "call_3_1", "call_3_2"]
    assert parse_text_tool_calls("no tools here", 0) == []


async def test_openai_client_sends_plain_turns_and_parses_the_reply() -> None:
    seen: list[dict] = []  # type: ignore[type-arg]

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        reply = {"role": "assistant", "content": "```bash\nls\n```"}
        return httpx.Response(
            200, json={"choices": [{"message": reply}], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
        )

    model = OpenAIChatModel("http://server/v1", "m", transport=httpx.MockTransport(handler))
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
        {"role": "tool", "tool_call_id": "c", "name": "shell", "content": "out"},
    ]
    reply = await model.complete(ModelRequest(messages, [], 2, 32))
    await model.close()
    sent = seen[0]["messages"]
    assert sent[0]["content"].startswith("sys") and "```bash" in sent[0]["content"]
    assert sent[2] == {"role": "user", "content": "Output of shell:\nout"}
    assert all(set(m) == {"role", "content"} for m in sent)
    assert reply.message["tool_calls"][0]["function"]["name"] == "bash"
    assert reply.usage == {"prompt_tokens": 7, "completion_tokens": 3}


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [(503, {"error": "busy"}, "HTTP 503"), (200, {"choices": []}, "not a chat completion")],
)
async def test_openai_client_failures_raise_model_errors(status: int, body: object, message: str) -> None:
    transport = httpx.MockTransport(lambda _: httpx.Response(status, json=body))
    model = OpenAIChatModel("http://server/v1", "m", transport=transport)
    with pytest.raises(ModelError, match=message):
        await model.complete(request(0))
    await model.close()
