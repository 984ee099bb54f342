"""`long/textkit`: a three-module text package (tokens, stats, wrap) from a seeded specification.

Seeded: whether apostrophes join words, the shortest word kept, how frequency ties are ordered, and
whether over-long words are broken when wrapping. `TextSpec` is the trusted implementation the
expected values come from; `reference_modules` is the same behaviour as files.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tether.envs.long_horizon.repo import RAISES_VALUE_ERROR, STUB, Repo

VOCABULARY = ["river", "stone", "it's", "a", "an", "ox", "don't", "lantern", "sky", "ice", "forge", "oak"]
PUNCTUATION = [",", ".", "!", "?", ";", " -", ""]


@dataclass(frozen=True, slots=True)
class TextSpec:
    apostrophes: bool  # "don't" is one word (else "don" and "t")
    min_length: int  # shorter words are dropped
    ties_alphabetical: bool  # else ties keep the order of first occurrence
    break_long: bool  # words longer than the width are cut into width-sized pieces (else own line)

    @property
    def pattern(self) -> str:
        return "[a-z]+(?:'[a-z]+)*" if self.apostrophes else "[a-z]+"

    def words(self, text: str) -> list[str]:
        return [w for w in re.findall(self.pattern, text.lower()) if len(w) >= self.min_length]

    def top(self, text: str, k: int) -> list[list[Any]]:
        words = self.words(text)
        counts = Counter(words)
        first = {w: i for i, w in reversed(list(enumerate(words)))}
        key = (lambda w: (-counts[w], w)) if self.ties_alphabetical else (lambda w: (-counts[w], first[w]))
        return [[w, counts[w]] for w in sorted(counts, key=key)[:k]]

    def mean_length(self, text: str) -> float:
        words = self.words(text)
        return round(sum(map(len, words)) / len(words), 2) if words else 0.0

    def wrap(self, text: str, width: int) -> list[str]:
        if width < 1:
            raise ValueError("width must be at least 1")
        pieces: list[str] = []
        for word in text.split():
            if self.break_long and len(word) > width:
                pieces.extend(word[i : i + width] for i in range(0, len(word), width))
            else:
                pieces.append(word)
        lines: list[str] = []
        for piece in pieces:
            if lines and len(lines[-1]) + 1 + len(piece) <= width:
                lines[-1] += " " + piece
            else:
                lines.append(piece)
        return lines

    def sample(self, rng: random.Random, count: int) -> str:
        words = []
        for _ in range(count):
            word = rng.choice([*VOCABULARY, "extraordinarily", "Lantern", "RIVER"])
            words.append(word + rng.choice(PUNCTUATION))
        return " ".join(words)


def readme(spec: TextSpec) -> str:
    word = (
        "a run of letters, optionally joined by single apostrophes to further runs of letters (`don't` "
        "is one word)"
        if spec.apostrophes
        else "a run of letters (`don't` is two words, `don` and `t`)"
    )
    ties = "alphabetically" if spec.ties_alphabetical else "by first occurrence in the text"
    long = (
        "cut into pieces of exactly `width` characters (the last piece may be shorter), each placed "
        "like a word"
        if spec.break_long
        else "placed alone on its own line, uncut"
    )
    return f"""# textkit

Small text utilities. Implement the three modules of the `textkit` package; keep the function names and
signatures. Only the standard library is available. Run the tests with
`python3 -m unittest discover -s tests -t .`.

## `textkit/tokens.py`: `words(text: str) -> list`

Lowercase the text, then return its words in order. A word is {word}; letters are ASCII `a`-`z`.
Words shorter than {spec.min_length} characters are dropped.

## `textkit/stats.py`

- `top(text: str, k: int) -> list`: the `k` most frequent words (as `words` finds them), as
  `[word, count]` pairs, most frequent first, ties ordered {ties}; fewer if there are fewer words.
- `mean_length(text: str) -> float`: the mean length of the words, rounded to 2 decimals with
  `round`; `0.0` when there are none.

## `textkit/wrap.py`: `wrap(text: str, width: int) -> list`

Split the text on whitespace (keep each piece as it is: case and punctuation stay), then fill lines
greedily: add the next piece to the current line, after one space, if the line stays within `width`
characters, else start a new line. A piece longer than `width` is {long}. Return the lines (an empty
list for blank text). Raise `ValueError` if `width` is less than 1.
"""


def reference_modules(spec: TextSpec) -> dict[str, str]:
    ties = "(-counts[w], w)" if spec.ties_alphabetical else "(-counts[w], first[w])"
    split = (
        "        if len(word) > width:\n"
        "            pieces.extend(word[i:i + width] for i in range(0, len(word), width))\n"
        "        else:\n"
        "            pieces.append(word)\n"
        if spec.break_long
        else "        pieces.append(word)\n"
    )
    return {
        "textkit/tokens.py": f'''"""Words of a text."""

import re


def words(text):
    return [w for w in re.findall({spec.pattern!r}, text.lower()) if len(w) >= {spec.min_length}]
''',
        "textkit/stats.py": f'''"""Word statistics."""

from collections import Counter

from textkit.tokens import words


def top(text, k):
    found = words(text)
    counts = Counter(found)
    first = {{}}
    for index, w in enumerate(found):
        first.setdefault(w, index)
    return [[w, counts[w]] for w in sorted(counts, key=lambda w: {ties})[:k]]


def mean_length(text):
    found = words(text)
    return round(sum(len(w) for w in found) / len(found), 2) if found else 0.0
''',
        "textkit/wrap.py": f'''"""Greedy line wrapping."""


def wrap(text, width):
    if width < 1:
        raise ValueError("width must be at least 1")
    pieces = []
    for word in text.split():
{split}    lines = []
    for piece in pieces:
        if lines and len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.append(piece)
    return lines
''',
    }


def visible_tests(spec: TextSpec, rng: random.Random) -> str:
    text = spec.sample(rng, 12)
    return f"""import unittest

from textkit.stats import mean_length, top
from textkit.tokens import words
from textkit.wrap import wrap


class TextkitTest(unittest.TestCase):
    def test_words(self):
        self.assertEqual(words({text!r}), {spec.words(text)!r})

    def test_top(self):
        self.assertEqual(top({text!r}, 2), {spec.top(text, 2)!r})

    def test_mean_length(self):
        self.assertEqual(mean_length({text!r}), {spec.mean_length(text)!r})

    def test_wrap(self):
        self.assertEqual(wrap({text!r}, 16), {spec.wrap(text, 16)!r})


if __name__ == "__main__":
    unittest.main()
"""


def hidden_tests(spec: TextSpec, rng: random.Random) -> str:
    tests = [RAISES_VALUE_ERROR]
    samples = [spec.sample(rng, rng.randint(5, 30)) for _ in range(4)] + ["", "Don't STOP, don't!"]
    for i, text in enumerate(samples):
        tests.append(f"def test_words_{i}(m):\n    assert m.tokens.words({text!r}) == {spec.words(text)!r}\n")
    for i, text in enumerate(samples[:4]):
        k = rng.randint(1, 5)
        tests.append(
            f"def test_top_{i}(m):\n    assert m.stats.top({text!r}, {k}) == {spec.top(text, k)!r}\n"
        )
    for i, text in enumerate(samples[2:]):
        tests.append(
            f"def test_mean_length_{i}(m):\n"
            f"    assert m.stats.mean_length({text!r}) == {spec.mean_length(text)!r}\n"
        )
    for i, text in enumerate(samples[:4]):
        width = rng.randint(6, 24)
        tests.append(
            f"def test_wrap_{i}(m):\n"
            f"    assert m.wrap.wrap({text!r}, {width}) == {spec.wrap(text, width)!r}\n"
        )
    tests.append("def test_wrap_blank(m):\n    assert m.wrap.wrap('   ', 10) == []\n")
    tests.append(
        "def test_wrap_rejects_width_0(m):\n    assert raises_value_error(lambda: m.wrap.wrap('a b', 0))\n"
    )
    long_text = "extraordinarily " + spec.sample(rng, 4)
    tests.append(
        f"def test_wrap_long_word(m):\n"
        f"    assert m.wrap.wrap({long_text!r}, 6) == {spec.wrap(long_text, 6)!r}\n"
    )
    return "\n\n".join(tests)


def textkit_repo(seed: int) -> Repo:
    rng = random.Random(f"long/textkit:{seed}")
    spec = TextSpec(
        apostrophes=rng.random() < 0.5,
        min_length=rng.randint(1, 3),
        ties_alphabetical=rng.random() < 0.5,
        break_long=rng.random() < 0.5,
    )
    files = {
        "README.md": readme(spec),
        "textkit/__init__.py": '"""Small text utilities."""\n',
        "textkit/tokens.py": STUB.format(doc="Words of a text.", name="words", args="text"),
        "textkit/stats.py": STUB.format(doc="Word statistics.", name="top", args="text, k")
        + "\n\ndef mean_length(text):\n    raise NotImplementedError\n",
        "textkit/wrap.py": STUB.format(doc="Greedy line wrapping.", name="wrap", args="text, width"),
        "tests/__init__.py": "",
        "tests/test_textkit.py": visible_tests(spec, rng),
    }
    protected = ["README.md", "tests/__init__.py", "tests/test_textkit.py"]
    return Repo("textkit", files, protected, hidden_tests(spec, rng), reference_modules(spec))
