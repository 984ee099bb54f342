"""Python function families over text: ciphers, run-length notations, key/value parsing and word counts.

Each `make_*` draws the family's parameters from the seed (a shift, a notation, separators, a tie-break),
so that two seeds of one family ask for different functions, not only different inputs; see
`py_families.py` for how expected outputs and references are made.
"""

from __future__ import annotations

import random
import string
from collections import Counter
from typing import Any

from tether.envs.code.families import FunctionTask, text, word

PRINTABLE = string.ascii_letters + string.digits + " .,!?-"


def make_caesar(rng: random.Random) -> FunctionTask:
    shift = rng.randint(1, 25)
    direction = rng.choice(["forward", "backward"])
    step = shift if direction == "forward" else -shift

    def solve(s: str) -> str:
        out = []
        for ch in s:
            if ch.isascii() and ch.isalpha():
                base = ord("a") if ch.islower() else ord("A")
                out.append(chr((ord(ch) - base + step) % 26 + base))
            else:
                out.append(ch)
        return "".join(out)

    calls: list[list[Any]] = [
        ["Hello, World!"],
        [""],
        *([text(rng, PRINTABLE, 1, 40)] for _ in range(14)),
        ["zZaA"],
    ]
    reference = (
        "def shift_letters(s: str) -> str:\n"
        "    out = []\n"
        "    for ch in s:\n"
        "        if ch.isascii() and ch.isalpha():\n"
        "            base = ord('a') if ch.islower() else ord('A')\n"
        f"            out.append(chr((ord(ch) - base + ({step})) % 26 + base))\n"
        "        else:\n"
        "            out.append(ch)\n"
        "    return ''.join(out)\n"
    )
    mutant = reference.replace("base = ord('a') if ch.islower() else ord('A')", "base = ord('a')")
    return FunctionTask(
        entry="shift_letters",
        signature="def shift_letters(s: str) -> str",
        description=(
            f"Shift every ASCII letter of `s` {shift} places {direction} in the alphabet, wrapping around "
            "(z to a, a to z) and keeping its case; every other character stays as it is."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_rle(rng: random.Random) -> FunctionTask:
    count_first = rng.random() < 0.5
    omit_ones = rng.random() < 0.5

    def piece(ch: str, n: int) -> str:
        if n == 1 and omit_ones:
            return ch
        return f"{n}{ch}" if count_first else f"{ch}{n}"

    def solve(s: str) -> str:
        out, i = [], 0
        while i < len(s):
            j = i
            while j < len(s) and s[j] == s[i]:
                j += 1
            out.append(piece(s[i], j - i))
            i = j
        return "".join(out)

    calls: list[list[Any]] = [["aaabccdddd"], [""], ["x"], *([text(rng, "aabbbc", 1, 30)] for _ in range(13))]
    fmt = "f'{n}{ch}'" if count_first else "f'{ch}{n}'"
    single = "ch if n == 1 else " if omit_ones else ""
    reference = (
        "def run_length(s: str) -> str:\n"
        "    out, i = [], 0\n"
        "    while i < len(s):\n"
        "        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n"
        "            j += 1\n"
        "        ch, n = s[i], j - i\n"
        f"        out.append({single}{fmt})\n"
        "        i = j\n"
        "    return ''.join(out)\n"
    )
    mutant = reference.replace(
        "while j < len(s) and s[j] == s[i]:", "while j < len(s) and s[j] == s[i] and j - i < 2:"
    )
    order = "the count followed by the character" if count_first else "the character followed by the count"
    ones = (
        "A run of length 1 is written as the character alone."
        if omit_ones
        else "Runs of length 1 keep their count."
    )
    return FunctionTask(
        entry="run_length",
        signature="def run_length(s: str) -> str",
        description=f"Run-length encode `s`: each maximal run of one character becomes {order}. {ones}",
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_kv(rng: random.Random) -> FunctionTask:
    pair_sep = rng.choice([";", ",", "&", "|"])
    kv_sep = rng.choice(["=", ":"])

    def solve(s: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in s.split(pair_sep):
            if not part.strip():
                continue
            key, _, value = part.partition(kv_sep)
            out[key.strip()] = int(value.strip())
        return out

    def sample() -> str:
        parts = []
        for _ in range(rng.randint(0, 6)):
            pads = [" " * rng.randint(0, 2) for _ in range(4)]
            key, value = word(rng, "abcxyz", 1, 3), rng.randint(-99, 999)
            parts.append(f"{pads[0]}{key}{pads[1]}{kv_sep}{pads[2]}{value}{pads[3]}")
            if rng.random() < 0.2:
                parts.append(" ")
        return pair_sep.join(parts)

    calls: list[list[Any]] = [
        [f"a{kv_sep}1{pair_sep} b {kv_sep} 22 {pair_sep}a{kv_sep}-3"],
        [""],
        *([sample()] for _ in range(14)),
    ]
    reference = (
        "def parse_pairs(s: str) -> dict[str, int]:\n"
        "    out = {}\n"
        f"    for part in s.split({pair_sep!r}):\n"
        "        if not part.strip():\n"
        "            continue\n"
        f"        key, _, value = part.partition({kv_sep!r})\n"
        "        out[key.strip()] = int(value.strip())\n"
        "    return out\n"
    )
    mutant = reference.replace(
        "out[key.strip()] = int(value.strip())", "out.setdefault(key.strip(), int(value))"
    )
    return FunctionTask(
        entry="parse_pairs",
        signature="def parse_pairs(s: str) -> dict[str, int]",
        description=(
            f"Parse `s`, a list of `key{kv_sep}value` pairs separated by {pair_sep!r}, into a dict from key "
            "to integer value. Ignore spaces around keys and values and skip empty (or blank) entries; "
            "when a key repeats, the last value wins."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_top_words(rng: random.Random) -> FunctionTask:
    k = rng.randint(2, 4)
    vocabulary = [word(rng, "abcdefgh", 2, 4) for _ in range(6)]

    def solve(s: str) -> list[list[object]]:
        counts = Counter(s.lower().split())
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [[w, n] for w, n in ranked]

    def sample() -> str:
        words = [rng.choice(vocabulary) for _ in range(rng.randint(0, 25))]
        return " ".join(w.upper() if rng.random() < 0.2 else w for w in words)

    calls: list[list[Any]] = [["the cat and The dog and THE bird"], [""], *([sample()] for _ in range(14))]
    reference = (
        "from collections import Counter\n\n\n"
        "def top_words(s: str) -> list[list]:\n"
        "    counts = Counter(s.lower().split())\n"
        f"    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:{k}]\n"
        "    return [[w, n] for w, n in ranked]\n"
    )
    mutant = reference.replace("key=lambda item: (-item[1], item[0])", "key=lambda item: -item[1]")
    return FunctionTask(
        entry="top_words",
        signature="def top_words(s: str) -> list[list]",
        description=(
            f"Split `s` on whitespace, lowercase the words, and return the {k} most frequent as "
            "[word, count] pairs, most frequent first, ties broken alphabetically (fewer if there are "
            "fewer distinct words)."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )
