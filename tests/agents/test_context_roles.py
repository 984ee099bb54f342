"""Context building (stable prefix, digest of older steps) and role selection from configuration."""

from __future__ import annotations

import pytest

from tests.agents.test_replay import OK, call, step
from tether.agents.context import build_messages, folded_count
from tether.agents.roles import select_roles
from tether.agents.task import ContextSpec, RoleSpec, TaskSpec
from tether.errors import ConfigError


@pytest.mark.parametrize(
    ("total", "recent", "folded"), [(0, 4, 0), (4, 4, 0), (7, 4, 0), (8, 4, 4), (11, 4, 4), (12, 4, 8)]
)
def test_older_steps_fold_in_whole_blocks(total: int, recent: int, folded: int) -> None:
    assert folded_count(total, recent) == folded


def test_the_prefix_stays_identical_between_folds() -> None:
    spec = TaskSpec(goal="g", context=ContextSpec(recent_steps=4))
    steps = [step(n, (call(n, 0, observation={"content": f"out{n}", "error": False}),)) for n in range(12)]
    at_9 = build_messages(spec, spec.roles[0], steps[:9])
    at_11 = build_messages(spec, spec.roles[0], steps[:11])
    assert at_9[:3] == at_11[:3]  # system prompt, task header and digest are byte-identical
    assert "Earlier steps" in at_9[2]["content"] and "out3" in at_9[2]["content"]
    assert at_11[3:] and all("out2" not in str(m.get("content")) for m in at_11[3:])
    assert len(build_messages(spec, spec.roles[0], steps)) == 3 + 4 * 2  # digest of 8, then 4 steps verbatim


def test_long_observations_are_cut_in_the_middle() -> None:
    spec = TaskSpec(goal="g", context=ContextSpec(observation_chars=100))
    messages = build_messages(
        spec, spec.roles[0], [step(0, (call(0, 0, observation={"content": "x" * 1000, "error": False}),))]
    )
    assert "characters cut" in messages[-1]["content"] and len(messages[-1]["content"]) < 200


def test_role_presets_wire_the_planner_coder_reviewer_loop() -> None:
    planner, coder, reviewer = select_roles("planner,coder,reviewer")
    assert (planner.hands_off_to, coder.hands_off_to, reviewer.hands_off_to) == (
        ("coder",),
        ("reviewer",),
        ("coder",),
    )
    assert "finish" in reviewer.tools and "finish" not in coder.tools
    (alone,) = select_roles("coder")
    assert alone.hands_off_to == () and "finish" in alone.tools and "handoff" not in alone.tools


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ("planner,hacker", "unknown role"),
        ("planer,coder", r"unknown role\(s\) \['planer'\]; did you mean 'planner'\?"),
        ("", "unknown role"),
        ("coder,coder", "named twice"),
    ],
)
def test_bad_role_lists_are_rejected(names: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        select_roles(names)


def test_a_handoff_to_a_missing_role_is_a_spec_error() -> None:
    with pytest.raises(ValueError, match="'a' hands off to 'b', which is not a role"):
        TaskSpec(goal="g", roles=(RoleSpec(name="a", hands_off_to=("b",)),))


def test_observations_reference_their_calls_by_id() -> None:
    spec = TaskSpec(goal="g")
    s = step(0, (call(0, 0, observation=OK),))
    s = type(s)(
        **{
            **{f: getattr(s, f) for f in s.__dataclass_fields__},
            "message": {"role": "assistant", "tool_calls": [{"id": "abc"}]},
        }
    )
    messages = build_messages(spec, spec.roles[0], [s])
    assert messages[-1]["tool_call_id"] == "abc" and messages[-1]["role"] == "tool"
