"""C and C++ function families: integers and arrays in C; strings, vectors and booleans in C++.

Same shape as the Python families (`families.py`); `native.py` compiles each answer with a driver.
The Python `solve` of each family is the trusted implementation the expected values come from.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from tether.envs.code.families import Family, FunctionTask, Lang, ints, text

# --- C families ----------------------------------------------------------------------------------------


def make_c_digits(rng: random.Random) -> FunctionTask:
    base = rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16])

    def solve(n: int) -> int:
        total = 0
        while n:
            n, r = divmod(n, base)
            total += r
        return total

    calls: list[list[Any]] = [[255], [0], [base], *([rng.randint(0, 10**17)] for _ in range(13))]
    reference = (
        "long long digit_sum(long long n) {\n"
        "    long long total = 0;\n"
        f"    while (n > 0) {{ total += n % {base}; n /= {base}; }}\n"
        "    return total;\n}\n"
    )
    return FunctionTask(
        entry="digit_sum",
        signature="long long digit_sum(long long n)",
        description=f"Return the sum of the digits of `n` (n >= 0) written in base {base}.",
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=reference.replace(f"n % {base}", "n % 10"),
        arg_kinds=("int",),
        returns="int",
    )


def make_c_max_subarray(rng: random.Random) -> FunctionTask:
    allow_empty = rng.random() < 0.5

    def solve(xs: list[int]) -> int:
        best = 0 if allow_empty else max(xs)
        current = 0
        for x in xs:
            current = max(x, current + x)
            best = max(best, current)
        return best

    calls: list[list[Any]] = [[[2, -3, 4, -1, 2, 1, -5, 4]], [[-4, -2, -7]], [[5]]]
    calls += [[ints(rng, rng.randint(1, 40), -20, 15)] for _ in range(13)]
    start = "0" if allow_empty else "a[0]"
    reference = (
        "long long max_subarray(const int *a, int n) {\n"
        f"    long long best = {start}, current = 0;\n"
        "    for (int i = 0; i < n; i++) {\n"
        "        current = current + a[i] > a[i] ? current + a[i] : a[i];\n"
        "        if (current > best) best = current;\n"
        "    }\n    return best;\n}\n"
    )
    mutant = reference.replace(f"best = {start},", f"best = {'a[0]' if allow_empty else '0'},")
    rule = "The empty subarray is allowed (sum 0)." if allow_empty else "The subarray must be non-empty."
    return FunctionTask(
        entry="max_subarray",
        signature="long long max_subarray(const int *a, int n)",
        description=f"Return the largest sum of a contiguous subarray of the n >= 1 elements of `a`. {rule}",
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
        arg_kinds=("int_list",),
        returns="int",
    )


def make_c_pairs(rng: random.Random) -> FunctionTask:
    factor = rng.randint(1, 3)

    def solve(xs: list[int]) -> int:
        return sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[i] > factor * xs[j])

    calls: list[list[Any]] = [[[5, 1, 4, 2, 3]], [[]], [[3, 3, 3]]]
    calls += [[ints(rng, rng.randint(0, 60), -50, 50)] for _ in range(13)]
    reference = (
        "long long count_pairs(const int *a, int n) {\n"
        "    long long count = 0;\n"
        "    for (int i = 0; i < n; i++)\n"
        "        for (int j = i + 1; j < n; j++)\n"
        f"            if ((long long)a[i] > {factor}LL * a[j]) count++;\n"
        "    return count;\n}\n"
    )
    return FunctionTask(
        entry="count_pairs",
        signature="long long count_pairs(const int *a, int n)",
        description=f"Count the index pairs i < j with a[i] > {factor} * a[j] among the n elements of `a`.",
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=reference.replace(f"(long long)a[i] > {factor}LL", f"(long long)a[i] >= {factor}LL"),
        arg_kinds=("int_list",),
        returns="int",
    )


def make_c_collatz(rng: random.Random) -> FunctionTask:
    peak = rng.random() < 0.5

    def solve(n: int) -> int:
        steps, highest = 0, n
        while n != 1:
            n = n // 2 if n % 2 == 0 else 3 * n + 1
            steps += 1
            highest = max(highest, n)
        return highest if peak else steps

    calls: list[list[Any]] = [[6], [1], [27], *([rng.randint(1, 10**6)] for _ in range(13))]
    result = "highest" if peak else "steps"
    reference = (
        "long long collatz(long long n) {\n"
        "    long long steps = 0, highest = n;\n"
        "    while (n != 1) {\n"
        "        n = n % 2 == 0 ? n / 2 : 3 * n + 1;\n"
        "        steps++;\n"
        "        if (n > highest) highest = n;\n"
        "    }\n"
        f"    return {result};\n}}\n"
    )
    mutant = reference.replace("long long steps = 0,", "long long steps = 1,").replace(
        "highest = n;\n    while", "highest = 0;\n    while"
    )
    what = "the largest value the sequence reaches (n itself included)" if peak else "the number of steps"
    return FunctionTask(
        entry="collatz",
        signature="long long collatz(long long n)",
        description=(
            "Starting from n >= 1, repeatedly replace n by n / 2 when it is even and by 3n + 1 when it is "
            f"odd, until it reaches 1. Return {what}."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
        arg_kinds=("int",),
        returns="int",
    )


# --- C++ families --------------------------------------------------------------------------------------


def make_cpp_words(rng: random.Random) -> FunctionTask:
    flip = rng.random() < 0.5

    def solve(s: str) -> str:
        words = s.split()
        return " ".join(w[::-1] if flip else w for w in reversed(words))

    calls: list[list[Any]] = [["  the quick  brown fox "], [""], ["one"]]
    calls += [[text(rng, "abcde  ", 0, 30)] for _ in range(13)]
    reverse_word = "        reverse(w.begin(), w.end());\n" if flip else ""
    reference = (
        "#include <sstream>\n\n"
        "string reverse_words(const string &s) {\n"
        "    vector<string> words;\n"
        "    string w;\n"
        "    istringstream in(s);\n"
        "    while (in >> w) {\n"
        f"{reverse_word}"
        "        words.push_back(w);\n"
        "    }\n"
        "    string out;\n"
        "    for (size_t i = words.size(); i-- > 0;) {\n"
        "        if (!out.empty()) out += ' ';\n"
        "        out += words[i];\n"
        "    }\n"
        "    return out;\n}\n"
    )
    mutant = reference.replace("if (!out.empty()) out += ' ';", "out += ' ';")
    extra = " Each word's letters are reversed as well." if flip else ""
    return FunctionTask(
        entry="reverse_words",
        signature="string reverse_words(const string &s)",
        description=(
            "Return the words of `s` (maximal runs of non-space characters) in reverse order, joined by "
            f"single spaces, with no leading or trailing space.{extra}"
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
        arg_kinds=("string",),
        returns="string",
    )


def make_cpp_keep(rng: random.Random) -> FunctionTask:
    limit = rng.randint(1, 3)

    def solve(xs: list[int]) -> list[int]:
        seen: dict[int, int] = {}
        out = []
        for x in xs:
            seen[x] = seen.get(x, 0) + 1
            if seen[x] <= limit:
                out.append(x)
        return out

    calls: list[list[Any]] = [[[3, 1, 3, 3, 2, 1, 3]], [[]]]
    calls += [[ints(rng, rng.randint(0, 30), 0, 6)] for _ in range(14)]
    reference = (
        "#include <map>\n\n"
        "vector<int> keep_first(const vector<int> &xs) {\n"
        "    map<int, int> seen;\n"
        "    vector<int> out;\n"
        "    for (int x : xs)\n"
        f"        if (++seen[x] <= {limit}) out.push_back(x);\n"
        "    return out;\n}\n"
    )
    return FunctionTask(
        entry="keep_first",
        signature="vector<int> keep_first(const vector<int> &xs)",
        description=(
            f"Return `xs` with only the first {limit} occurrence(s) of each value kept, in their original "
            "order."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=reference.replace(f"<= {limit})", f"<= {limit + 1})"),
        arg_kinds=("int_list",),
        returns="int_list",
    )


def make_cpp_brackets(rng: random.Random) -> FunctionTask:
    pairs = rng.choice(["()[]", "(){}", "()<>", "[]{}", "()[]{}"])
    opening, closing = pairs[0::2], pairs[1::2]

    def solve(s: str) -> bool:
        stack: list[str] = []
        for ch in s:
            if ch in opening:
                stack.append(closing[opening.index(ch)])
            elif ch in closing and (not stack or stack.pop() != ch):
                return False
        return not stack

    def sample() -> str:
        if rng.random() < 0.4:  # a balanced string, so that both answers occur often
            out = ""
            for _ in range(rng.randint(1, 6)):
                i = rng.randrange(len(opening))
                out = rng.choice([opening[i] + out + closing[i], out + opening[i] + "x" + closing[i]])
            return out
        return text(rng, pairs + "ab", 0, 16)

    calls: list[list[Any]] = [
        [opening[0] + opening[-1] + closing[-1] + closing[0]],
        [opening[0] + closing[-1]],
    ]
    calls += [[""], [closing[0] + opening[0]]] + [[sample()] for _ in range(16)]
    reference = (
        "bool balanced(const string &s) {\n"
        f'    const string opening = "{opening}", closing = "{closing}";\n'
        "    vector<char> stack;\n"
        "    for (char ch : s) {\n"
        "        size_t i = opening.find(ch);\n"
        "        if (i != string::npos) { stack.push_back(closing[i]); continue; }\n"
        "        if (closing.find(ch) != string::npos) {\n"
        "            if (stack.empty() || stack.back() != ch) return false;\n"
        "            stack.pop_back();\n"
        "        }\n"
        "    }\n"
        "    return stack.empty();\n}\n"
    )
    mutant = reference.replace(
        "if (stack.empty() || stack.back() != ch) return false;", "if (stack.empty()) return false;"
    )
    shown = " ".join(f"{a}{b}" for a, b in zip(opening, closing, strict=True))
    return FunctionTask(
        entry="balanced",
        signature="bool balanced(const string &s)",
        description=(
            f"Return whether the brackets {shown} in `s` are balanced and properly nested; every other "
            "character is ignored."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
        arg_kinds=("string",),
        returns="bool",
    )


def make_cpp_palindrome(rng: random.Random) -> FunctionTask:
    alphabet = rng.choice(["ab", "abc", "xyz"])

    def solve(s: str) -> int:
        best = 0
        for i in range(len(s)):
            for j in range(i, len(s)):
                if j - i + 1 > best and s[i : j + 1] == s[i : j + 1][::-1]:
                    best = j - i + 1
        return best

    calls: list[list[Any]] = [["babad"], [""], ["abba"], *([text(rng, alphabet, 1, 40)] for _ in range(13))]
    reference = (
        "long long longest_palindrome(const string &s) {\n"
        "    long long best = 0, n = (long long)s.size();\n"
        "    for (long long c = 0; c < n; c++) {\n"
        "        for (int even = 0; even < 2; even++) {\n"
        "            long long l = c, r = c + even;\n"
        "            while (l >= 0 && r < n && s[l] == s[r]) { l--; r++; }\n"
        "            best = max(best, r - l - 1);\n"
        "        }\n"
        "    }\n"
        "    return best;\n}\n"
    )
    mutant = reference.replace("even < 2", "even < 1")
    return FunctionTask(
        entry="longest_palindrome",
        signature="long long longest_palindrome(const string &s)",
        description=(
            "Return the length of the longest contiguous substring of `s` that reads the same backwards."
        ),
        calls=calls,
        expected=[solve(*c) for c in calls],
        reference=reference,
        mutant=mutant,
        arg_kinds=("string",),
        returns="int",
    )


NATIVE_FAMILIES: Sequence[Family] = (
    Family("c-digits", Lang.C, "digit sums in a seeded base", make_c_digits),
    Family("c-maxsub", Lang.C, "maximum subarray, empty allowed or not", make_c_max_subarray),
    Family("c-pairs", Lang.C, "count pairs a[i] > k * a[j]", make_c_pairs),
    Family("c-collatz", Lang.C, "Collatz steps or peak", make_c_collatz),
    Family("cpp-words", Lang.CPP, "reverse the words of a string", make_cpp_words),
    Family("cpp-keep", Lang.CPP, "keep the first k occurrences", make_cpp_keep),
    Family("cpp-brackets", Lang.CPP, "balanced brackets of a seeded set", make_cpp_brackets),
    Family("cpp-palindrome", Lang.CPP, "longest palindromic substring", make_cpp_palindrome),
)
