"""Agent task families: seeded generators of `TaskSpec`s (goal, files, tools, sandbox, success check).

A family is addressed by name (`agent/shell`, `agent/ledger`, `agent/textkit`) wherever a task is:
`tether agent run --family NAME --seed N` hosts one, `tether train` trains on them (`envs.weights`).
The tasks come from the environments' own sources (`tether.envs.shell`, `tether.envs.long_horizon`):
this module only turns a source's problem into a task spec, its expected state into a check (a command
for the files and script runs, the harness's suite for a repository's hidden tests).

Family tasks keep the whole history in context (nothing folded, nothing recalled), so the agent that is
hosted sees exactly the token sequence it was trained on. The check runs in the same sandbox as the
agent, which controls the workdir: the checker runs isolated from the workdir's modules, the hidden tests
run in the harness, out of the candidate's process, and the protected files are verified.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tether.agents.task import (
    DEFAULT_SYSTEM_PROMPT,
    CheckSpec,
    ContextSpec,
    Limits,
    RoleSpec,
    SuiteCheck,
    TaskSpec,
)
from tether.envs.long_horizon.env import TASKS as REPO_TASKS
from tether.envs.long_horizon.env import RepoSource
from tether.envs.shell import TASKS as SHELL_TASKS
from tether.envs.shell import ShellSource
from tether.errors import ConfigError

TOOLS = ("shell", "python", "read_file", "write_file", "finish")
MAX_STEPS = 30

# The checks' own program: reads its spec from base64 JSON, prints `checks: K/N`, exits 0 iff all pass.
# It runs as `python3 -I` in the workdir the model controls: isolated mode keeps the working directory off
# sys.path, so a planted `json.py` or `subprocess.py` never stands in for the checker's own imports; the
# paths it checks are the workdir's, opened relative to it only as files.
_CHECKER = """
import base64, hashlib, json, os, subprocess, sys
spec = json.loads(base64.b64decode(sys.argv[1]))
results = {}
def digest(path):
    try:
        with open(path, 'rb') as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return None
for path, expected in spec.get('files', {}).items():
    results['file ' + path] = digest(path) == expected
for path in spec.get('absent', []):
    results['absent ' + path] = not os.path.lexists(path)
for path in spec.get('empty_dirs', []):
    results['empty ' + path] = os.path.isdir(path) and not os.listdir(path)
for index, (text, expected) in enumerate(spec.get('runs', [])):
    run = subprocess.run(['bash', spec['script'], '/dev/stdin'], input=text, capture_output=True,
                         text=True, timeout=20)
    results['hidden run %d' % index] = run.returncode == 0 and run.stdout == expected
failed = sorted(name for name, ok in results.items() if not ok)
for name in failed[:10]:
    print('failed:', name)
print('checks: %d/%d' % (len(results) - len(failed), len(results)))
sys.exit(1 if failed else 0)
"""


def check_command(
    spec: dict[str, Any], timeout_s: float = 60.0, suite: SuiteCheck | None = None
) -> CheckSpec:
    """A check that runs the checker program on `spec` (files by sha256, absent paths, empty dirs,
    script runs on hidden inputs) and, with `suite`, hidden `test_*(m)` functions through the harness."""
    program = base64.b64encode(_CHECKER.encode()).decode()
    argument = base64.b64encode(json.dumps(spec).encode()).decode()
    command = f'python3 -I -c "$(echo {program} | base64 -d)" {argument}'
    return CheckSpec(command=command, suite=suite, timeout_s=timeout_s)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def family_spec(goal: str, files: dict[str, str], check: CheckSpec, max_steps: int) -> TaskSpec:
    """A family task: one agent with the workdir tools, full history in context, `finish` to end."""
    return TaskSpec(
        goal=goal,
        roles=(RoleSpec(name="agent", system_prompt=DEFAULT_SYSTEM_PROMPT, tools=TOOLS),),
        limits=Limits(max_steps=max_steps),
        context=ContextSpec(recent_steps=max_steps, recall_k=0),
        files=files,
        check=check,
        require_finish=True,
    )


def shell_task(seed: int, max_steps: int = MAX_STEPS) -> TaskSpec:
    """One of the terminal tasks of `shell/*`, the kind chosen by the seed."""
    kinds = sorted(SHELL_TASKS)
    problem = ShellSource(kinds[seed % len(kinds)]).problem(seed // len(kinds))
    data = problem.data
    expect = data["expect"]
    protected = {path: _sha256(data["files"][path]) for path in data["protected"]}
    check = check_command(
        {
            "files": {**expect["files"], **protected},
            "absent": expect["absent"],
            "empty_dirs": expect["empty_dirs"],
            "script": data["script"],
            "runs": data["hidden_runs"],
        }
    )
    goal = problem.prompt + " Call `finish` when the task is done."
    return family_spec(goal, dict(data["files"]), check, max_steps)


def repo_task(name: str) -> Callable[[int, int], TaskSpec]:
    """The multi-file repository tasks of `long/NAME`: implement a package until its hidden tests pass."""

    def task(seed: int, max_steps: int = MAX_STEPS) -> TaskSpec:
        problem = RepoSource(name).problem(seed)
        data = problem.data
        protected = {path: _sha256(data["files"][path]) for path in data["protected"]}
        suite = SuiteCheck(imports=data["imports"], tests=data["hidden_tests"])
        check = check_command({"files": protected}, timeout_s=120.0, suite=suite)
        goal = problem.prompt + " Call `finish` when you are done."
        return family_spec(goal, dict(data["files"]), check, max_steps)

    return task


@dataclass(frozen=True, slots=True)
class AgentFamily:
    name: str
    description: str
    build: Callable[[int, int], TaskSpec]  # (seed, max_steps) -> task

    def task(self, seed: int, max_steps: int = MAX_STEPS) -> TaskSpec:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"task seed {seed!r} of {self.name}: expected an integer >= 0")
        return self.build(seed, max_steps)


FAMILIES: dict[str, AgentFamily] = {
    "agent/shell": AgentFamily("agent/shell", "terminal tasks on a seeded file tree", shell_task),
    **{
        f"agent/{name}": AgentFamily(f"agent/{name}", f"repository task: {about}", repo_task(name))
        for name, (_, about) in REPO_TASKS.items()
    },
}


def family(name: str) -> AgentFamily:
    if name not in FAMILIES:
        raise ConfigError(f"unknown agent task family {name!r}; expected one of {', '.join(FAMILIES)}")
    return FAMILIES[name]
