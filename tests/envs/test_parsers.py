"""The `<answer>` convention: one answer is read back, several different ones are refused."""

from __future__ import annotations

import pytest

from tether.envs.parsers import ANSWER_TAG, TagParser
from tether.envs.tasks import Parsed


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>42</answer>", Parsed("42", True)),
        ("Reasoning...\n<answer>\n 42 \n</answer>", Parsed("42", True)),
        ("<answer>a\nb</answer>", Parsed("a\nb", True)),
        ("<answer>42</answer> and again <answer>42</answer>", Parsed("42", False)),
        ("<answer>41</answer><answer>42</answer>", Parsed(None, False)),
        ("42", Parsed(None, False)),
        ("<answer>42", Parsed(None, False)),
        ("<answer><answer>42</answer>", Parsed("<answer>42", False)),
        ("<ANSWER>42</ANSWER>", Parsed(None, False)),
        ("", Parsed(None, False)),
    ],
)
def test_tag_parser(completion: str, expected: Parsed) -> None:
    assert ANSWER_TAG.parse(completion) == expected


def test_format_round_trips_and_the_instructions_show_the_tag() -> None:
    parser = TagParser("final")
    assert parser.parse(parser.format("x y")) == Parsed("x y", True)
    assert "<final>" in parser.instructions


@pytest.mark.parametrize("tag", ["", "Answer", "a b", "x>"])
def test_bad_tags_are_refused(tag: str) -> None:
    with pytest.raises(ValueError, match="tag"):
        TagParser(tag)
