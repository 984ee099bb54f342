"""finance/*: the metrics, the tolerance, the one-number answer rule, and the sandboxed analyst."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.chat import ToolCall
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import run_episode, scripted_policy
from tether.envs.finance import (
    KINDS,
    analyst_environment,
    finance_environment,
    make_prices,
    max_drawdown_pct,
    parse_number,
    sharpe,
    total_return_pct,
    volatility_pct,
    within_tolerance,
)
from tether.sandbox.pool import PoolConfig


def test_metrics_on_a_hand_checked_series() -> None:
    closes = [100.0, 110.0, 99.0, 121.0, 108.9]
    assert total_return_pct(closes) == pytest.approx(8.9)
    assert max_drawdown_pct(closes) == pytest.approx(10.0)
    returns = [0.1, -0.1, 121 / 99 - 1, -0.1]
    assert volatility_pct(closes) == pytest.approx(statistics.stdev(returns) * math.sqrt(252) * 100)
    assert sharpe(closes, 0.0) == pytest.approx(
        statistics.mean(returns) / statistics.stdev(returns) * math.sqrt(252)
    )


def test_price_tables_are_reproducible_and_shown_as_used() -> None:
    prices = make_prices(random.Random(3), 2)
    assert prices == make_prices(random.Random(3), 2)
    rows = prices.csv().splitlines()
    assert rows[0].startswith("date,") and len(rows) == len(prices.dates) + 1
    ticker = next(iter(prices.closes))
    assert [float(row.split(",")[1]) for row in rows[1:]] == prices.closes[ticker]


@pytest.mark.parametrize(
    ("text", "value"),
    [("12.5", 12.5), ("-3", -3.0), ("12.5%", 12.5), ("$1,234.50", 1234.5), (" 7 ", 7.0)],
)
def test_one_number_is_read(text: str, value: float) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text", ["", "nan", "inf", "1e3", "12.5 or 13", "about 12", "1,23", "12.5 13", "--1"]
)
def test_anything_but_one_number_is_refused(text: str) -> None:
    assert parse_number(text) is None


@pytest.mark.parametrize(
    ("exact", "answer", "ok"),
    [
        (10.0, 10.009, True),
        (10.0, 10.02, False),
        (1000.0, 1000.9, True),
        (1000.0, 1001.5, False),
        (-5, -5.01, True),
    ],
)
def test_tolerance_is_the_larger_of_absolute_and_relative(exact: float, answer: float, ok: bool) -> None:
    assert within_tolerance(exact, answer) is ok


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_the_rounded_reference_is_within_tolerance_and_stated_in_the_prompt(kind: str) -> None:
    env = finance_environment(kind)
    for seed in range(10):
        task = env.task(seed)
        assert "within 0.01 or 0.1%" in task.messages[1]["content"]
        assert within_tolerance(task.data["exact"], float(task.reference))


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(config=PoolConfig(slots=1)) as provider:
        yield ScoringContext(provider)


async def test_the_analyst_computes_in_the_sandbox_from_the_csv_it_finds_there(ctx: ScoringContext) -> None:
    env = analyst_environment()
    task = env.task(11)
    assert "data.csv" in task.messages[1]["content"] and "Data (CSV)" not in task.messages[1]["content"]
    code = "import csv\nrows = list(csv.reader(open('data.csv')))\nprint(len(rows))"
    replies = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [ToolCall("a", "python", json.dumps({"code": code})).openai()],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [ToolCall("b", "submit", '{"answer": "0"}').openai()],
        },
    ]
    result = await run_episode(env, task, scripted_policy(replies), ctx)
    assert f"stdout:\n{len(task.data['csv'].splitlines())}" in result.messages[3]["content"]
    assert result.score.answer == "0"
