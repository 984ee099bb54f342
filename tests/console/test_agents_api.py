"""The agents pages and `/api/agents` over a real journal: lists with budget use and cost, the timeline and
its pages, the actions of `tether agent`, and a clear 4xx for every bad id, form and action."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tests.console.agent_work import journal_long_task
from tests.console.agent_work import submit as submit_task
from tether.agents.service import AgentsConfig
from tether.agents.submission import family_task
from tether.agents.task import Limits, TaskSpec
from tether.chat.completion import Usage
from tether.chat.pricing import DEFAULT_PRICES, Tier, cost_usd
from tether.cli.main import app as cli
from tether.console.agent_reader import PAGE_STEPS
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.store.journal import Journal
from tether.store.records import TaskStatus

HX = {"HX-Request": "true"}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "agents"


@pytest.fixture
def client(tmp_path: Path, home: Path) -> Iterator[TestClient]:
    app = create_app(ConsoleConfig(runs=(tmp_path,), agents=AgentsConfig.embedded(home)))
    with TestClient(app) as opened:
        yield opened


def submit(home: Path, spec: TaskSpec) -> str:
    return submit_task(AgentsConfig.embedded(home), spec)


def with_steps(home: Path, steps: int, max_steps: int = 1000, running: bool = False) -> str:
    task_id = submit(home, TaskSpec(goal="count the errors", limits=Limits(max_steps=max_steps)))
    journal = Journal(AgentsConfig.embedded(home).store_url)
    try:
        journal_long_task(journal, task_id, steps, running)
    finally:
        journal.close()
    return task_id


def cli_json(home: Path, *args: str) -> Any:
    """What `tether agent ... --json` prints for this journal."""
    result = CliRunner().invoke(cli, ["agent", *args, "--json", "--home", str(home)])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_console_without_a_journal_says_where_it_looked_and_creates_none(
    client: TestClient, home: Path
) -> None:
    page = client.get("/agents")
    assert page.status_code == 200 and "no journal at" in page.text
    assert client.get("/api/agents").json() == []
    assert not (home / "journal.db").exists()


def test_the_list_shows_state_step_budget_and_cost_from_the_journal(client: TestClient, home: Path) -> None:
    task_id = with_steps(home, 3, max_steps=10, running=True)
    (row,) = client.get("/api/agents").json()
    usage = Usage(prompt_tokens=800 + 801 + 802, cached_tokens=3 * 600, completion_tokens=3 * 40)
    assert row["task_id"] == task_id and row["status"] == "running" and row["step_count"] == 3
    assert row["budget"]["steps"] == 3 and row["budget"]["max_steps"] == 10
    assert row["budget"]["tokens"] == usage.total_tokens
    assert row["cost_usd"] == pytest.approx(float(cost_usd(usage, DEFAULT_PRICES[Tier.STANDARD])))
    assert f'data-task="{task_id}"' in client.get("/agents").text


def test_the_list_filters_by_state(client: TestClient, home: Path) -> None:
    kept = submit(home, TaskSpec(goal="stays queued"))
    cancelled = submit(home, TaskSpec(goal="is cancelled"))
    assert client.post(f"/agents/{cancelled}/cancel", headers=HX).status_code == 200
    assert [t["task_id"] for t in client.get("/api/agents?state=cancelled").json()] == [cancelled]
    assert [t["task_id"] for t in client.get("/api/agents?state=queued").json()] == [kept]
    rows = client.get("/agents/rows?state=queued").text
    assert kept in rows and cancelled not in rows


def test_a_task_page_shows_the_newest_steps_and_pages_back_to_the_first(
    client: TestClient, home: Path
) -> None:
    steps = PAGE_STEPS + 30
    task_id = with_steps(home, steps)
    page = client.get(f"/agents/{task_id}").text
    assert page.count('class="step"') == PAGE_STEPS
    assert f'id="step-{steps - 1}"' in page and 'id="step-29"' not in page
    assert f"/agents/{task_id}/steps?before=30" in page
    earlier = client.get(f"/agents/{task_id}/steps?before=30").text
    assert earlier.count('class="step"') == 30 and 'id="step-0"' in earlier and "load-earlier" not in earlier
    assert "exit 0" in earlier and "grep -c ERROR logs/part-000-0.log" in earlier
    api = client.get(f"/api/agents/{task_id}?before=30").json()
    assert [step["step_no"] for step in api["steps"]] == list(range(30))
    assert api["steps"][0]["tool_calls"][0]["exit_code"] == 0


def test_the_event_stream_of_a_finished_task_sends_its_steps_and_ends(client: TestClient, home: Path) -> None:
    task_id = with_steps(home, 2)
    client.post(f"/agents/{task_id}/cancel", headers=HX)  # its worker (none is running) stops it
    with client.stream("GET", f"/api/agents/{task_id}/events") as stream:
        text = "".join(stream.iter_text())
    assert "event: step" in text and 'id="step-1"' in text
    assert "event: end" in text and "data: cancelled" in text


def test_a_task_submitted_here_is_the_one_the_cli_shows(client: TestClient, home: Path) -> None:
    answer = client.post(
        "/agents", data={"goal": "tidy the inbox", "max_steps": "7", "roles": "planner,coder"}, headers=HX
    )
    assert answer.status_code == 200 and answer.headers["HX-Trigger"] == "task-changed"
    (listed,) = cli_json(home, "ls")
    shown = cli_json(home, "show", listed["task_id"])
    assert shown["spec"]["limits"]["max_steps"] == 7
    assert [role["name"] for role in shown["spec"]["roles"]] == ["planner", "coder"]
    family = client.post(
        "/api/agents", json={"family": "agent/shell", "seed": 2}, headers={"Authorization": "x"}
    )
    assert family.status_code == 201
    shown = cli_json(home, "show", family.json()["task_id"])
    assert shown["goal"] == family_task("agent/shell", 2).goal


@pytest.mark.parametrize(
    ("form", "said"),
    [
        ({"goal": "g", "max_steps": "-1"}, "max_steps = '-1': Input should be greater than or equal to 1"),
        ({"goal": "g", "max_steps": "many"}, "max_steps = 'many'"),
        ({"family": "agent/nope"}, "unknown agent task family 'agent/nope'"),
        ({"family": "agent/shell", "seed": "-3"}, "seed = '-3'"),
        ({"goal": "g", "roles": "planner,chef"}, "unknown role(s) ['chef']"),
        ({"goal": "g", "family": "agent/shell"}, "give a goal, or a family"),
        ({"goal": "  "}, "give a goal, or a family"),
        ({"family": "agent/shell", "roles": "coder"}, "sets the whole task"),
        ({"goal": "g", "colour": "red"}, "unknown key 'colour'"),
    ],
)
def test_a_malformed_task_form_is_refused_with_what_is_wrong(
    client: TestClient, home: Path, form: dict[str, str], said: str
) -> None:
    answer = client.post("/agents", data=form, headers=HX)
    assert answer.status_code == 400 and answer.headers["HX-Retarget"] == "#flash"
    assert said in answer.text.replace("&#39;", "'")
    api = client.post("/api/agents", json=form, headers={"Authorization": "x"})
    assert api.status_code == 400 and said in api.json()["error"]["message"]
    assert client.get("/api/agents").json() == []


def test_a_body_that_is_not_a_json_object_is_refused(client: TestClient) -> None:
    for body in (b"[1, 2]", b"{not json"):
        answer = client.post("/api/agents", content=body, headers={"Authorization": "x"})
        assert answer.status_code == 400 and "JSON object" in answer.json()["error"]["message"]


def test_an_unknown_task_is_a_404_page_and_404_json(client: TestClient, home: Path) -> None:
    submit(home, TaskSpec(goal="a journal now exists"))
    page = client.get("/agents/t-nope")
    assert page.status_code == 404 and "task 't-nope': not found" in page.text.replace("&#39;", "'")
    assert "Traceback" not in page.text
    for path in ("/api/agents/t-nope", "/api/agents/t-nope/events", "/agents/t-nope/steps"):
        answer = client.get(path, headers={"Accept": "application/json"})
        assert answer.status_code == 404, path
    assert client.get("/api/agents/t-nope").json()["error"]["code"] == "unknown_task"
    for action in ("cancel", "resume"):
        assert client.post(f"/api/agents/t-nope/{action}", headers={"Authorization": "x"}).status_code == 404


@pytest.mark.parametrize("query", ["state=bogus", "state=" + "x" * 40])
def test_an_unknown_state_filter_is_refused(client: TestClient, query: str) -> None:
    answer = client.get(f"/api/agents?{query}")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_input"
    assert client.get(f"/agents?{query}").status_code == 400


def test_a_negative_page_is_refused(client: TestClient, home: Path) -> None:
    task_id = with_steps(home, 1)
    assert client.get(f"/api/agents/{task_id}?before=-1").status_code == 400
    assert client.get(f"/api/agents/{task_id}/events?after=-5").status_code == 400


def test_cancelling_a_finished_task_is_a_409_that_says_so(client: TestClient, home: Path) -> None:
    task_id = submit(home, TaskSpec(goal="g"))
    first = client.post(f"/api/agents/{task_id}/cancel", headers={"Authorization": "x"})
    assert first.status_code == 200 and first.json()["status"] == TaskStatus.CANCELLED.value
    again = client.post(f"/agents/{task_id}/cancel", headers=HX)
    assert again.status_code == 409 and "already cancelled" in again.text
    assert client.post(f"/api/agents/{task_id}/cancel", headers={"Authorization": "x"}).json()["error"][
        "code"
    ] == ("task_finished")


def test_a_task_whose_budget_is_spent_is_not_resumed(client: TestClient, home: Path) -> None:
    task_id = with_steps(home, 2, max_steps=2)
    client.post(f"/agents/{task_id}/cancel", headers=HX)
    answer = client.post(f"/api/agents/{task_id}/resume", headers={"Authorization": "x"})
    assert answer.status_code == 409 and "step budget exhausted" in answer.json()["error"]["message"]
    assert cli_json(home, "show", task_id)["status"] == "cancelled"


def test_a_cancelled_task_is_resumed_from_its_next_step(client: TestClient, home: Path) -> None:
    task_id = with_steps(home, 2)
    client.post(f"/agents/{task_id}/cancel", headers=HX)
    answer = client.post(f"/agents/{task_id}/resume", headers=HX)
    assert answer.status_code == 200 and "continue from step 2" in answer.text
    assert cli_json(home, "show", task_id)["status"] == "queued"


def test_pages_say_when_no_journal_is_configured(tmp_path: Path) -> None:
    client = TestClient(create_app(ConsoleConfig(runs=(tmp_path,))))
    answer = client.get("/api/agents")
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "not_configured"
