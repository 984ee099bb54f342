"""Loop detection: the pure policy over steps, what the model is shown, and a runner driving a model that
repeats itself (the default model's habit), crash and resume included."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from tests.agents.scripts import scripted
from tests.agents.test_runner import FailingModel, runner_for
from tether.agents.context import build_messages
from tether.agents.loops import LoopMark, last_mark, loop_marks
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import LoopSpec, TaskSpec
from tether.chat import ChatRequest, Completion
from tether.chat.completion import ModelError
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import StepRecord, StepStatus, TaskStatus, ToolCallRecord, messages_digest


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentStack]:
    opened = AgentStack(replace(AgentsConfig.embedded(tmp_path / "agents"), lease_s=2))
    yield opened
    await opened.close()


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as running:
        yield running


def step(step_no: int, content: str, calls: tuple[tuple[str, dict[str, str]], ...] = ()) -> StepRecord:
    return StepRecord(
        task_id="t",
        step_no=step_no,
        epoch=1,
        role="agent",
        message={"role": "assistant", "content": content},
        usage={},
        messages_in=0,
        messages_in_digest="",
        started_at=0.0,
        model_done_at=0.0,
        status=StepStatus.COMMITTED,
        committed_at=0.0,
        tool_calls=tuple(
            ToolCallRecord(f"t:{step_no}:{i}", "t", step_no, i, name, dict(args), 0.0, observation={})
            for i, (name, args) in enumerate(calls)
        ),
    )


def verdicts(marks: list[LoopMark | None]) -> list[str]:
    return ["-" if mark is None else "stop" if mark.stop else f"nudge{mark.nudge}" for mark in marks]


def test_identical_replies_are_nudged_then_stopped() -> None:
    steps = [step(n, "def reverse(s): return s[::-1]") for n in range(6)]
    marks = loop_marks(steps, LoopSpec())  # 3 repeats before a nudge, 2 nudges before stopping
    assert verdicts(marks) == ["-", "-", "nudge1", "nudge2", "stop", "stop"]
    assert marks[2] is not None and marks[2].describe() == (
        "nudged (1 of 2): the same reply 3 times in a row"
    )
    assert (
        marks[4] is not None and "same reply 5 times in a row and ignored 2 nudge(s)" in marks[4].describe()
    )


def test_the_same_tool_call_in_other_words_repeats_and_other_arguments_do_not() -> None:
    run = ("shell", {"command": "python test.py"})
    steps = [step(0, "let me run it", (run,)), step(1, "again", (run,)), step(2, "once more", (run,))]
    assert verdicts(loop_marks(steps, LoopSpec())) == ["-", "-", "nudge1"]
    steps[1] = step(1, "again", (("shell", {"command": "python -m pytest"}),))
    assert verdicts(loop_marks(steps, LoopSpec())) == ["-", "-", "-"]


def test_a_different_step_starts_the_count_again() -> None:
    texts = ["a", "a", "a", "b", "a", "a", "a", "a"]
    marks = loop_marks([step(n, text) for n, text in enumerate(texts)], LoopSpec())
    assert verdicts(marks) == ["-", "-", "nudge1", "-", "-", "-", "nudge1", "nudge2"]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (LoopSpec(repeats_before_nudge=2, nudges_before_stop=0), ["-", "stop", "stop", "stop"]),
        (LoopSpec(repeats_before_nudge=2, nudges_before_stop=1), ["-", "nudge1", "stop", "stop"]),
        (LoopSpec(repeats_before_nudge=5), ["-", "-", "-", "-"]),
    ],
)
def test_the_policy_is_configurable(policy: LoopSpec, expected: list[str]) -> None:
    assert verdicts(loop_marks([step(n, "same") for n in range(4)], policy)) == expected


@pytest.mark.parametrize("texts", [[], ["a"], ["a", "b"], ["a", "a", "a"], ["b", "a", "a", "a", "a", "a"]])
def test_the_newest_mark_alone_agrees_with_all_marks(texts: list[str]) -> None:
    steps = [step(n, text) for n, text in enumerate(texts)]
    assert last_mark(steps, LoopSpec()) == (loop_marks(steps, LoopSpec()) or [None])[-1]


@pytest.mark.parametrize(
    ("field", "value"), [("repeats_before_nudge", 1), ("nudges_before_stop", -1), ("colour", 3)]
)
def test_bad_loop_settings_are_refused(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        TaskSpec.model_validate({"goal": "g", "loop": {field: value}})


def test_the_model_reads_each_nudge_right_after_the_step_it_follows() -> None:
    spec = TaskSpec(goal="g")
    steps = [step(n, "same") for n in range(4)]
    messages = build_messages(spec, spec.roles[0], steps)
    nudges = [i for i, m in enumerate(messages) if "same reply" in str(m["content"])]
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert nudges == [replies[2] + 1, replies[3] + 1]
    assert "same reply 3 times in a row" in messages[nudges[0]]["content"]
    assert messages[nudges[0]]["role"] == "user"
    assert "Warning 2 of 2" in messages[nudges[1]]["content"]


class Recording:
    """Remembers every request the model was sent."""

    def __init__(self, inner: object) -> None:
        self.inner, self.name, self.requests = inner, "recording", list[ChatRequest]()

    async def complete(self, request: ChatRequest) -> Completion:
        self.requests.append(request)
        return await self.inner.complete(request)  # type: ignore[attr-defined,no-any-return]

    async def close(self) -> None:
        return None


def repeating_script(path: Path, times: int = 50) -> Path:
    reply = {
        "content": "def reverse(s):\n    return s[::-1]"
    }  # talks, never acts: what the default model did
    path.write_text((json.dumps(reply) + "\n") * times)
    return path


async def test_a_model_repeating_itself_is_nudged_and_then_stopped_long_before_its_budget(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    model = Recording(scripted(repeating_script(tmp_path / "repeat.jsonl")))
    task_id = await stack.submit(TaskSpec(goal="write a reverse function", require_finish=True))
    assert await runner_for(stack, pool, model).run(task_id) is TaskStatus.FAILED
    task = stack.journal.get_task(task_id)
    assert task.error is not None and task.error.startswith(
        "stopped: the model sent the same reply 5 times in a row and ignored 2 nudge(s)"
    )
    steps = stack.journal.steps(task_id)
    assert len(steps) == 5 and len(model.requests) == 5  # not 50
    seen = [[m["content"] for m in r.messages if "same reply" in str(m["content"])] for r in model.requests]
    assert [len(nudges) for nudges in seen] == [0, 0, 0, 1, 2]  # the nudges after steps 2 and 3


async def test_loop_nudges_replay_identically_after_a_crash(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    script = repeating_script(tmp_path / "repeat.jsonl")
    spec = TaskSpec(goal="g", require_finish=True)
    clean_id = await stack.submit(spec)
    await runner_for(stack, pool, scripted(script)).run(clean_id)
    crashy_id = await stack.submit(spec)
    flaky = FailingModel(scripted(script), fail_at=4)  # dies at the step after the second nudge
    runner = runner_for(stack, pool, flaky)
    with pytest.raises(ModelError):
        await runner.run(crashy_id)
    assert len(stack.journal.steps(crashy_id)) == 4
    assert await runner.run(crashy_id) is TaskStatus.FAILED
    clean, resumed = stack.journal.steps(clean_id), stack.journal.steps(crashy_id)
    assert [s.messages_in_digest for s in resumed] == [s.messages_in_digest for s in clean]
    assert stack.journal.get_task(crashy_id).error == stack.journal.get_task(clean_id).error
    for number, journaled in enumerate(resumed):  # what the model saw is derivable from the journal
        rebuilt = build_messages(spec, spec.roles[0], resumed[:number])
        assert messages_digest(rebuilt) == journaled.messages_in_digest
