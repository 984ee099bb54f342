"""structured/*: schema validation, field checks, and JSON that is ambiguous or not an object."""

from __future__ import annotations

import json

import pytest

from tether.envs.structured import KINDS, load_object, same, structured_environment


@pytest.mark.parametrize(
    "text",
    ['{"a": 1, "a": 2}', '{"a": NaN}', '{"a": Infinity}', "[1]", '"{}"', "{", "", "null"],
)
def test_only_unambiguous_json_objects_are_read(text: str) -> None:
    assert load_object(text) is None


@pytest.mark.parametrize(
    ("expected", "actual", "ok"),
    [
        (3, 3.0, True),
        (True, 1, False),
        (1, True, False),
        ("3", 3, False),
        ([1, 2], [2, 1], False),
        ({"a": [1, {"b": 2}]}, {"a": [1, {"b": 2}]}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        (0.1 + 0.2, 0.3, True),
    ],
)
def test_same_compares_json_values_strictly(expected: object, actual: object, ok: bool) -> None:
    assert same(expected, actual) is ok


async def test_components_separate_schema_fields_and_correctness() -> None:
    env = structured_environment("person")
    task = env.task(2)
    record = json.loads(task.reference)
    right_shape_wrong_age = {**record, "age": record["age"] + 1}
    score = await env.score(task, f"<answer>{json.dumps(right_shape_wrong_age)}</answer>")
    assert score.components["schema"] == 1.0
    assert score.components["fields"] == pytest.approx(5 / 6)
    assert score.components["correctness"] == 0.0 and score.total == 0.0


async def test_a_bad_email_fails_the_schema_format_check() -> None:
    env = structured_environment("person")
    task = env.task(2)
    record = {**json.loads(task.reference), "email": "not-an-email"}
    score = await env.score(task, f"<answer>{json.dumps(record)}</answer>")
    assert score.components["schema"] == 0.0


async def test_key_order_and_whitespace_do_not_matter() -> None:
    env = structured_environment("order")
    task = env.task(5)
    record = json.loads(task.reference)
    reordered = json.dumps(dict(reversed(list(record.items()))), indent=4)
    assert (await env.score(task, f"<answer>\n{reordered}\n</answer>")).total == 1.0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_value_of_the_record_appears_in_the_prompt(kind: str) -> None:
    env = structured_environment(kind)
    for seed in range(5):
        task = env.task(seed)
        prompt = task.messages[1]["content"]
        for value in json.loads(task.reference).values():
            if isinstance(value, str | int) and not isinstance(value, bool):
                assert str(value) in prompt, (kind, seed, value)
