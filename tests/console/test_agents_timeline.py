"""The timeline's views of journaled steps: resumptions told apart from hand-offs, a sandbox run's exit
status, loop nudges, and a page of steps that reads only its window yet shows what the whole task shows."""

from __future__ import annotations

import time
from pathlib import Path

from tether.agents.task import Limits, LoopSpec, TaskSpec
from tether.console.agent_reader import read_timeline, shown_steps, step_views, task_loop
from tether.store.journal import Journal
from tether.store.records import StepRecord, StepStatus, ToolCallRecord, idempotency_key


def _step(step_no: int, epoch: int, tool: str, arguments: dict[str, object], output: str) -> StepRecord:
    now = time.time()
    call = ToolCallRecord(
        idempotency_key("t", step_no, 0),
        "t",
        step_no,
        0,
        tool,
        arguments,
        now,
        observation={"content": output, "error": "exit code: 0" not in output and tool == "shell"},
        observed_at=now + 0.5,
        executions=1,
    )
    return StepRecord(
        task_id="t",
        step_no=step_no,
        epoch=epoch,
        role="coder" if epoch > 1 else "planner",
        message={"role": "assistant", "content": f"step {step_no}"},
        usage={"prompt_tokens": 10, "completion_tokens": 2},
        messages_in=1,
        messages_in_digest="0" * 32,
        started_at=now - 1,
        model_done_at=now,
        status=StepStatus.COMMITTED,
        committed_at=now + 0.5,
        tool_calls=(call,),
    )


def test_a_new_lease_after_a_hand_off_is_a_hand_off_and_otherwise_a_resumption() -> None:
    steps = [
        _step(0, 1, "handoff", {"to": "coder"}, "handed off to coder"),
        _step(1, 2, "shell", {"command": "false"}, "status: runtime_error\nexit code: 1"),
        _step(2, 3, "shell", {"command": "true"}, "status: ok\nexit code: 0"),
    ]
    views = step_views(steps, LoopSpec())
    assert [(v.handed_over, v.resumed) for v in views] == [(False, False), (True, False), (False, True)]
    failed, passed = views[1].calls[0], views[2].calls[0]
    assert (failed.run_status, failed.exit_code, failed.state) == ("runtime_error", 1, "error")
    assert (passed.run_status, passed.exit_code, passed.arguments) == ("ok", 0, "true")
    assert failed.took_s is not None and abs(failed.took_s - 0.5) < 1e-6


def test_a_repeated_step_carries_the_nudge_the_model_was_given() -> None:
    steps = [_step(n, 1, "shell", {"command": "ls"}, "status: ok\nexit code: 0") for n in range(3)]
    views = step_views(steps, LoopSpec(repeats_before_nudge=3))
    assert [v.loop_note is not None for v in views] == [False, False, True]
    assert "nudged (1 of 2)" in (views[2].loop_note or "")


def test_a_page_read_from_its_window_shows_what_the_whole_task_shows(tmp_path: Path) -> None:
    journal = Journal(f"sqlite:///{tmp_path / 'j.db'}")
    spec = TaskSpec(goal="g", limits=Limits(max_steps=100), loop=LoopSpec(repeats_before_nudge=2))
    journal.create_task("t", spec.model_dump(mode="json"))
    epoch = journal.claim("t", "w", lease_s=60)
    assert epoch is not None
    for step_no in range(40):
        command = "ls" if 10 <= step_no < 13 else f"echo {step_no}"  # a repeat run across a page edge
        step = _step(step_no, epoch, "shell", {"command": command}, "status: ok\nexit code: 0")
        journal.append_step(step)
        journal.commit_step(
            "t", step_no, epoch, {step.tool_calls[0].idempotency_key: {"content": "ok"}}, None
        )
        if step_no == 25:  # the worker gives the task up (a crash, say) and takes it again
            journal.release("t", epoch)
            epoch = journal.claim("t", "w2", lease_s=60)
            assert epoch is not None
    task = journal.get_task("t")
    everything = step_views(shown_steps(task, journal.steps("t")), task_loop(task))
    for before in (12, 22, 26, 27, 40):
        page = read_timeline(journal, task, before=before, size=10)
        assert page.steps == everything[max(0, before - 10) : before]
        assert page.earlier == max(0, before - 10) and page.shown == 40
    live = read_timeline(journal, task, after=35)
    assert [view.step_no for view in live.steps] == [35, 36, 37, 38, 39]
    journal.close()
