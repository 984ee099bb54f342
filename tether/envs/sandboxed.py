"""Shared helpers for running answers and graders in the sandbox and reading their results back safely.

A sandboxed program reports on stdout, which the code under test can usually write to as well; so
every report line carries a per-run nonce and is parsed strictly. Trusted Python that runs inside an
episode's session (graders, checksums) starts with `TRUSTED_PRELUDE`, so that a module the model
planted in the working directory (`json.py`, `hashlib.py`) is never imported in its place. Nothing
here executes model output in this process.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from tether.envs.context import ScoringContext
from tether.envs.errors import EnvError
from tether.envs.scoring import EpisodeState
from tether.sandbox.result import RunResult, RunStatus
from tether.sandbox.spec import SandboxSpec

# Drops the model-writable working directory from the import path: it is the current directory, and the
# script's own directory too except in a session, whose programs the sandbox keeps outside it.
TRUSTED_PRELUDE = (
    "import os as _os, sys as _sys\n"
    "_here = _os.path.dirname(_os.path.abspath(__file__))\n"
    "_sys.path[:] = [p for p in _sys.path if p not in ('', '.', _here, _os.getcwd())]\n"
)


def new_nonce() -> str:
    """An unguessable tag for one run's report lines (not replayed, so not taken from the task seed)."""
    return secrets.token_hex(16)


def framed_lines(stdout: str, nonce: str) -> list[str]:
    """The payloads of the lines that start with `nonce `, in order; every other line is ignored."""
    prefix = nonce + " "
    return [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]


@dataclass(frozen=True, slots=True)
class Report:
    """A trusted program's JSON report, or why none could be read."""

    data: dict[str, Any] | None
    error: str | None = None
    status: RunStatus = RunStatus.OK


def read_report(result: RunResult, nonce: str) -> Report:
    """Exactly one framed JSON object from a run that exited cleanly; anything else is an error."""
    if result.status is not RunStatus.OK:
        detail = (result.error or result.stderr or "")[-300:]
        return Report(None, f"grader run ended with {result.status.value}: {detail}", result.status)
    lines = framed_lines(result.stdout, nonce)
    if len(lines) != 1:
        return Report(None, f"expected one report line, found {len(lines)}", result.status)
    try:
        data = json.loads(lines[0])
    except json.JSONDecodeError as error:
        return Report(None, f"malformed report: {error}", result.status)
    if not isinstance(data, dict):
        return Report(None, "the report is not a JSON object", result.status)
    return Report(data)


def trusted_program(body: str, nonce: str) -> str:
    """`body` (which must call `report(obj)` once) as a program immune to planted modules."""
    return (
        TRUSTED_PRELUDE
        + "import json as _json\n"
        + f"_NONCE = {nonce!r}\n"
        + "def report(obj):\n"
        + "    data = (_NONCE + ' ' + _json.dumps(obj) + '\\n').encode()\n"
        + "    while data:\n"
        + "        data = data[_os.write(1, data):]\n"
        + body
    )


async def run_trusted(state: EpisodeState, body: str, stdin: str = "") -> Report:
    """Run trusted Python in the episode's session (seeing the files the model left) and read its report."""
    nonce = new_nonce()
    result = await state.run(trusted_program(body, nonce), "python", stdin=stdin)
    return read_report(result, nonce)


async def run_trusted_fresh(ctx: ScoringContext, body: str, stdin: str = "", **kwargs: Any) -> Report:
    """Run trusted Python in a fresh, single-use sandbox run (files given as `files=`)."""
    nonce = new_nonce()
    result = await ctx.run(trusted_program(body, nonce), "python", stdin=stdin, **kwargs)
    return read_report(result, nonce)


async def capped_spec(ctx: ScoringContext, timeout_s: float) -> SandboxSpec:
    """The pool's limits with the wall time capped: a looping answer costs seconds, not the pool's default."""
    spec = (await ctx.pool()).spec
    return spec if spec.timeout_s <= timeout_s else spec.model_copy(update={"timeout_s": timeout_s})


def require_str(arguments: dict[str, Any], key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise EnvError(f"argument {key!r} must be a string, got {type(value).__name__}")
    return value
