"""Python function families: lists, math, intervals, dynamic programming and grids (text ones in
`py_text_families.py`), and the registry of them all, `PYTHON_FAMILIES`.

Each `make_*` draws the family's parameters from the seed (a shift, a base, separators, a connectivity),
so that two seeds of one family ask for different functions, not only different inputs. The expected
outputs come from `solve`, a trusted Python implementation run here; the reference source is the same
algorithm as text, and the test suite proves the two agree by scoring the reference in the sandbox.
"""

from __future__ import annotations

import math
import random
from typing import Any

from tether.envs.code.families import Family, FunctionTask, Lang, ints
from tether.envs.code.py_text_families import make_caesar, make_kv, make_rle, make_top_words


def make_rotate(rng: random.Random) -> FunctionTask:
    right = rng.random() < 0.5

    def solve(xs: list[int], k: int) -> list[int]:
        if not xs:
            return []
        k %= len(xs)
        if right:
            return xs[-k:] + xs[:-k] if k else list(xs)
        return xs[k:] + xs[:k]

    calls: list[list[Any]] = [[[1, 2, 3, 4, 5], 2], [[], 3], [[7], 100]]
    calls += [[ints(rng, rng.randint(1, 12), -50, 50), rng.randint(0, 40)] for _ in range(13)]
    body = "xs[-k:] + xs[:-k] if k else list(xs)" if right else "xs[k:] + xs[:k]"
    reference = (
        "def rotate(xs: list[int], k: int) -> list[int]:\n"
        "    if not xs:\n"
        "        return []\n"
        "    k %= len(xs)\n"
        f"    return {body}\n"
    )
    mutant = reference.replace("    k %= len(xs)\n", "    k = min(k, len(xs))\n")
    side = (
        "right (the last element moves to the front)"
        if right
        else "left (the first element moves to the end)"
    )
    return FunctionTask(
        entry="rotate",
        signature="def rotate(xs: list[int], k: int) -> list[int]",
        description=(
            f"Return a new list: `xs` rotated {side} by `k` steps. `k` may exceed the length; an empty "
            "list stays empty. Do not modify `xs`."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_window(rng: random.Random) -> FunctionTask:
    width = rng.randint(2, 5)

    def solve(xs: list[int]) -> int | None:
        if len(xs) < width:
            return None
        return max(sum(xs[i : i + width]) for i in range(len(xs) - width + 1))

    calls: list[list[Any]] = [[[1, -2, 3, 10, -4, 7, 2, -5]], [[1] * (width - 1)], [[2] * width]]
    calls.append([list(range(1, width + 4))])  # the best window is the last one
    calls += [[ints(rng, rng.randint(width - 1, 20), -30, 30)] for _ in range(14)]
    reference = (
        "def best_window(xs: list[int]) -> int | None:\n"
        f"    w = {width}\n"
        "    if len(xs) < w:\n"
        "        return None\n"
        "    return max(sum(xs[i:i + w]) for i in range(len(xs) - w + 1))\n"
    )
    mutant = reference.replace("range(len(xs) - w + 1)", "range(len(xs) - w)").replace(
        "    if len(xs) < w:\n", "    if len(xs) <= w:\n"
    )
    return FunctionTask(
        entry="best_window",
        signature="def best_window(xs: list[int]) -> int | None",
        description=(
            f"Return the largest sum of {width} consecutive elements of `xs`, or None when `xs` has fewer "
            f"than {width} elements."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_primes(rng: random.Random) -> FunctionTask:
    modulus = rng.randint(3, 10)
    # Coprime residues hold infinitely many primes (Dirichlet), so no seed asks for an always-0 count.
    residue = rng.choice([r for r in range(1, modulus) if math.gcd(r, modulus) == 1])

    def is_prime(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    def solve(lo: int, hi: int) -> int:
        return sum(1 for n in range(lo, hi + 1) if is_prime(n) and n % modulus == residue)

    first = next(n for n in range(2, 1000) if is_prime(n) and n % modulus == residue)
    calls: list[list[Any]] = [[1, 30], [10, 10], [20, 10], [-5, 2], [first, first], [0, first]]
    for _ in range(12):
        lo = rng.randint(-10, 500)
        calls.append([lo, lo + rng.randint(0, 400)])
    reference = (
        "def count_primes(lo: int, hi: int) -> int:\n"
        "    def is_prime(n):\n"
        "        if n < 2:\n"
        "            return False\n"
        "        d = 2\n"
        "        while d * d <= n:\n"
        "            if n % d == 0:\n"
        "                return False\n"
        "            d += 1\n"
        "        return True\n"
        f"    return sum(1 for n in range(lo, hi + 1) if is_prime(n) and n % {modulus} == {residue})\n"
    )
    mutant = reference.replace("range(lo, hi + 1)", "range(lo, hi)")
    return FunctionTask(
        entry="count_primes",
        signature="def count_primes(lo: int, hi: int) -> int",
        description=(
            f"Count the primes p with lo <= p <= hi and p % {modulus} == {residue}. If lo > hi the answer "
            "is 0."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_base(rng: random.Random) -> FunctionTask:
    base = rng.choice([2, 3, 5, 7, 8, 9, 11, 12, 13, 16, 20, 36])
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"

    def solve(n: int) -> str:
        if n == 0:
            return "0"
        sign, n = ("-", -n) if n < 0 else ("", n)
        out = []
        while n:
            n, r = divmod(n, base)
            out.append(digits[r])
        return sign + "".join(reversed(out))

    calls: list[list[Any]] = [[255], [0], [-base], *([rng.randint(-(10**9), 10**9)] for _ in range(13))]
    reference = (
        "def to_base(n: int) -> str:\n"
        "    digits = '0123456789abcdefghijklmnopqrstuvwxyz'\n"
        "    if n == 0:\n"
        "        return '0'\n"
        "    sign, n = ('-', -n) if n < 0 else ('', n)\n"
        "    out = []\n"
        "    while n:\n"
        f"        n, r = divmod(n, {base})\n"
        "        out.append(digits[r])\n"
        "    return sign + ''.join(reversed(out))\n"
    )
    mutant = reference.replace(
        "    sign, n = ('-', -n) if n < 0 else ('', n)\n", "    sign, n = '', abs(n)\n"
    )
    return FunctionTask(
        entry="to_base",
        signature="def to_base(n: int) -> str",
        description=(
            f"Write the integer `n` in base {base}, using digits 0-9 then lowercase letters a-z, with a "
            "leading '-' for negative numbers and no leading zeros ('0' for zero)."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_intervals(rng: random.Random) -> FunctionTask:
    touching = rng.random() < 0.5

    def solve(spans: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = []
        for lo, hi in sorted(spans):
            if out and (lo <= out[-1][1] if touching else lo < out[-1][1]):
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        return out

    def sample() -> list[list[int]]:
        spans = []
        for _ in range(rng.randint(0, 8)):
            lo = rng.randint(0, 40)
            spans.append([lo, lo + rng.randint(1, 8)])
        return spans

    calls: list[list[Any]] = [[[[1, 3], [2, 6], [8, 10], [10, 12]]], [[]], *([sample()] for _ in range(14))]
    cmp = "<=" if touching else "<"
    reference = (
        "def merge(spans: list[list[int]]) -> list[list[int]]:\n"
        "    out = []\n"
        "    for lo, hi in sorted(spans):\n"
        f"        if out and lo {cmp} out[-1][1]:\n"
        "            out[-1][1] = max(out[-1][1], hi)\n"
        "        else:\n"
        "            out.append([lo, hi])\n"
        "    return out\n"
    )
    mutant = reference.replace("sorted(spans)", "spans")
    rule = (
        "Intervals that only touch ([1, 2] and [2, 3]) are merged too."
        if touching
        else ("Intervals that only touch ([1, 2] and [2, 3]) stay separate.")
    )
    return FunctionTask(
        entry="merge",
        signature="def merge(spans: list[list[int]]) -> list[list[int]]",
        description=(
            "Each element of `spans` is [lo, hi] with lo < hi. Merge overlapping intervals and return them "
            f"as [lo, hi] lists sorted by lo. {rule}"
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_lis(rng: random.Random) -> FunctionTask:
    strict = rng.random() < 0.5

    def solve(xs: list[int]) -> int:
        best = [1] * len(xs)
        for i in range(len(xs)):
            for j in range(i):
                if xs[j] < xs[i] or (not strict and xs[j] == xs[i]):
                    best[i] = max(best[i], best[j] + 1)
        return max(best, default=0)

    calls: list[list[Any]] = [[[3, 1, 4, 1, 5, 9, 2, 6]], [[]], [[2, 2, 2]]]
    calls += [[ints(rng, rng.randint(1, 16), 0, 9)] for _ in range(13)]
    cmp = "xs[j] < xs[i]" if strict else "xs[j] <= xs[i]"
    reference = (
        "def longest_run(xs: list[int]) -> int:\n"
        "    best = [1] * len(xs)\n"
        "    for i in range(len(xs)):\n"
        "        for j in range(i):\n"
        f"            if {cmp}:\n"
        "                best[i] = max(best[i], best[j] + 1)\n"
        "    return max(best, default=0)\n"
    )
    mutant = reference.replace("for j in range(i):", "for j in range(max(0, i - 1), i):")
    kind = "strictly increasing" if strict else "non-decreasing"
    return FunctionTask(
        entry="longest_run",
        signature="def longest_run(xs: list[int]) -> int",
        description=(
            f"Return the length of the longest {kind} subsequence of `xs` (not necessarily contiguous); "
            "0 for an empty list."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


def make_islands(rng: random.Random) -> FunctionTask:
    diagonal = rng.random() < 0.5
    steps = [(-1, 0), (1, 0), (0, -1), (0, 1)] + ([(-1, -1), (-1, 1), (1, -1), (1, 1)] if diagonal else [])

    def solve(grid: list[str]) -> int:
        seen: set[tuple[int, int]] = set()
        count = 0
        for r, row in enumerate(grid):
            for c, cell in enumerate(row):
                if cell != "#" or (r, c) in seen:
                    continue
                count += 1
                stack = [(r, c)]
                seen.add((r, c))
                while stack:
                    y, x = stack.pop()
                    for dy, dx in steps:
                        ny, nx = y + dy, x + dx
                        inside = 0 <= ny < len(grid) and 0 <= nx < len(grid[ny])
                        if inside and grid[ny][nx] == "#" and (ny, nx) not in seen:
                            seen.add((ny, nx))
                            stack.append((ny, nx))
        return count

    def sample() -> list[str]:
        height, width = rng.randint(1, 8), rng.randint(1, 10)
        return ["".join("#" if rng.random() < 0.4 else "." for _ in range(width)) for _ in range(height)]

    calls: list[list[Any]] = [[["##..", "#..#", "..#.", "...."]], [[]], *([sample()] for _ in range(14))]
    reference = (
        "def islands(grid: list[str]) -> int:\n"
        f"    steps = {steps!r}\n"
        "    seen, count = set(), 0\n"
        "    for r, row in enumerate(grid):\n"
        "        for c, cell in enumerate(row):\n"
        "            if cell != '#' or (r, c) in seen:\n"
        "                continue\n"
        "            count += 1\n"
        "            stack = [(r, c)]\n"
        "            seen.add((r, c))\n"
        "            while stack:\n"
        "                y, x = stack.pop()\n"
        "                for dy, dx in steps:\n"
        "                    ny, nx = y + dy, x + dx\n"
        "                    if 0 <= ny < len(grid) and 0 <= nx < len(grid[ny]) and grid[ny][nx] == '#':\n"
        "                        if (ny, nx) not in seen:\n"
        "                            seen.add((ny, nx))\n"
        "                            stack.append((ny, nx))\n"
        "    return count\n"
    )
    other = [(-1, 0), (1, 0), (0, -1), (0, 1)] + ([] if diagonal else [(-1, -1), (-1, 1), (1, -1), (1, 1)])
    mutant = reference.replace(f"steps = {steps!r}", f"steps = {other!r}")
    rule = "8-connected (diagonal neighbours count)" if diagonal else "4-connected (no diagonals)"
    return FunctionTask(
        entry="islands",
        signature="def islands(grid: list[str]) -> int",
        description=(
            f"`grid` is a list of rows made of '#' (land) and '.' (water). Count the islands: maximal "
            f"{rule} groups of '#' cells."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
    )


PYTHON_FAMILIES = (
    Family("py-caesar", Lang.PYTHON, "shift letters by a seeded amount and direction", make_caesar),
    Family("py-rle", Lang.PYTHON, "run-length encoding in a seeded notation", make_rle),
    Family("py-rotate", Lang.PYTHON, "rotate a list left or right", make_rotate),
    Family("py-window", Lang.PYTHON, "best sum of a fixed-width window", make_window),
    Family("py-primes", Lang.PYTHON, "count primes in a residue class", make_primes),
    Family("py-base", Lang.PYTHON, "write integers in a seeded base", make_base),
    Family("py-kv", Lang.PYTHON, "parse key/value pairs with seeded separators", make_kv),
    Family("py-intervals", Lang.PYTHON, "merge intervals, touching or not", make_intervals),
    Family("py-topwords", Lang.PYTHON, "top-k word counts with tie-breaking", make_top_words),
    Family("py-lis", Lang.PYTHON, "longest increasing subsequence", make_lis),
    Family("py-islands", Lang.PYTHON, "count connected regions in a grid", make_islands),
)
