"""Deterministic agent scripts for tests: each step appends its own marker to a log and edits a file."""

from __future__ import annotations

import json
from pathlib import Path

from tether.testing.scripted import ScriptedClient


def effect_step(step_no: int) -> dict[str, object]:
    """A side-effecting step: appending twice would show, so a double execution is visible in the files."""
    return {
        "content": f"step {step_no}",
        "tool_calls": [
            {"name": "shell", "arguments": {"command": f"echo effect-{step_no} >> effects.log"}},
            {
                "name": "write_file",
                "arguments": {"path": f"notes/{step_no % 3}.txt", "content": f"v{step_no}"},
            },
        ],
    }


def write_script(path: Path, steps: int) -> Path:
    lines = [effect_step(step_no) for step_no in range(steps)]
    lines.append({"content": "all done", "tool_calls": [{"name": "finish", "arguments": {"summary": "ok"}}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def expected_effects(steps: int) -> str:
    return "".join(f"effect-{step_no}\n" for step_no in range(steps))


def scripted(path: Path) -> ScriptedClient:
    """The scripted model of `path` (`--model scripted:FILE`)."""
    return ScriptedClient.from_file(path)
