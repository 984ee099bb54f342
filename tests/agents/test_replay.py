"""The pure replay rules: where a task stands after a crash and how each tool policy resolves a call."""

from __future__ import annotations

import pytest

from tether.agents.replay import (
    CallAction,
    Outcome,
    parse_arguments,
    plan_resume,
    resolve_call,
    step_outcome,
)
from tether.chat import ToolSpec
from tether.store.records import StepRecord, StepStatus, ToolCallRecord
from tether.tools import BUILTIN_TOOLS, FINISH, SHELL, ReplayPolicy, Tool


def call(
    step_no: int,
    index: int,
    tool: str = "shell",
    observation: dict | None = None,  # type: ignore[type-arg]
    runs: int = 1,
    arguments: dict | None = None,  # type: ignore[type-arg]
) -> ToolCallRecord:
    return ToolCallRecord(
        f"t:{step_no}:{index}", "t", step_no, index, tool, arguments or {}, 0.0, observation, None, runs
    )


def step(
    step_no: int,
    calls: tuple[ToolCallRecord, ...],
    committed: bool = True,
    snapshot: bool = False,
    role: str = "agent",
) -> StepRecord:
    return StepRecord(
        task_id="t",
        step_no=step_no,
        epoch=1,
        role=role,
        message={"role": "assistant", "content": f"s{step_no}"},
        usage={"prompt_tokens": 10, "completion_tokens": 5},
        messages_in=1,
        messages_in_digest="x",
        started_at=0.0,
        model_done_at=0.0,
        status=StepStatus.COMMITTED if committed else StepStatus.PLANNED,
        committed_at=1.0 if committed else None,
        snapshot_key=f"snap{step_no}" if snapshot else None,
        tool_calls=calls,
    )


OK = {"content": "status: ok", "error": False}
REFUSED = {"content": "bad arguments for shell", "error": True}


def test_a_fresh_task_starts_at_step_zero_from_its_initial_files() -> None:
    plan = plan_resume([], BUILTIN_TOOLS, "agent", {})
    assert (plan.next_step_no, plan.snapshot_key, plan.reapply, plan.pending, plan.ended) == (
        0,
        None,
        (),
        None,
        None,
    )


def test_resume_restores_the_newest_checkpoint_and_reapplies_later_workdir_calls_only() -> None:
    steps = [
        step(0, (call(0, 0, observation=OK),), snapshot=True),
        step(1, (call(1, 0, observation=OK), call(1, 1, "read_file", observation=OK))),
        step(2, (call(2, 0, "write_file", observation=OK), call(2, 1, observation=REFUSED, runs=0))),
        step(3, (call(3, 0),), committed=False),
    ]
    plan = plan_resume(steps, BUILTIN_TOOLS, "agent", {})
    assert plan.snapshot_key == "snap0"
    # read_file has no effect to rebuild, and the refused call never ran
    assert [c.idempotency_key for c in plan.reapply] == ["t:1:0", "t:2:0"]
    assert plan.pending is steps[3] and plan.next_step_no == 4


def test_a_task_whose_last_committed_step_finished_is_ended_without_a_model_call() -> None:
    steps = [step(0, (call(0, 0, "finish", observation={"content": "yay", "error": False}),), snapshot=True)]
    plan = plan_resume(steps, BUILTIN_TOOLS, "agent", {})
    assert plan.ended is not None and plan.ended.summary == "yay"


def test_a_failed_finish_does_not_end_the_task() -> None:
    refused = call(0, 0, "finish", observation=REFUSED)
    assert step_outcome(step(0, (refused,)), BUILTIN_TOOLS, ()).outcome is Outcome.CONTINUE


def test_a_gap_in_the_journal_is_an_invariant_violation() -> None:
    with pytest.raises(AssertionError, match="gap"):
        plan_resume([step(0, ()), step(2, ())], BUILTIN_TOOLS, "agent", {})


def external(policy: ReplayPolicy) -> Tool:
    return Tool(ToolSpec("pay", "pays", {"type": "object", "properties": {}}), FINISH.function, policy)


@pytest.mark.parametrize(
    ("tool", "observation", "runs", "action"),
    [
        (SHELL, OK, 1, CallAction.REUSE),
        (SHELL, None, 0, CallAction.EXECUTE),
        (SHELL, None, 3, CallAction.EXECUTE),  # effects died with the sandbox: run on restore
        (external(ReplayPolicy.EXTERNAL_IDEMPOTENT), None, 1, CallAction.EXECUTE),  # same key, deduplicated
        (external(ReplayPolicy.EXTERNAL_AT_MOST_ONCE), None, 0, CallAction.EXECUTE),  # never started
        (external(ReplayPolicy.EXTERNAL_AT_MOST_ONCE), None, 1, CallAction.OUTCOME_UNKNOWN),
        (external(ReplayPolicy.EXTERNAL_AT_MOST_ONCE), OK, 1, CallAction.REUSE),
        (None, None, 0, CallAction.EXECUTE),  # unknown tool: "executing" it yields an error observation
    ],
)
def test_each_policy_resolves_an_interrupted_call(
    tool: Tool | None, observation: dict | None, runs: int, action: CallAction
) -> None:  # type: ignore[type-arg]
    assert resolve_call(call(0, 0, observation=observation, runs=runs), tool) is action


def test_handoffs_move_the_task_between_roles_only_along_allowed_edges() -> None:
    handoff = call(
        0,
        0,
        "handoff",
        {"content": "handed off", "error": False},
        arguments={"to": "coder", "message": "do it"},
    )
    planned = step(0, (handoff,), role="planner")
    assert step_outcome(planned, BUILTIN_TOOLS, ("coder",)).outcome is Outcome.HANDOFF
    assert step_outcome(planned, BUILTIN_TOOLS, ("reviewer",)).outcome is Outcome.CONTINUE
    steps = [step(0, (handoff,), role="planner"), step(1, (call(1, 0, observation=OK),), role="coder")]
    assert plan_resume(steps, BUILTIN_TOOLS, "planner", {"planner": ("coder",)}).role == "coder"


def test_a_reply_without_tool_calls_is_the_final_answer() -> None:
    outcome = step_outcome(step(0, ()), BUILTIN_TOOLS, ())
    assert outcome.outcome is Outcome.FINISHED and outcome.summary == "s0"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ('{"a": "b"}', {"a": "b"}),
        ({"a": "b"}, {"a": "b"}),
        ("", {}),
        ("{not json", "arguments are not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        (42, "must be a JSON object, got int"),
    ],
)
def test_tool_arguments_are_parsed_or_explained(raw: object, expected: object) -> None:
    parsed = parse_arguments(raw)
    if isinstance(expected, dict):
        assert parsed == expected
    else:
        assert isinstance(parsed, str) and str(expected) in parsed
