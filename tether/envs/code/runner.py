"""Host side of the Python test harness: build its job, run it in the sandbox, read its frames back.

`run_calls` returns what the candidate's function returned for each input, for the caller to compare
with expectations that never enter the sandbox; `run_check` runs trusted assertion code (HumanEval's
`check`) against the candidate inside the sandbox and returns its verdict. Both go through one
`ScoringContext`; nothing here executes the candidate in this process.
"""

from __future__ import annotations

import json
import marshal
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from tether.envs.code.harness import decode
from tether.envs.context import ScoringContext
from tether.envs.sandboxed import capped_spec, framed_lines, new_nonce
from tether.sandbox.result import RunResult, RunStatus
from tether.sandbox.spec import SandboxSpec
from tether.tools.workspace import Workspace

_MISSING = object()


HARNESS_FILE = "harness.bin"
RUN_TIMEOUT_S = 20.0  # one scoring run; calls have their own, shorter limit and frames survive a kill
# The run's main.py only loads the harness, compiled once here: compiling its source in every run
# cost more CPU than the rest of the run. Same interpreter inside and out, so the bytecode fits.
LOADER = f"import marshal\nexec(marshal.loads(open({HARNESS_FILE!r}, 'rb').read()))\n"


@cache
def harness_source() -> str:
    return resources.files("tether.envs.code").joinpath("harness.py").read_text(encoding="utf-8")


@cache
def harness_bytecode() -> bytes:
    return marshal.dumps(compile(harness_source(), "harness.py", "exec"))


async def run_harness(ctx: ScoringContext, job: dict[str, Any]) -> RunResult:
    stdin = f"{job['mode']}\n{json.dumps(job)}"
    spec = await capped_spec(ctx, RUN_TIMEOUT_S)
    return await ctx.run(LOADER, "python", stdin=stdin, files={HARNESS_FILE: harness_bytecode()}, spec=spec)


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """One call's return value (plain data), or the error that stood in for it."""

    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _outcome(payload: str) -> CallOutcome:
    try:
        reply = json.loads(payload)
    except json.JSONDecodeError as error:
        return CallOutcome(error=f"malformed frame: {error}")
    if not isinstance(reply, dict):
        return CallOutcome(error="malformed frame")
    if "error" in reply:
        return CallOutcome(error=str(reply["error"])[:500])
    value = reply.get("ok", _MISSING)
    if value is _MISSING:
        return CallOutcome(error="malformed frame: no result")
    try:
        return CallOutcome(decode(value))
    except (ValueError, RecursionError) as error:
        return CallOutcome(error=f"malformed result: {error}")


def parse_call_frames(stdout: str, nonce: str, count: int) -> list[CallOutcome]:
    """One outcome per call, in order; a call without exactly one frame counts as failed."""
    frames: dict[int, list[str]] = {}
    for line in framed_lines(stdout, nonce):
        head, _, payload = line.partition(" ")
        if head.isdigit():
            frames.setdefault(int(head), []).append(payload)
    outcomes = []
    for index in range(count):
        found = frames.get(index, [])
        if len(found) != 1:
            outcomes.append(CallOutcome(error="no result" if not found else "duplicate result"))
        else:
            outcomes.append(_outcome(found[0]))
    return outcomes


async def run_calls(
    ctx: ScoringContext,
    source: str,
    entry: str,
    calls: Sequence[Sequence[Any]],
    *,
    setup: str = "",
    call_timeout_s: float = 2.0,
) -> list[CallOutcome]:
    """Call `entry` from `source` on each argument list in the sandbox; arguments must be JSON data."""
    nonce = new_nonce()
    job = {
        "mode": "calls",
        "nonce": nonce,
        "setup": setup,
        "source": source,
        "entry": entry,
        "calls": [list(args) for args in calls],
        "call_timeout_s": call_timeout_s,
    }
    result = await run_harness(ctx, job)
    # Frames written before a crash or timeout of the whole run still count: partial credit survives.
    return parse_call_frames(result.stdout, nonce, len(calls))


@dataclass(frozen=True, slots=True)
class CheckVerdict:
    passed: bool
    error: str | None = None


async def run_check(
    ctx: ScoringContext,
    source: str,
    entry: str,
    test: str,
    *,
    setup: str = "",
    call_timeout_s: float = 3.0,
) -> CheckVerdict:
    """Run trusted `test` code defining `check(candidate)` against the candidate's `entry`."""
    nonce = new_nonce()
    job = {
        "mode": "check",
        "nonce": nonce,
        "setup": setup,
        "source": source,
        "entry": entry,
        "test": test,
        "call_timeout_s": call_timeout_s,
    }
    result = await run_harness(ctx, job)
    frames = [line for line in framed_lines(result.stdout, nonce) if line.startswith("verdict ")]
    if result.status is not RunStatus.OK or len(frames) != 1:
        return CheckVerdict(False, f"harness run ended with {result.status.value}; {len(frames)} verdicts")
    try:
        verdict = json.loads(frames[0].removeprefix("verdict "))
    except json.JSONDecodeError as error:
        return CheckVerdict(False, f"malformed verdict: {error}")
    passed = isinstance(verdict, dict) and verdict.get("passed") is True
    return CheckVerdict(passed, None if passed else str(verdict.get("error"))[:500])


async def run_suite(
    workspace: Workspace,
    imports: str,
    test: str,
    *,
    call_timeout_s: float = 3.0,
    spec: SandboxSpec | None = None,
) -> dict[str, bool]:
    """Run trusted `test_*(m)` functions against the modules the model wrote in `workspace` (an episode's
    session, an agent task's workdir), under `spec` (the session's own limits when None).

    `imports` runs on the candidate's side (e.g. `import inventory`); `m.inventory.parse(...)` in a test
    calls into it through the proxy. Returns each test's outcome; an unreadable run passes nothing.
    """
    nonce = new_nonce()
    job = {
        "mode": "suite",
        "nonce": nonce,
        "setup": "",
        "source": imports,
        "entry": "",
        "test": test,
        "call_timeout_s": call_timeout_s,
    }
    stdin = f"suite\n{json.dumps(job)}"
    files = {HARNESS_FILE: harness_bytecode()}
    result = await workspace.run(LOADER, "python", stdin=stdin, files=files, spec=spec)
    frames = [line for line in framed_lines(result.stdout, nonce) if line.startswith("suite ")]
    if result.status is not RunStatus.OK or len(frames) != 1:
        return {}
    try:
        report = json.loads(frames[0].removeprefix("suite "))
        results = report["results"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return {}
    return (
        {str(name): outcome is True for name, outcome in results.items()} if isinstance(results, dict) else {}
    )
