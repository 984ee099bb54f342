"""`long/ledger`: a three-module ledger package (parse, balance, report) from a seeded specification.

The field separator, the sign notation, the thousands separator and the report order change from seed
to seed, so the README must be read, not remembered. `LedgerSpec` is the trusted implementation the
expected values come from; `reference_modules` is the same behaviour as the files a solution writes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tether.envs.long_horizon.repo import RAISES_VALUE_ERROR, STUB, Repo

ACCOUNTS = ["cash", "rent", "food", "travel", "salary", "books", "power", "gifts", "tax"]
MEMOS = ["monthly", "refund", "misc", "card", "transfer", "cash", "annual", "fee"]
SEPARATORS = {"|": "a vertical bar `|`", ";": "a semicolon `;`", "\t": "a tab character", ",": "a comma `,`"}


@dataclass(frozen=True, slots=True)
class LedgerSpec:
    """The seeded choices of one ledger repository."""

    sep: str
    parens: bool  # negative amounts written as (12.50) instead of -12.50
    thousands: str  # separator of thousands in the report ("" for none)
    by_balance: bool  # report order: balance descending (then name) instead of name

    def parse_line(self, line: str) -> list[Any]:
        fields = line.rstrip("\n").split(self.sep)
        if len(fields) != 4:
            raise ValueError("expected 4 fields")
        date, account, amount, memo = (f.strip() for f in fields)
        digits = date.replace("-", "")
        if len(date) != 10 or date[4] != "-" or date[7] != "-" or not digits.isdigit():
            raise ValueError("bad date")
        if not account:
            raise ValueError("empty account")
        return [date, account, self.cents(amount), memo]

    def cents(self, text: str) -> int:
        negative = text.startswith("(") and text.endswith(")") if self.parens else text.startswith("-")
        body = text[1:-1] if negative and self.parens else text[1:] if negative else text
        whole, _, frac = body.partition(".")
        if (
            not whole.isdigit()
            or len(frac) > 2
            or (frac and not frac.isdigit())
            or ("." in body and not frac)
        ):
            raise ValueError(f"bad amount {text!r}")
        value = int(whole) * 100 + int(frac.ljust(2, "0") or "0")
        return -value if negative else value

    def balances(self, lines: list[str]) -> dict[str, int]:
        totals: dict[str, int] = {}
        for line in lines:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            _, account, cents, _ = self.parse_line(line)
            totals[account] = totals.get(account, 0) + cents
        return totals

    def money(self, cents: int) -> str:
        whole, frac = divmod(abs(cents), 100)
        grouped = f"{whole:,}".replace(",", self.thousands)
        return f"{'-' if cents < 0 else ''}{grouped}.{frac:02d}"

    def render(self, balances: dict[str, int]) -> str:
        order = sorted(
            balances.items(), key=(lambda i: (-i[1], i[0])) if self.by_balance else (lambda i: i[0])
        )
        lines = [f"{account}: {self.money(cents)}" for account, cents in order]
        return "\n".join([*lines, f"TOTAL: {self.money(sum(balances.values()))}"]) + "\n"

    def amount_text(self, cents: int, rng: random.Random) -> str:
        whole, frac = divmod(abs(cents), 100)
        body = f"{whole}.{frac:02d}" if frac or rng.random() < 0.5 else str(whole)
        if cents >= 0:
            return body
        return f"({body})" if self.parens else f"-{body}"

    def line(self, rng: random.Random) -> str:
        date = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        cents = rng.randint(-250000, 900000)
        fields = [date, rng.choice(ACCOUNTS), self.amount_text(cents, rng), rng.choice(MEMOS)]
        return self.sep.join(fields)


def readme(spec: LedgerSpec) -> str:
    negative = "in parentheses, like `(12.50)`" if spec.parens else "with a leading minus, like `-12.50`"
    thousands = f"`{spec.thousands}`" if spec.thousands else "nothing (no grouping)"
    order = "by balance, largest first, then by account name" if spec.by_balance else "by account name"
    sep = SEPARATORS[spec.sep]
    return f"""# ledger

A tiny ledger library. Implement the three modules of the `ledger` package; keep the function names
and signatures. Only the standard library is available. Run the tests with
`python3 -m unittest discover -s tests -t .`.

## `ledger/parse.py`: `parse_line(line: str) -> list`

A transaction line has exactly four fields separated by {sep}: date, account, amount, memo. Strip
spaces around every field (and the line's trailing newline). Return `[date, account, cents, memo]`
where `cents` is the amount as an integer number of cents.

- date: `YYYY-MM-DD` (four digits, dash, two digits, dash, two digits);
- account: must not be empty;
- amount: digits, optionally followed by `.` and one or two digits (`7`, `7.5`, `7.05`); negative
  amounts are written {negative}. Nothing else is accepted (no signs otherwise, no spaces inside);
- memo: any text, possibly empty.

Raise `ValueError` for a line with another number of fields or any invalid field.

## `ledger/balance.py`: `balances(lines: list[str]) -> dict`

Sum the cents of every transaction per account. Skip blank lines and lines whose first non-space
character is `#`. An invalid transaction line raises `ValueError`.

## `ledger/report.py`: `render(balances: dict) -> str`

One line per account, `<account>: <amount>`, ordered {order}, then a last line `TOTAL: <amount>`
with the sum of all balances. Every line ends with a newline. Amounts are written with a `-` sign if
negative, the whole part grouped by thousands with {thousands} as separator, and exactly two decimals
after a `.` (for example 1234567 cents is `12{spec.thousands}345.67`).
"""


def visible_tests(spec: LedgerSpec, rng: random.Random) -> str:
    line = spec.line(rng)
    lines = [spec.line(rng) for _ in range(4)]
    return f"""import unittest

from ledger.balance import balances
from ledger.parse import parse_line
from ledger.report import render


class LedgerTest(unittest.TestCase):
    def test_parse_line(self):
        self.assertEqual(parse_line({line!r}), {spec.parse_line(line)!r})

    def test_parse_line_rejects_three_fields(self):
        with self.assertRaises(ValueError):
            parse_line({spec.sep.join(["2024-01-01", "cash", "1"])!r})

    def test_balances(self):
        self.assertEqual(balances({lines!r}), {spec.balances(lines)!r})

    def test_render(self):
        expected = {spec.render({"cash": 123456, "rent": -500})!r}
        self.assertEqual(render({{"cash": 123456, "rent": -500}}), expected)


if __name__ == "__main__":
    unittest.main()
"""


def reference_modules(spec: LedgerSpec) -> dict[str, str]:
    """A correct implementation, as the files the reference trajectory writes."""
    negative = "text.startswith('(') and text.endswith(')')" if spec.parens else "text.startswith('-')"
    strip = "text[1:-1]" if spec.parens else "text[1:]"
    order = "key=lambda item: (-item[1], item[0])" if spec.by_balance else "key=lambda item: item[0]"
    return {
        "ledger/parse.py": f'''"""Parse one transaction line."""


def _cents(text):
    negative = {negative}
    body = {strip} if negative else text
    whole, _, frac = body.partition(".")
    if not whole.isdigit() or len(frac) > 2 or (frac and not frac.isdigit()) or ("." in body and not frac):
        raise ValueError("bad amount: " + text)
    value = int(whole) * 100 + int(frac.ljust(2, "0") or "0")
    return -value if negative else value


def parse_line(line):
    fields = line.rstrip("\\n").split({spec.sep!r})
    if len(fields) != 4:
        raise ValueError("expected 4 fields")
    date, account, amount, memo = (field.strip() for field in fields)
    if len(date) != 10 or date[4] != "-" or date[7] != "-" or not date.replace("-", "").isdigit():
        raise ValueError("bad date: " + date)
    if not account:
        raise ValueError("empty account")
    return [date, account, _cents(amount), memo]
''',
        "ledger/balance.py": '''"""Per-account balances."""

from ledger.parse import parse_line


def balances(lines):
    totals = {}
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        _, account, cents, _ = parse_line(line)
        totals[account] = totals.get(account, 0) + cents
    return totals
''',
        "ledger/report.py": f'''"""Render balances as text."""


def _money(cents):
    whole, frac = divmod(abs(cents), 100)
    grouped = "{{:,}}".format(whole).replace(",", {spec.thousands!r})
    return ("-" if cents < 0 else "") + grouped + "." + "{{:02d}}".format(frac)


def render(balances):
    lines = [account + ": " + _money(cents) for account, cents in sorted(balances.items(), {order})]
    lines.append("TOTAL: " + _money(sum(balances.values())))
    return "\\n".join(lines) + "\\n"
''',
    }


def hidden_tests(spec: LedgerSpec, rng: random.Random) -> str:
    """Trusted test functions for the harness's suite mode: `m` proxies the model's package."""
    tests = [RAISES_VALUE_ERROR]
    for index in range(4):
        line = spec.line(rng)
        padded = spec.sep.join(f" {f} " for f in line.split(spec.sep)) + "\n" if index == 3 else line
        tests.append(
            f"def test_parse_{index}(m):\n"
            f"    assert m.parse.parse_line({padded!r}) == {spec.parse_line(padded)!r}\n"
        )
    good = spec.line(rng).split(spec.sep)
    bad_lines = {
        "fields": spec.sep.join(good[:3]),
        "date": spec.sep.join(["2024/01/05", *good[1:]]),
        "account": spec.sep.join([good[0], " ", *good[2:]]),
        "amount": spec.sep.join([*good[:2], "12.345", good[3]]),
        "sign": spec.sep.join([*good[:2], "-(3.00)" if spec.parens else "(3.00)", good[3]]),
    }
    for name, bad in bad_lines.items():
        tests.append(
            f"def test_rejects_bad_{name}(m):\n"
            f"    assert raises_value_error(lambda: m.parse.parse_line({bad!r}))\n"
        )
    for index in range(3):
        lines = [spec.line(rng) for _ in range(rng.randint(3, 12))]
        lines.insert(rng.randint(0, len(lines)), "  # comment " + spec.sep)
        lines.insert(rng.randint(0, len(lines)), "   ")
        tests.append(
            f"def test_balances_{index}(m):\n"
            f"    assert m.balance.balances({lines!r}) == {spec.balances(lines)!r}\n"
        )
    tests.append(
        "def test_balances_reject_a_bad_line(m):\n"
        f"    assert raises_value_error(lambda: m.balance.balances([{spec.line(rng)!r}, 'nonsense']))\n"
    )
    for index in range(3):
        totals = {
            account: rng.randint(-2 * 10**8, 2 * 10**8) for account in rng.sample(ACCOUNTS, rng.randint(1, 5))
        }
        tests.append(
            f"def test_render_{index}(m):\n"
            f"    assert m.report.render({totals!r}) == {spec.render(totals)!r}\n"
        )
    tests.append(f"def test_render_empty(m):\n    assert m.report.render({{}}) == {spec.render({})!r}\n")
    return "\n\n".join(tests)


def ledger_repo(seed: int) -> Repo:
    rng = random.Random(f"long/ledger:{seed}")
    spec = LedgerSpec(
        sep=rng.choice(list(SEPARATORS)),
        parens=rng.random() < 0.5,
        thousands=rng.choice([",", " ", "_", ""]),
        by_balance=rng.random() < 0.5,
    )
    files = {
        "README.md": readme(spec),
        "ledger/__init__.py": '"""A tiny ledger library."""\n',
        "ledger/parse.py": STUB.format(doc="Parse one transaction line.", name="parse_line", args="line"),
        "ledger/balance.py": STUB.format(doc="Per-account balances.", name="balances", args="lines"),
        "ledger/report.py": STUB.format(doc="Render balances as text.", name="render", args="balances"),
        "tests/__init__.py": "",
        "tests/test_ledger.py": visible_tests(spec, rng),
    }
    protected = ["README.md", "tests/__init__.py", "tests/test_ledger.py"]
    return Repo("ledger", files, protected, hidden_tests(spec, rng), reference_modules(spec))
