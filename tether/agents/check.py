"""A task's success check: run its command in the task's workdir when the task ends, and say how it went.

The outcome is journaled with the task's end as one line of its result (or error), `check: {json}`, so
`tether agent show` prints it and `CheckOutcome.find` reads it back (the RL rollouts reward it). The
check runs in the task's own session, after the last step: what it sees is what the agent left.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tether.agents.task import CheckSpec, TaskSpec
from tether.sandbox.result import RunStatus

if TYPE_CHECKING:
    from tether.sandbox.session import SandboxSession

_LINE = "check: "
_TALLY = re.compile(r"^checks: (\d+)/(\d+)$")
OUTPUT_CHARS = 400  # of the check's output kept in the journal


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    passed: bool
    exit_code: int | None
    fraction: float  # of the check's own checks that passed (1.0/0.0 from the exit code without a tally)
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


def tally(stdout: str) -> float | None:
    """K/N from a last stdout line `checks: K/N`, if the check printed one."""
    lines = stdout.strip().splitlines()
    found = _TALLY.match(lines[-1].strip()) if lines else None
    if found is None or int(found[2]) == 0:
        return None
    return min(1.0, int(found[1]) / int(found[2]))


async def run_check(session: SandboxSession, spec: TaskSpec, check: CheckSpec) -> CheckOutcome:
    limits = spec.sandbox.model_copy(update={"timeout_s": check.timeout_s})
    result = await session.run(check.command, "bash", spec=limits)
    passed = result.status is RunStatus.OK and result.exit_code == 0
    fraction = tally(result.stdout)
    output = (result.stdout + result.stderr)[-OUTPUT_CHARS:]
    return CheckOutcome(
        passed=passed,
        exit_code=result.exit_code,
        fraction=(1.0 if passed else 0.0) if fraction is None else fraction,
        output=output,
    )
