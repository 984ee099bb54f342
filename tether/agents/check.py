"""A task's success check: run its command and its hidden test suite in the task's workdir when the task
ends, and say how it went.

The suite goes through the code harness (`tether.envs.code.runner.run_suite`): the workdir's modules are
imported only in a child process that answers calls with plain data, while the trusted tests and the
report (framed with a nonce the child never sees) stay in the parent, so a package that prints a fake
tally, exits early or monkeypatches the tests gains nothing.

The outcome is journaled with the task's end as one line of its result (or error), `check: {json}`, so
`tether agent show` prints it and `CheckOutcome.find` reads it back (the RL rollouts reward it). The
check runs in the task's own session, after the last step: what it sees is what the agent left.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tether.agents.task import CheckSpec, SuiteCheck, TaskSpec
from tether.envs.code.runner import run_suite
from tether.sandbox.result import RunStatus
from tether.sandbox.spec import SandboxSpec
from tether.tools.workspace import SandboxWorkspace

if TYPE_CHECKING:
    from tether.sandbox.interface import Session

_LINE = "check: "
_TALLY = re.compile(r"^checks: (\d+)/(\d+)$")
OUTPUT_CHARS = 400  # of the check's output kept in the journal


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    passed: bool
    exit_code: int | None
    fraction: float  # of its checks that passed (the command's tally, or 1/0 from its exit code; each test)
    output: str  # the end of its stdout and stderr

    def line(self) -> str:
        return _LINE + json.dumps(asdict(self), sort_keys=True)

    def describe(self) -> str:
        verdict = "passed" if self.passed else "failed"
        return f"{verdict} (exit status {self.exit_code}, {self.fraction:.0%} of its checks)"

    @classmethod
    def find(cls, text: str | None) -> CheckOutcome | None:
        """The outcome journaled in a task's result or error, if its check ran."""
        for line in reversed((text or "").splitlines()):
            if line.startswith(_LINE):
                return cls(**json.loads(line[len(_LINE) :]))
        return None


def without_outcome(text: str | None) -> str:
    """A task's result or error as the agent or the runner wrote it, the check's line left out."""
    return "\n".join(line for line in (text or "").splitlines() if not line.startswith(_LINE))


def with_outcome(text: str | None, outcome: CheckOutcome | None) -> str | None:
    """A task's result or error with the check's outcome appended as its last line."""
    if outcome is None:
        return text
    return f"{text}\n{outcome.line()}" if text else outcome.line()


def _counts(stdout: str) -> tuple[int, int] | None:
    lines = stdout.strip().splitlines()
    found = _TALLY.match(lines[-1].strip()) if lines else None
    if found is None or int(found[2]) == 0:
        return None
    return min(int(found[1]), int(found[2])), int(found[2])


def tally(stdout: str) -> float | None:
    """K/N from a last stdout line `checks: K/N`, if the check printed one."""
    counts = _counts(stdout)
    return None if counts is None else counts[0] / counts[1]


@dataclass(frozen=True, slots=True)
class _Part:
    passed: bool
    exit_code: int | None  # the command's; a suite's as a checker's would be (0 iff every test passed)
    counts: tuple[int, int]  # (checks passed, checks)
    output: str


async def _run_command(workspace: SandboxWorkspace, limits: SandboxSpec, command: str) -> _Part:
    result = await workspace.run(command, "bash", spec=limits)
    passed = result.status is RunStatus.OK and result.exit_code == 0
    counts = _counts(result.stdout) or (int(passed), 1)
    return _Part(passed, result.exit_code, counts, result.stdout + result.stderr)


async def _run_suite(workspace: SandboxWorkspace, limits: SandboxSpec, suite: SuiteCheck) -> _Part:
    results = await run_suite(workspace, suite.imports, suite.tests, spec=limits)
    failed = sorted(name for name, ok in results.items() if not ok)
    lines = [f"failed: {name}" for name in failed[:10]] or (
        [] if results else ["the hidden test suite did not run"]
    )
    passed = bool(results) and not failed
    counts = (len(results) - len(failed), len(results)) if results else (0, 1)
    return _Part(passed, 0 if passed else 1, counts, "".join(line + "\n" for line in lines))


async def run_check(
    session: Session, spec: TaskSpec, check: CheckSpec, infra_errors: bool = False
) -> CheckOutcome:
    """The command's outcome and the suite's, combined: it passes if both do; each check counts once.
    `infra_errors`: a run the sandbox failed raises `InfraError` instead of failing the check (training)."""
    limits = spec.sandbox.model_copy(update={"timeout_s": check.timeout_s})
    workspace = SandboxWorkspace(session, infra_errors=infra_errors)
    parts = []
    if check.command is not None:
        parts.append(await _run_command(workspace, limits, check.command))
    if check.suite is not None:
        parts.append(await _run_suite(workspace, limits, check.suite))
    passed_checks = sum(part.counts[0] for part in parts)
    checks = sum(part.counts[1] for part in parts)
    return CheckOutcome(
        passed=all(part.passed for part in parts),
        exit_code=parts[0].exit_code,
        fraction=passed_checks / checks,
        output="".join(part.output for part in parts)[-OUTPUT_CHARS:],
    )
