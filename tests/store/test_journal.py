"""The journal against SQLite and a real PostgreSQL: write-once steps, lease fencing, tool-call ledger."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.store.backends import BACKENDS, open_journal
from tether.errors import ConfigError
from tether.store import (
    Journal,
    LeaseLost,
    StepRecord,
    StepStatus,
    TaskStatus,
    ToolCallRecord,
    UnknownTask,
    idempotency_key,
)
from tether.store.database import journal_exists


@pytest.fixture(params=BACKENDS)
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Journal]:
    with open_journal(request.param, tmp_path) as opened:
        yield opened


def make_step(task_id: str, step_no: int, epoch: int, text: str = "hi", calls: int = 1) -> StepRecord:
    now = time.time()
    return StepRecord(
        task_id=task_id,
        step_no=step_no,
        epoch=epoch,
        role="agent",
        message={"role": "assistant", "content": text},
        usage={"prompt_tokens": 10, "completion_tokens": 2},
        messages_in=2 * step_no + 2,
        messages_in_digest="d" * 32,
        started_at=now,
        model_done_at=now,
        tool_calls=tuple(
            ToolCallRecord(
                idempotency_key=idempotency_key(task_id, step_no, index),
                task_id=task_id,
                step_no=step_no,
                call_index=index,
                tool="bash",
                arguments={"command": f"echo {step_no}.{index}"},
                intent_at=now,
            )
            for index in range(calls)
        ),
    )


def test_submitting_the_same_task_twice_keeps_the_first(journal: Journal) -> None:
    first = journal.create_task("t1", {"goal": "a"})
    again = journal.create_task("t1", {"goal": "b"})
    assert again.spec == first.spec == {"goal": "a"}
    assert again.status is TaskStatus.QUEUED
    assert [task.task_id for task in journal.list_tasks()] == ["t1"]


def test_unknown_task_names_the_id(journal: Journal) -> None:
    with pytest.raises(UnknownTask, match="'nope'"):
        journal.get_task("nope")


def test_a_step_is_written_once_and_a_second_append_returns_the_first(journal: Journal) -> None:
    journal.create_task("t1", {})
    epoch = journal.claim("t1", "w1", lease_s=30)
    assert epoch == 1
    stored = journal.append_step(make_step("t1", 0, epoch, "first", calls=2))
    replayed = journal.append_step(make_step("t1", 0, epoch, "second", calls=1))
    assert replayed.message["content"] == stored.message["content"] == "first"
    assert len(replayed.tool_calls) == 2
    assert replayed.status is StepStatus.PLANNED
    assert [step.step_no for step in journal.steps("t1")] == [0]


def test_observations_and_commit_are_write_once(journal: Journal) -> None:
    journal.create_task("t1", {})
    epoch = journal.claim("t1", "w1", lease_s=30)
    assert epoch is not None
    step = journal.append_step(make_step("t1", 0, epoch, calls=2))
    first, second = (call.idempotency_key for call in step.tool_calls)
    assert journal.mark_started("t1", epoch, first) == 1
    assert journal.mark_started("t1", epoch, first) == 2
    journal.record_observation("t1", epoch, first, {"stdout": "one"})
    journal.record_observation("t1", epoch, first, {"stdout": "overwritten?"})
    journal.commit_step(
        "t1", 0, epoch, {first: {"stdout": "no"}, second: {"stdout": "two"}}, "sha256/" + "a" * 64
    )
    journal.commit_step("t1", 0, epoch, {}, None)
    (committed,) = journal.steps("t1")
    assert committed.status is StepStatus.COMMITTED
    assert committed.snapshot_key == "sha256/" + "a" * 64
    assert [call.observation for call in committed.tool_calls] == [{"stdout": "one"}, {"stdout": "two"}]
    assert [call.executions for call in committed.tool_calls] == [2, 0]


def test_a_worker_that_lost_its_lease_cannot_write(journal: Journal) -> None:
    journal.create_task("t1", {})
    old = journal.claim("t1", "w1", lease_s=0.01)
    assert old is not None
    time.sleep(0.05)
    new = journal.claim("t1", "w2", lease_s=30)
    assert new == old + 1
    assert journal.claim("t1", "w1", lease_s=30) is None  # held and live: w1 cannot take it back
    with pytest.raises(LeaseLost, match="epoch 1"):
        journal.append_step(make_step("t1", 0, old))
    with pytest.raises(LeaseLost):
        journal.renew("t1", old, 30)
    with pytest.raises(LeaseLost):
        journal.finish("t1", old, TaskStatus.SUCCEEDED)
    assert journal.steps("t1") == []
    journal.append_step(make_step("t1", 0, new))
    journal.finish("t1", new, TaskStatus.SUCCEEDED, result="done")
    task = journal.get_task("t1")
    assert task.status is TaskStatus.SUCCEEDED and task.result == "done" and task.owner is None
    assert journal.claim("t1", "w3", lease_s=30) is None  # finished tasks are never claimed again


def test_cancel_of_an_unowned_task_is_immediate_and_resume_requeues_it(journal: Journal) -> None:
    journal.create_task("t1", {})
    assert journal.request_cancel("t1").status is TaskStatus.CANCELLED
    assert journal.claim("t1", "w1", lease_s=30) is None
    requeued = journal.requeue("t1")
    assert requeued.status is TaskStatus.QUEUED and not requeued.cancel_requested
    assert journal.claim("t1", "w1", lease_s=30) is not None


def test_cancel_of_a_running_task_asks_its_worker(journal: Journal) -> None:
    journal.create_task("t1", {})
    epoch = journal.claim("t1", "w1", lease_s=30)
    assert epoch is not None
    task = journal.request_cancel("t1")
    assert task.status is TaskStatus.RUNNING and task.cancel_requested
    journal.renew("t1", epoch, 30)  # the worker still holds the lease until it stops


def test_steps_can_be_read_from_an_offset(journal: Journal) -> None:
    journal.create_task("t1", {})
    epoch = journal.claim("t1", "w1", lease_s=30)
    assert epoch is not None
    for step_no in range(5):
        journal.append_step(make_step("t1", step_no, epoch))
    assert [step.step_no for step in journal.steps("t1", from_step=3)] == [3, 4]
    assert journal.step("t1", 9) is None


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://x/y", "use sqlite:///PATH or postgresql://"),
        ("", "use sqlite:///PATH"),
        ("sqlite://relative", "use sqlite:///PATH"),
    ],
)
def test_bad_store_urls_are_rejected(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Journal(url)


@pytest.mark.parametrize("prefix", ["x; drop table y", "a-b", "t.x"])
def test_bad_table_prefixes_are_rejected(prefix: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="table prefix"):
        Journal(f"sqlite:///{tmp_path / 'j.db'}", table_prefix=prefix)


def test_a_worker_that_gives_its_lease_up_queues_the_task_for_any_worker(journal: Journal) -> None:
    journal.create_task("t1", {})
    epoch = journal.claim("t1", "w1", lease_s=30)
    assert epoch is not None
    journal.release("t1", epoch)
    task = journal.get_task("t1")
    assert task.status is TaskStatus.QUEUED and task.owner is None
    assert journal.claim("t1", "w2", lease_s=30) == epoch + 1


def test_an_sqlite_journal_creates_its_missing_directory(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh' / 'machine' / 'journal.db'}"
    assert not journal_exists(url)
    journal = Journal(url)
    try:
        journal.create_task("t1", {})
    finally:
        journal.close()
    assert journal_exists(url) and (tmp_path / "fresh" / "machine" / "journal.db").is_file()


def test_step_usage_gives_each_tasks_steps_tokens_in_one_read(journal: Journal) -> None:
    for task_id, steps in (("busy", 3), ("idle", 0)):
        journal.create_task(task_id, {"goal": task_id})
        epoch = journal.claim(task_id, "w", lease_s=30)
        assert epoch is not None
        for step_no in range(steps):
            journal.append_step(make_step(task_id, step_no, epoch))
    usage = journal.step_usage(["busy", "idle", "unknown"])
    assert [step.step_no for step in usage["busy"]] == [0, 1, 2]
    assert usage["busy"][0].usage == make_step("busy", 0, 1).usage
    assert usage["idle"] == [] and usage["unknown"] == []
    assert journal.step_usage([]) == {}
