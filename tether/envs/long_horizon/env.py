"""The long-horizon environment: any `Repo` as a multi-turn episode with tools, checks and a rubric.

The setup hook proves the session starts empty, writes the repository and checksums its protected
files; the validator re-checks them after every step. Scoring runs the hidden tests in the harness's
`suite` mode (partial credit per test): the model's package is imported only in a child process and
answers calls with plain data, while the trusted tests and their expected values stay in the parent,
so editing, faking or blinding the test run gains nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tether.chat import Messages
from tether.envs import qc
from tether.envs.code.runner import run_suite
from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.long_horizon.ledger import ledger_repo
from tether.envs.long_horizon.repo import Repo
from tether.envs.long_horizon.textkit import textkit_repo
from tether.envs.parsers import ANSWER_TAG
from tether.envs.scoring import EpisodeState
from tether.envs.shell import state_rubric, tool_call_message
from tether.envs.tasks import ChatRenderer, Problem, Task
from tether.tools import PYTHON, SHELL, SUBMIT

SYSTEM = (
    "You are a software engineer working in a repository through tools: `shell` runs bash commands and "
    "`python` runs Python programs in the repository's root, which persists between calls. Read the "
    "specification, implement it, run the tests, and call `submit` when you are done. Never modify the "
    "tests."
)
TASKS: dict[str, tuple[Callable[[int], Repo], str]] = {
    "ledger": (ledger_repo, "a three-module ledger package (parse, balance, report)"),
    "textkit": (textkit_repo, "a three-module text package (tokens, stats, wrap)"),
}


@dataclass(frozen=True, slots=True)
class RepoSource:
    name: str

    def problem(self, seed: int) -> Problem:
        repo = TASKS[self.name][0](seed)
        data: dict[str, Any] = {
            "files": repo.files,
            "protected": repo.protected,
            "imports": repo.imports,
            "hidden_tests": repo.hidden_tests,
            "modules": repo.modules,
        }
        return Problem(prompt=repo.prompt(), answer="done", data=data)


async def setup(state: EpisodeState) -> None:
    await qc.start_clean(state)
    await state.require_session().upload(state.task.data["files"])
    await qc.protect(state, state.task.data["protected"])


async def check_repository(state: EpisodeState) -> dict[str, bool]:
    data = state.task.data
    results = await run_suite(state.workspace(), data["imports"], data["hidden_tests"])
    return results or {"hidden test suite ran": False}


def reference_replies(task: Task) -> Messages:
    """Read the spec, write each module in its own call, run the tests, submit: six tool calls."""
    calls: list[tuple[str, dict[str, Any]]] = [("shell", {"command": "cat README.md && ls -R . | head -40"})]
    for path, source in task.data["modules"].items():
        calls.append(("python", {"code": f"open({path!r}, 'w').write({source!r})\n"}))
    calls.append(("shell", {"command": "python3 -m unittest discover -s tests -t . 2>&1 | tail -3"}))
    calls.append(("submit", {"answer": "done"}))
    return [tool_call_message(name, arguments, index) for index, (name, arguments) in enumerate(calls)]


def adversarial(task: Task) -> list[str]:
    """Claims and code pasted as text: only the repository's final state is scored."""
    first_module = next(iter(task.data["modules"].values()))
    return ["All tests pass.", ANSWER_TAG.format("done"), f"```python\n{first_module}```"]


def long_env(name: str) -> Environment:
    if name not in TASKS:
        raise EnvError(f"unknown long-horizon task {name!r}; expected one of {', '.join(TASKS)}")
    return Environment(
        name=f"long/{name}",
        source=RepoSource(name),
        renderer=ChatRenderer(SYSTEM),
        parser=ANSWER_TAG,
        rubric=state_rubric(check_repository, call_budget=24),
        tools=(SHELL, PYTHON, SUBMIT),
        max_turns=40,
        description=f"repository task: {TASKS[name][1]}; hidden tests with partial credit",
        setup=setup,
        validators=qc.validators(),
        reference_replies=reference_replies,
        adversarial=adversarial,
    )
