"""`ScriptedClient`: a `ChatClient` that replays a file of replies, one per step, for tests and demos.

Line `n` answers step `n` (`ChatRequest.step_no`), so a resumed task gets the same reply for the same step
no matter which worker asks or how often. Each line is `{"content": str, "tool_calls": [{"name": str,
"arguments": {...}}]}` (both optional); a step past the end answers "done" with no calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tether.chat import ChatRequest, Completion, FinishReason, ToolCall, Usage, assistant_message
from tether.errors import ConfigError

JsonDict = dict[str, Any]


def _check_line(entry: Any, where: str) -> JsonDict:
    if not isinstance(entry, dict) or not set(entry) <= {"content", "tool_calls"}:
        raise ConfigError(f"{where}: expected an object with 'content' and/or 'tool_calls'")
    if not isinstance(entry.get("content", ""), str):
        raise ConfigError(f"{where}: 'content' must be a string")
    calls: Any = entry.get("tool_calls", [])
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)
        for c in calls
    ):
        raise ConfigError(f"{where}: tool_calls must be a list of {{name, arguments}} objects")
    return entry


class ScriptedClient:
    def __init__(self, replies: list[JsonDict], name: str = "scripted") -> None:
        self.name = name
        self.replies = [_check_line(entry, f"{name} reply {i}") for i, entry in enumerate(replies)]

    @classmethod
    def from_file(cls, path: Path) -> ScriptedClient:
        if not path.is_file():
            raise ConfigError(f"scripted model file {str(path)!r} does not exist")
        replies = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                replies.append(_check_line(json.loads(line), f"{path}:{number}"))
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not a JSON object: {error}") from None
        return cls(replies, f"scripted:{path}")

    async def complete(self, request: ChatRequest) -> Completion:
        step = request.step_no
        entry: JsonDict = self.replies[step] if step < len(self.replies) else {"content": "done"}
        calls = [
            ToolCall(f"call_{step}_{index}", call["name"], json.dumps(call.get("arguments", {})))
            for index, call in enumerate(entry.get("tool_calls", []))
        ]
        message = assistant_message(entry.get("content", ""), calls)
        prompt_chars = sum(len(str(m.get("content") or "")) for m in request.messages)
        # A stand-in for tokens that is deterministic and roughly proportional (4 characters a token).
        usage = Usage(prompt_tokens=prompt_chars // 4, completion_tokens=len(json.dumps(message)) // 4)
        return Completion(message, usage, FinishReason.TOOL_CALLS if calls else FinishReason.STOP)

    async def close(self) -> None:
        return None
