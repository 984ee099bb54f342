"""Finance questions over generated tables (`finance/<kind>`): returns, volatility, drawdowns, ratios.

Price and fundamentals tables are drawn from `Random(seed)` and shown as CSV; the reference is computed
here in pure Python from the table exactly as shown (rounded prices), and an answer counts when it is
within the tolerance the prompt states. The answer must be one number (a `%` or `$` sign and thousands
separators are allowed); text with several numbers is refused. `finance/analyst` is the multi-turn
variant: the CSV is written into the episode's sandbox and the model computes with the `python` tool.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import random
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tether.chat import ToolCall
from tether.envs.episode import Environment
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry
from tether.envs.rubric import answer_rubric, hedged
from tether.envs.scoring import EpisodeState, RewardInput
from tether.envs.tasks import ChatRenderer, Problem, Task
from tether.tools import PYTHON, SUBMIT

ABS_TOL = 0.01
REL_TOL = 0.001
TRADING_DAYS = 252
TOLERANCE_NOTE = (
    "Round to 2 decimal places; an answer within 0.01 or 0.1% of the exact value, whichever is larger, "
    "is accepted."
)
SYSTEM = (
    "You are a financial analyst. Answer with a single number, computed from the data given. "
    + ANSWER_TAG.instructions
)
TICKERS = ["ACME", "BOLT", "CRUX", "DYNA", "EVRG", "FLUX", "GRID", "HELX"]
_NUMBER = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$")


@dataclass(frozen=True, slots=True)
class Prices:
    dates: list[str]
    closes: dict[str, list[float]]

    def csv(self) -> str:
        tickers = list(self.closes)
        rows = ["date," + ",".join(tickers)]
        for day, date in enumerate(self.dates):
            rows.append(date + "," + ",".join(f"{self.closes[t][day]:.2f}" for t in tickers))
        return "\n".join(rows)


def make_prices(rng: random.Random, tickers: int) -> Prices:
    """Geometric random walks on business days, rounded to cents like a real quote table."""
    days = rng.randint(30, 90)
    date = datetime.date(rng.randint(2015, 2024), rng.randint(1, 12), rng.randint(1, 28))
    dates: list[str] = []
    while len(dates) < days:
        if date.weekday() < 5:
            dates.append(date.isoformat())
        date += datetime.timedelta(days=1)
    closes: dict[str, list[float]] = {}
    for ticker in rng.sample(TICKERS, tickers):
        price, drift, vol = rng.uniform(20, 300), rng.gauss(0.0004, 0.001), rng.uniform(0.008, 0.04)
        series = []
        for _ in range(days):
            series.append(round(price, 2))
            price *= math.exp(rng.gauss(drift - vol * vol / 2, vol))
        closes[ticker] = series
    return Prices(dates, closes)


def daily_returns(closes: list[float]) -> list[float]:
    return [b / a - 1 for a, b in itertools.pairwise(closes)]


def total_return_pct(closes: list[float]) -> float:
    return (closes[-1] / closes[0] - 1) * 100


def volatility_pct(closes: list[float]) -> float:
    return statistics.stdev(daily_returns(closes)) * math.sqrt(TRADING_DAYS) * 100


def max_drawdown_pct(closes: list[float]) -> float:
    peak, worst = closes[0], 0.0
    for close in closes:
        peak = max(peak, close)
        worst = max(worst, 1 - close / peak)
    return worst * 100


def sharpe(closes: list[float], risk_free_pct: float) -> float:
    excess = [r - risk_free_pct / 100 / TRADING_DAYS for r in daily_returns(closes)]
    return statistics.mean(excess) / statistics.stdev(excess) * math.sqrt(TRADING_DAYS)


# --- question kinds: (prompt, exact answer) from a seeded generator --------------------------------------

Question = tuple[str, float, str]  # prompt, exact value, CSV table


def _price_question(rng: random.Random) -> tuple[Prices, str]:
    prices = make_prices(rng, rng.randint(1, 3))
    return prices, rng.choice(list(prices.closes))


def q_total_return(rng: random.Random) -> Question:
    prices, ticker = _price_question(rng)
    text = f"What is the total return of {ticker} from the first to the last date, in percent?"
    return text, total_return_pct(prices.closes[ticker]), prices.csv()


def q_volatility(rng: random.Random) -> Question:
    prices, ticker = _price_question(rng)
    text = (
        f"What is the annualised volatility of {ticker}, in percent: the sample standard deviation of "
        f"daily simple returns times the square root of {TRADING_DAYS}?"
    )
    return text, volatility_pct(prices.closes[ticker]), prices.csv()


def q_max_drawdown(rng: random.Random) -> Question:
    prices, ticker = _price_question(rng)
    text = f"What is the maximum drawdown of {ticker}'s closing price, as a positive percentage of the peak?"
    return text, max_drawdown_pct(prices.closes[ticker]), prices.csv()


def q_sharpe(rng: random.Random) -> Question:
    prices, ticker = _price_question(rng)
    risk_free = rng.choice([0.0, 1.0, 2.0, 3.5, 5.0])
    text = (
        f"What is the annualised Sharpe ratio of {ticker} with a {risk_free}% annual risk-free rate? Use "
        f"daily simple returns minus rate/{TRADING_DAYS}: mean over sample standard deviation, times "
        f"sqrt({TRADING_DAYS})."
    )
    return text, sharpe(prices.closes[ticker], risk_free), prices.csv()


def q_moving_average(rng: random.Random) -> Question:
    prices, ticker = _price_question(rng)
    window = rng.choice([5, 10, 20])
    text = f"What is the {window}-day simple moving average of {ticker}'s close on the last date?"
    return text, statistics.mean(prices.closes[ticker][-window:]), prices.csv()


def _fundamentals(rng: random.Random) -> tuple[list[dict[str, float | str]], str]:
    rows: list[dict[str, float | str]] = []
    for ticker in rng.sample(TICKERS, rng.randint(2, 5)):
        revenue = rng.randint(50, 5000) * 1e6
        rows.append(
            {
                "ticker": ticker,
                "price": rng.randint(500, 50000) / 100,
                "revenue": revenue,
                "net_income": round(revenue * rng.uniform(-0.05, 0.3), -5),
                "shares": rng.randint(10, 900) * 1e6,
                "total_debt": rng.randint(0, 3000) * 1e6,
                "total_equity": rng.randint(100, 4000) * 1e6,
            }
        )
    header = list(rows[0])
    lines = [",".join(header)] + [
        ",".join(
            str(row[k]) if k == "ticker" else f"{row[k]:.2f}" if k == "price" else f"{row[k]:.0f}"
            for k in header
        )
        for row in rows
    ]
    return rows, "\n".join(lines)


def q_pe_ratio(rng: random.Random) -> Question:
    rows, table = _fundamentals(rng)
    while not any(float(row["net_income"]) > 0 for row in rows):  # P/E needs positive earnings
        rows, table = _fundamentals(rng)
    row = rng.choice([row for row in rows if float(row["net_income"]) > 0])
    eps = float(row["net_income"]) / float(row["shares"])
    text = f"What is {row['ticker']}'s price-to-earnings ratio (price divided by net income per share)?"
    return text, float(row["price"]) / eps, table


def q_debt_to_equity(rng: random.Random) -> Question:
    rows, table = _fundamentals(rng)
    row = rng.choice(rows)
    text = f"What is {row['ticker']}'s debt-to-equity ratio (total debt divided by total equity)?"
    return text, float(row["total_debt"]) / float(row["total_equity"]), table


def q_net_margin(rng: random.Random) -> Question:
    rows, table = _fundamentals(rng)
    row = rng.choice(rows)
    text = f"What is {row['ticker']}'s net profit margin (net income over revenue), in percent?"
    return text, float(row["net_income"]) / float(row["revenue"]) * 100, table


def q_cagr(rng: random.Random) -> Question:
    start, years = rng.randint(2005, 2018), rng.randint(3, 7)
    revenue = rng.randint(100, 2000) * 1.0
    lines = ["year,revenue_musd"]
    values = []
    for year in range(start, start + years + 1):
        values.append(round(revenue, 1))
        lines.append(f"{year},{values[-1]:.1f}")
        revenue *= 1 + rng.uniform(-0.1, 0.35)
    text = f"What is the compound annual growth rate of revenue from {start} to {start + years}, in percent?"
    return text, ((values[-1] / values[0]) ** (1 / years) - 1) * 100, "\n".join(lines)


KINDS: dict[str, Callable[[random.Random], Question]] = {
    "total_return": q_total_return,
    "volatility": q_volatility,
    "max_drawdown": q_max_drawdown,
    "sharpe": q_sharpe,
    "moving_average": q_moving_average,
    "pe_ratio": q_pe_ratio,
    "debt_to_equity": q_debt_to_equity,
    "net_margin": q_net_margin,
    "cagr": q_cagr,
}


def parse_number(text: str) -> float | None:
    """One number, optionally with `%`, `$` and thousands separators; anything else is None."""
    cleaned = text.strip().removeprefix("$").removesuffix("%").strip()
    if not _NUMBER.match(cleaned):
        return None
    return float(cleaned.replace(",", ""))


def within_tolerance(exact: float, answer: float) -> bool:
    return abs(answer - exact) <= max(ABS_TOL, REL_TOL * abs(exact))


@dataclass(frozen=True, slots=True)
class FinanceSource:
    kind: str | None  # None: a random kind per seed (the multi-turn analyst)
    table_in_prompt: bool = True

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        kind = self.kind or rng.choice(sorted(KINDS))
        question, exact, table = KINDS[kind](rng)
        where = (
            f"Data (CSV):\n{table}"
            if self.table_in_prompt
            else "The data is in data.csv in your working directory; use the python tool to read it."
        )
        prompt = f"{where}\n\n{question} {TOLERANCE_NOTE}"
        data: dict[str, Any] = {"kind": kind, "exact": exact, "csv": table}
        return Problem(prompt=prompt, answer=f"{exact:.2f}", data=data)


def correctness(inp: RewardInput) -> float:
    value = None if inp.parsed.answer is None else parse_number(inp.parsed.answer)
    return 1.0 if value is not None and within_tolerance(float(inp.task.data["exact"]), value) else 0.0


def _adversarial(task: Task) -> list[str]:
    exact = float(task.data["exact"])
    off = exact + max(1.0, abs(exact) * 0.05)
    return [
        hedged(ANSWER_TAG, task.reference),
        ANSWER_TAG.format(f"{off:.2f}"),
        ANSWER_TAG.format(f"{off:.2f} or {task.reference}"),
        ANSWER_TAG.format(f"{task.reference} {off:.2f}"),
        ANSWER_TAG.format(f"about {task.reference}"),
        ANSWER_TAG.format("nan"),
    ]


async def _write_table(state: EpisodeState) -> None:
    await state.require_session().upload({"data.csv": state.task.data["csv"] + "\n"})


def _analyst_reference(task: Task) -> list[dict[str, Any]]:
    """Look at the file with the tool, then submit the answer."""
    look = ToolCall("call_0", "python", json.dumps({"code": "print(open('data.csv').read()[:200])"}))
    submit = ToolCall("call_1", "submit", json.dumps({"answer": task.reference}))
    return [
        {"role": "assistant", "content": "", "tool_calls": [look.openai()]},
        {"role": "assistant", "content": "", "tool_calls": [submit.openai()]},
    ]


def finance_environment(kind: str) -> Environment:
    return Environment(
        name=f"finance/{kind}",
        source=FinanceSource(kind),
        renderer=ChatRenderer(SYSTEM),
        parser=ANSWER_TAG,
        rubric=answer_rubric(correctness, max_chars=6000),
        description=f"{kind.replace('_', ' ')} from a generated table, numeric answer within tolerance",
        adversarial=_adversarial,
    )


def analyst_environment() -> Environment:
    system = (
        "You are a financial analyst with a Python sandbox. Compute the answer from the data file with "
        "the python tool, then call submit with a single number."
    )
    return Environment(
        name="finance/analyst",
        source=FinanceSource(None, table_in_prompt=False),
        renderer=ChatRenderer(system),
        parser=ANSWER_TAG,
        rubric=answer_rubric(correctness, max_chars=6000),
        tools=(PYTHON, SUBMIT),
        max_turns=8,
        setup=_write_table,
        description="a random finance question over data.csv in the sandbox, solved with tools",
        reference_replies=_analyst_reference,
        adversarial=_adversarial,
    )


def register(registry: EnvRegistry) -> None:
    for kind in KINDS:
        registry.register(f"finance/{kind}", partial(finance_environment, kind), source=__name__)
    registry.register("finance/analyst", analyst_environment, source=__name__)
