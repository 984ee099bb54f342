"""Models an agent can drive: any OpenAI-compatible chat endpoint, or a scripted replay for tests and demos.

A model turns messages (OpenAI chat format) and tool schemas into one assistant message plus usage.
`ScriptedModel` answers step `n` with line `n` of its file, so a resumed task gets the same reply for
the same step no matter which worker asks or how often. Endpoints without native tool calling (our
engine's server) get the tools described in text and their replies parsed for fenced code blocks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from tether.errors import ConfigError, TetherError

JsonDict = dict[str, Any]


class ModelError(TetherError):
    """The model endpoint failed or answered something that is not a chat completion."""


@dataclass(frozen=True, slots=True)
class ModelRequest:
    messages: list[JsonDict]
    tools: list[JsonDict]  # OpenAI function-tool schemas
    step_no: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class ModelReply:
    message: JsonDict  # {"role": "assistant", "content": ..., "tool_calls": [...]}
    usage: JsonDict = field(default_factory=dict)


class ChatModel(Protocol):
    name: str

    async def complete(self, request: ModelRequest) -> ModelReply: ...

    async def close(self) -> None: ...


def tool_call(call_id: str, name: str, arguments: JsonDict) -> JsonDict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


class ScriptedModel:
    """Replays `{"content": str, "tool_calls": [{"name": str, "arguments": {...}}]}` lines, one per step."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ConfigError(f"scripted model file {str(path)!r} does not exist")
        self.name = f"scripted:{path}"
        self.lines: list[JsonDict] = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not a JSON object: {error}") from None
            if not isinstance(entry, dict) or not set(entry) <= {"content", "tool_calls"}:
                raise ConfigError(f"{path}:{number}: expected an object with 'content' and/or 'tool_calls'")
            calls: Any = entry.get("tool_calls", [])
            if not isinstance(calls, list) or not all(
                isinstance(c, dict)
                and isinstance(c.get("name"), str)
                and isinstance(c.get("arguments", {}), dict)
                for c in calls
            ):
                raise ConfigError(
                    f"{path}:{number}: tool_calls must be a list of {{name, arguments}} objects"
                )
            self.lines.append(entry)

    async def complete(self, request: ModelRequest) -> ModelReply:
        entry: JsonDict = (
            self.lines[request.step_no] if request.step_no < len(self.lines) else {"content": "done"}
        )
        message: JsonDict = {"role": "assistant", "content": entry.get("content", "")}
        calls: list[JsonDict] = entry.get("tool_calls", [])
        if calls:
            message["tool_calls"] = [
                tool_call(f"call_{request.step_no}_{index}", call["name"], call.get("arguments", {}))
                for index, call in enumerate(calls)
            ]
        prompt_chars = sum(len(str(m.get("content") or "")) for m in request.messages)
        completion_chars = len(json.dumps(message))
        # A stand-in for tokens that is deterministic and roughly proportional (4 characters a token).
        usage = {"prompt_tokens": prompt_chars // 4, "completion_tokens": completion_chars // 4}
        return ModelReply(message, usage)

    async def close(self) -> None:
        return None


_FENCE = re.compile(r"```(bash|sh|python|py)\s*\n(.*?)```", re.DOTALL)
_LANGUAGE_TOOL = {"bash": "bash", "sh": "bash", "python": "python", "py": "python"}


def parse_text_tool_calls(content: str, step_no: int) -> list[JsonDict]:
    """Fenced ```bash / ```python blocks become tool calls; a line `FINISH: summary` ends the task."""
    calls = [
        tool_call(
            f"call_{step_no}_{index}",
            _LANGUAGE_TOOL[match.group(1)],
            {"command" if _LANGUAGE_TOOL[match.group(1)] == "bash" else "code": match.group(2)},
        )
        for index, match in enumerate(_FENCE.finditer(content))
    ]
    finish = re.search(r"^FINISH:\s*(.*)$", content, re.MULTILINE)
    if finish:
        calls.append(tool_call(f"call_{step_no}_{len(calls)}", "finish", {"summary": finish.group(1)}))
    return calls


def _as_plain_text(messages: list[JsonDict]) -> list[JsonDict]:
    """Tool calls and results as ordinary turns, for servers that accept only role + content."""
    plain: list[JsonDict] = []
    for message in messages:
        if message["role"] == "tool":
            plain.append(
                {"role": "user", "content": f"Output of {message.get('name', 'tool')}:\n{message['content']}"}
            )
        elif message["role"] == "assistant":
            plain.append({"role": "assistant", "content": message.get("content") or ""})
        else:
            plain.append({"role": message["role"], "content": message.get("content") or ""})
    return plain


TEXT_TOOLS_HINT = (
    "\n\nTo run a shell command, reply with a fenced block ```bash\n<command>\n```; to run Python, a "
    "```python block. When done, write a line `FINISH: <summary>`."
)


class OpenAIChatModel:
    """POST /chat/completions on an OpenAI-compatible server (`tether serve`, vLLM, OpenAI, ...)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        native_tools: bool = False,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base url {base_url!r}: expected http(s)://HOST[:PORT]/v1")
        self.name = model
        self.native_tools = native_tools
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers, transport=transport
        )

    async def complete(self, request: ModelRequest) -> ModelReply:
        body: JsonDict = {"model": self.name, "max_tokens": request.max_tokens, "temperature": 0.0}
        if self.native_tools:
            body["messages"] = request.messages
            body["tools"] = request.tools
        else:
            messages = _as_plain_text(request.messages)
            if messages and messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": messages[0]["content"] + TEXT_TOOLS_HINT}
            body["messages"] = messages
        try:
            response = await self._client.post("/chat/completions", json=body)
        except httpx.HTTPError as error:
            raise ModelError(f"model endpoint {self._client.base_url}: {error!r}") from error
        if response.status_code != 200:
            raise ModelError(f"model endpoint answered HTTP {response.status_code}: {response.text[:500]}")
        try:
            payload = response.json()
            message = dict(payload["choices"][0]["message"])
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise ModelError(
                f"model endpoint answered something that is not a chat completion: {error!r}"
            ) from None
        message = {
            "role": "assistant",
            "content": message.get("content") or "",
            **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {}),
        }
        if not self.native_tools:
            calls = parse_text_tool_calls(message["content"], request.step_no)
            if calls:
                message["tool_calls"] = calls
        usage = payload.get("usage") or {}
        return ModelReply(message, {k: int(usage.get(k, 0)) for k in ("prompt_tokens", "completion_tokens")})

    async def close(self) -> None:
        await self._client.aclose()


def open_model(
    model: str | None,
    base_url: str | None,
    cache_dir: Path,
    native_tools: bool = False,
    device: str = "auto",
    dtype: str = "float32",
) -> ChatModel:
    """`scripted:FILE`, a server at `base_url` (model names what to ask it for), or an engine in process
    on `device` in `dtype` (`tether.models.precision`; the other two ignore them)."""
    if model and model.startswith("scripted:"):
        if base_url:
            raise ConfigError("--model scripted:FILE replays a file; do not also give --base-url")
        return ScriptedModel(Path(model[len("scripted:") :]))
    if base_url:
        return OpenAIChatModel(base_url, model or "default", native_tools=native_tools)
    if not model:
        raise ConfigError("no model: give --model NAME, --model scripted:FILE or --base-url URL")
    from tether.agents.engine_model import EngineModel

    return EngineModel(model, cache_dir, device=device, dtype=dtype)
