"""The jobs pages over a real job store: the queue in scheduling order, running jobs with their
placements, one job's page with its log, and every bad id or filter answered 4xx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.console.conftest import load_ms
from tests.live_server import live_server
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.scheduler.job import JobState
from tether.scheduler.local import LocalBackend, MachineCapacity
from tether.scheduler.store import JobRequest, JobStore
from tether.scheduler.workload import WorkloadKind


@pytest.fixture
def jobs_db(tmp_path: Path) -> Path:
    """A store with a running gang on devices 0-1, two queued jobs (the later one of higher priority),
    and a failed one whose log says why."""
    path = tmp_path / "jobs.sqlite"
    # the scheduler remembers its machine and policy in the store, as `tether jobs` does on first use
    capacity = MachineCapacity(cpus=16, memory_mib=65_536, accelerators=4)
    store = LocalBackend.open(path, capacity=capacity, policy="priority").store
    now = time.time()
    train = store.insert(
        JobRequest(("tether", "train"), name="train-a", accelerators=2, workload=WorkloadKind.TRAIN), now
    )
    store.mark_running(train, pid=4242, now=now + 1, devices=(0, 1), ports=(29500,))
    store.insert(JobRequest(("sleep", "9"), name="low"), now=now + 2)
    store.insert(JobRequest(("sleep", "9"), name="urgent", priority=5), now=now + 3)
    failed = store.insert(JobRequest(("false",), name="broken"), now=now + 4)
    store.mark_running(failed, pid=4343, now=now + 5)
    store.mark_finished(failed, JobState.FAILED, now=now + 6, exit_code=1, reason="exited 1")
    log = Path(store.get(failed).log_path)  # type: ignore[union-attr]
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("starting\nboom: no such file\n")
    store.close()
    return path


@pytest.fixture
def client(jobs_db: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ConsoleConfig(runs=(), jobs_db=jobs_db))) as client:
        yield client


def test_the_board_shows_the_queue_in_order_and_running_jobs_with_placements(client: TestClient) -> None:
    board = client.get("/api/jobs").json()
    assert [job["name"] for job in board["queued"]] == ["urgent", "low"]
    (running,) = board["running"]
    assert running["name"] == "train-a" and running["devices"] == [0, 1] and running["ports"] == [29500]
    assert [job["name"] for job in board["finished"]] == ["broken"]
    assert board["policy"] == "priority" and board["machine"] == {"accelerators": 4}
    page = client.get("/jobs")
    assert page.status_code == 200
    assert "devices 0,1 · ports 29500 · pid 4242" in page.text
    assert client.get("/jobs/panel").text.count('data-state="queued"') == 2


def test_a_state_filter_narrows_the_board(client: TestClient) -> None:
    board = client.get("/api/jobs", params={"state": "failed"}).json()
    assert [job["name"] for job in board["finished"]] == ["broken"]
    assert board["queued"] == [] and board["running"] == []


def test_a_jobs_page_shows_its_record_and_log(client: TestClient) -> None:
    board = client.get("/api/jobs").json()
    broken = board["finished"][0]["id"]
    page = client.get(f"/jobs/{broken}")
    assert page.status_code == 200 and "boom: no such file" in page.text and "exited 1" in page.text
    assert client.get(f"/api/jobs/{broken}").json()["log_tail"].endswith("boom: no such file\n")


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/jobs/999", 404, "unknown_job"),
        ("/jobs/abc", 400, "invalid_input"),
        ("/jobs/0", 400, "invalid_input"),
        (f"/jobs/{2**64}", 400, "invalid_input"),
        ("/jobs?state=sleeping", 400, "invalid_input"),
    ],
)
def test_a_bad_job_id_or_state_is_a_clear_4xx(client: TestClient, path: str, status: int, code: str) -> None:
    page = client.get(path)
    assert page.status_code == status and "text/html" in page.headers["content-type"]
    assert "Traceback" not in page.text
    api = client.get(path.replace("/jobs", "/api/jobs", 1))
    assert api.status_code == status and api.json()["error"]["code"] == code


def test_without_a_job_store_the_page_says_how_to_give_one() -> None:
    with TestClient(create_app(ConsoleConfig(runs=()))) as client:
        assert client.get("/jobs").status_code == 409
        assert "--jobs-db" in client.get("/api/jobs").json()["error"]["message"]


def test_the_jobs_page_in_chromium_follows_a_job_that_starts(
    jobs_db: Path, page: object, shots: Path
) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    with live_server(create_app(ConsoleConfig(runs=(), jobs_db=jobs_db, poll_s=1.0))) as url:
        page.goto(f"{url}/jobs")
        assert load_ms(page) < 3000
        queued = page.locator('table[data-table="queued"] tr[data-job]')
        expect(queued).to_have_count(2)
        store = JobStore(jobs_db)
        urgent = next(r for r in store.all((JobState.QUEUED,)) if r.request.name == "urgent")
        store.mark_running(urgent.id, pid=5151, now=time.time(), devices=(2,))
        store.close()
        # the page polls the store: the job moves from the queue to running without a reload
        expect(page.locator('table[data-table="running"] tr[data-job]')).to_have_count(2, timeout=10_000)
        expect(queued).to_have_count(1)
        page.screenshot(path=shots / "jobs.png", full_page=True)
        page.locator(f'a[href$="/jobs/{urgent.id}"]').first.click()
        expect(page.locator("h1 .badge")).to_have_attribute("data-state", "running")
