"""The agents pages in Chromium: a running task's timeline grows step by step on the open page (a real
worker, sandbox and scripted team), a task cancelled from the page is cancelled for `tether agent ls`, and
a task of 500 steps loads within the budget."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from typer.testing import CliRunner

from tests.console.agent_work import GatedModel, journal_long_task, submit, worker_thread
from tests.console.conftest import load_ms, record_load_times
from tests.live_server import live_server
from tether.agents.service import AgentsConfig
from tether.agents.submission import goal_spec
from tether.agents.task import Limits, TaskSpec
from tether.cli.main import app as cli
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.store.journal import Journal
from tether.store.records import TaskStatus

STATS = "def mean(values):\n    return sum(values) / len(values)\n"
FIXED = "def mean(values):\n    if not values:\n        return 0.0\n    return sum(values) / len(values)\n"
TESTS = (
    "from stats import mean\n\n"
    "assert mean([2, 4, 9]) == 5\n"
    "assert mean([1.5]) == 1.5\n"
    "assert mean([]) == 0.0, 'an empty sample has mean 0.0'\n"
    "print('3 checks passed')\n"
)


def _call(name: str, **arguments: str) -> dict[str, object]:
    return {"name": name, "arguments": arguments}


TEAM_SCRIPT: list[dict[str, object]] = [
    {
        "content": "Reading the code and the checks first.",
        "tool_calls": [_call("shell", command="ls && cat stats.py")],
    },
    {
        "content": "Plan: 1. run check_stats.py to see the failure; 2. make mean() of an empty list 0.0; "
        "3. run the checks again.",
        "tool_calls": [
            _call("handoff", to="coder", message="Fix mean() for empty input; the plan is above.")
        ],
    },
    {
        "content": "Running the checks as they are.",
        "tool_calls": [_call("shell", command="python3 check_stats.py")],
    },
    {
        "content": "mean([]) divides by zero: returning 0.0 for an empty sample.",
        "tool_calls": [_call("write_file", path="stats.py", content=FIXED)],
    },
    {"content": "Checking the fix.", "tool_calls": [_call("shell", command="python3 check_stats.py")]},
    {
        "content": "All checks pass; over to review.",
        "tool_calls": [_call("handoff", to="reviewer", message="mean() now handles []; please review.")],
    },
    {
        "content": "Reviewing the change and running the checks myself.",
        "tool_calls": [_call("shell", command="grep -n -A3 'def mean' stats.py && python3 check_stats.py")],
    },
    {
        "content": "The fix is right and minimal.",
        "tool_calls": [_call("finish", summary="mean([]) is now 0.0")],
    },
]


def _console(tmp_path: Path, config: AgentsConfig) -> object:
    return create_app(ConsoleConfig(runs=(tmp_path,), agents=config, poll_s=0.1))


def _steps_shown(page: object) -> int:
    from playwright.sync_api import Page

    assert isinstance(page, Page)
    return page.locator("#timeline > li.step").count()


def test_a_running_team_task_grows_step_by_step_on_the_open_page(
    tmp_path: Path, page: object, shots: Path
) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    config = AgentsConfig.embedded(tmp_path / "agents")
    spec = goal_spec(
        "Make mean() in stats.py return 0.0 for an empty list, as check_stats.py expects.",
        "planner,coder,reviewer",
        max_steps=20,
        files={"stats.py": STATS, "check_stats.py": TESTS},
    )
    task_id = submit(config, spec)
    model = GatedModel(TEAM_SCRIPT, crash_at=4)  # worker-a dies after the fix is written; worker-b goes on
    workers = worker_thread(config, task_id, model, ("worker-a", "worker-b"))
    with live_server(_console(tmp_path, config)) as url, workers:
        page.goto(f"{url}/agents/{task_id}")
        page.evaluate("() => { window.samePage = true; }")
        assert _steps_shown(page) == 0
        for step_no in range(len(TEAM_SCRIPT)):
            model.step()
            expect(page.locator(f"#timeline > li#step-{step_no}")).to_be_visible(timeout=20_000)
            assert _steps_shown(page) == step_no + 1  # appended, one step at a time
        expect(page.locator("#task-status")).to_have_text("succeeded", timeout=20_000)
        assert page.evaluate("() => window.samePage === true")  # never reloaded
        roles = page.eval_on_selector_all("#timeline > li.step", "els => els.map(e => e.dataset.role)")
        assert roles == ["planner", "planner", "coder", "coder", "coder", "coder", "reviewer", "reviewer"]
        failing = page.locator("#step-2 .call")
        expect(failing).to_contain_text("exit 1")
        expect(failing).to_contain_text("an empty sample has mean 0.0")
        expect(page.locator("#step-4 .call")).to_contain_text("3 checks passed")
        expect(page.locator("#step-3 .step-note.handoff")).to_have_count(0)
        expect(page.locator("#step-2 .step-note.handoff")).to_contain_text("coder")
        expect(page.locator("#timeline .step-note.resumed")).to_have_count(1)
        expect(page.locator("#step-4 .step-note.resumed")).to_contain_text("resumed under lease epoch")
        page.screenshot(path=shots / "agent-timeline.png", full_page=True)


def test_a_task_cancelled_on_its_page_is_cancelled_for_the_cli(
    tmp_path: Path, page: object, shots: Path
) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    home = tmp_path / "agents"
    config = AgentsConfig.embedded(home)
    script = [
        {"content": f"Looking at part {n}.", "tool_calls": [_call("shell", command=f"echo part {n}")]}
        for n in range(5)
    ]
    task_id = submit(config, TaskSpec(goal="Survey the five parts one by one.", limits=Limits(max_steps=10)))
    model = GatedModel(script)
    page.on("dialog", lambda dialog: dialog.accept())
    with live_server(_console(tmp_path, config)) as url, worker_thread(config, task_id, model):
        page.goto(f"{url}/agents")
        page.fill("textarea[name=goal]", "Write a haiku about durable journals.")
        page.fill("input[name=max_steps]", "3")
        page.click("#submit-task button[type=submit]")
        expect(page.locator("#flash .flash-ok")).to_contain_text("submitted task")
        expect(page.locator("tr.task-row")).to_have_count(2)
        page.goto(f"{url}/agents/{task_id}")
        model.step()
        expect(page.locator("#timeline > li#step-0")).to_be_visible(timeout=20_000)
        page.click("#cancel-task")  # the worker is inside step 1's model call: it stops before step 2
        expect(page.locator("#flash .flash-ok")).to_contain_text("cancel requested")
        model.step()
        expect(page.locator("#task-status")).to_have_text("cancelled", timeout=20_000)
        page.goto(f"{url}/agents?state=cancelled")
        expect(page.locator("tr.task-row")).to_have_count(1)
        _other_tasks(config)
        page.goto(f"{url}/agents")
        expect(page.locator("tr.task-row")).to_have_count(5)
        page.screenshot(path=shots / "agents-list.png", full_page=True)
        page.goto("about:blank")  # the list refreshes itself: stop it before the server goes
    listed = CliRunner().invoke(cli, ["agent", "ls", "--json", "--home", str(home)])
    assert listed.exit_code == 0, listed.output
    states = {task["task_id"]: task["status"] for task in json.loads(listed.output)}
    assert states[task_id] == "cancelled"
    assert sorted(states.values()) == ["cancelled", "failed", "queued", "running", "succeeded"]


def _other_tasks(config: AgentsConfig) -> None:
    """Tasks in the other states, for the list's screenshot."""
    journal = Journal(config.store_url)
    try:
        for goal, steps, end, roles in (
            ("Summarize the error rate of each service from the logs.", 12, TaskStatus.SUCCEEDED, None),
            ("Port the parser to the new tokenizer API.", 30, TaskStatus.FAILED, "planner,coder,reviewer"),
            ("Count the ERROR lines in every log part.", 7, None, "coder,reviewer"),
        ):
            spec = goal_spec(goal, roles, max_steps=40)
            journal_long_task(journal, submit(config, spec), steps, running=True, end=end)
    finally:
        journal.close()


def test_a_task_of_500_steps_loads_within_300_ms(tmp_path: Path, page: object, shots: Path) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    config = AgentsConfig.embedded(tmp_path / "agents")
    task_id = submit(
        config, TaskSpec(goal="Count the errors in 500 log parts.", limits=Limits(max_steps=600))
    )
    journal = Journal(config.store_url)
    try:
        journal_long_task(journal, task_id, 500)
    finally:
        journal.close()
    with live_server(_console(tmp_path, config)) as url:
        page.goto(f"{url}/agents/{task_id}")  # warm: the first request opens the journal
        times = []
        for _ in range(3):
            page.goto(f"{url}/agents/{task_id}")
            times.append(load_ms(page))
        record_load_times(shots, "task-500-steps", times)
        expect(page.locator("#timeline > li#step-499")).to_be_visible()
        page.click("li.load-earlier button")
        expect(page.locator("#timeline > li#step-400")).to_be_visible()
        page.screenshot(path=shots / "agent-500-steps.png")
    assert statistics.median(times) < 300, times
