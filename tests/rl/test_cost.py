"""What a run costs: a step's tokens priced exactly as the gateway prices them, exact run totals from the
per-step token counts, a `[cost]` price table, and the prompt tokens a request or an episode is billed."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tether.chat import Usage
from tether.chat.pricing import DEFAULT_PRICES, Price, Tier, cost_usd
from tether.errors import ConfigError
from tether.rl.config import dump_config, parse_config
from tether.rl.cost import COST_FILE, cost_metrics, summarize, total_usage
from tether.rl.report import read_metrics
from tether.rl.rollout import Rollout, Turn, billed_prompts

from .test_trainer import make_trainer, tiny_config


def rollout(billed: int, cached: int, output: int, cpu_s: float = 0.0) -> Rollout:
    return Rollout(
        "a/x",
        0,
        0,
        [1],
        [2] * output,
        [-0.1] * output,
        [0] * output,
        "stop",
        billed_prompt_tokens=billed,
        cached_prompt_tokens=cached,
        sandbox_cpu_s=cpu_s,
    )


def test_a_steps_cost_is_the_gateways_exact_price_of_its_tokens() -> None:
    # Two samples of one request: the prompt (1000 tokens, 400 from the prefix cache) is billed once.
    rollouts = [rollout(1000, 400, 150, cpu_s=0.25), rollout(0, 0, 100, cpu_s=0.5)]
    usage = total_usage(rollouts)
    assert usage == Usage(prompt_tokens=1000, cached_tokens=400, completion_tokens=250)
    # By hand at 0.18 / 1.80 / 9.50 USD per million: 400*0.18 + 600*1.80 + 250*9.50 = 3527 micro-dollars.
    assert cost_usd(usage, DEFAULT_PRICES[Tier.STANDARD]) == Decimal("0.003527")
    assert cost_usd(usage, DEFAULT_PRICES[Tier.FAST]) == Decimal("0.007054")  # the fast tier costs twice
    metrics = cost_metrics(rollouts, DEFAULT_PRICES)
    assert metrics == {
        "tokens/prompt_cached": 400.0,
        "tokens/prompt_uncached": 600.0,
        "tokens/output": 250.0,
        "cost/standard_usd": 0.003527,
        "cost/fast_usd": 0.007054,
        "sandbox/cpu_s": 0.75,
    }


def test_run_totals_are_exact_decimals_from_the_summed_token_counts() -> None:
    # Three steps of 7 output tokens: 3 x 0.0000665 summed as floats is 0.00019950000000000002.
    rows = [{"step": float(s), **cost_metrics([rollout(0, 0, 7)], DEFAULT_PRICES)} for s in (1, 2, 3)]
    assert sum(row["cost/standard_usd"] for row in rows) != 0.0001995
    summary = summarize(rows, DEFAULT_PRICES)
    assert summary.usd[Tier.STANDARD] == Decimal("0.0001995")
    payload = summary.to_dict()
    assert payload["cost/standard_usd_total"] == "0.0001995"
    assert payload["cost/fast_usd_total"] == "0.000399"
    assert payload["tokens"] == {"prompt_cached": 0, "prompt_uncached": 0, "output": 21}
    assert payload["prices"]["standard"]["output_per_mtok"] == "9.50"
    assert summarize([], DEFAULT_PRICES).usd == {Tier.STANDARD: Decimal(0), Tier.FAST: Decimal(0)}


def test_an_episode_is_billed_every_turns_prompt_with_its_cached_part() -> None:
    turns = [
        Turn("t0", [1, 2, 3], [4], [0.0], [0], "stop", 0),
        Turn("t1", [1, 2, 3, 4, 5], [6], [0.0], [0], "stop", 3),
    ]
    assert billed_prompts(turns) == (8, 3)


RAW: dict[str, Any] = {"envs": {"weights": {"math/arithmetic": 1.0}}}


def test_cost_prices_default_to_the_gateways_and_a_tier_can_be_overridden() -> None:
    assert parse_config(RAW).cost.prices == DEFAULT_PRICES
    price = {"input_cache_hit_per_mtok": "0.05", "input_cache_miss_per_mtok": 0.5, "output_per_mtok": 2}
    config = parse_config({**RAW, "cost": {"standard": price}})
    assert config.cost.prices[Tier.STANDARD] == Price(
        input_cache_hit_per_mtok=Decimal("0.05"),
        input_cache_miss_per_mtok=Decimal("0.5"),
        output_per_mtok=Decimal(2),
    )
    assert config.cost.prices[Tier.FAST] == DEFAULT_PRICES[Tier.FAST]
    # The run directory's config.toml reads back to the same prices.
    assert parse_config(tomllib.loads(dump_config(config))).cost == config.cost


@pytest.mark.parametrize(
    ("cost", "message"),
    [
        ({"standard": {"output_per_mtok": -1}}, "cost.standard.output_per_mtok = -1"),
        ({"fast": {"output_per_mtok": "0.0000001"}}, "at most 6 decimal places"),
        ({"slow": {}}, "unknown key 'cost.slow'; known keys: fast, standard"),
    ],
)
def test_bad_prices_are_refused_naming_the_key(cost: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({**RAW, "cost": cost}, "train.toml")


def test_a_run_records_its_tokens_per_step_and_writes_exact_totals(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(tiny_model("llama"), tmp_path, run={"steps": 2, "checkpoint_every": 100})
    trainer = make_trainer(config)
    prompts: list[int] = []
    original = trainer.produce

    def produce(step: int, cursors: dict[str, int]) -> Any:
        produced = original(step, cursors)
        prompts.extend(len(r.prompt_ids) for r in produced.rollouts[:: config.rollout.samples_per_prompt])
        return produced

    trainer.produce = produce  # type: ignore[method-assign]
    history = trainer.run(final_checkpoint=False)
    trainer.close()
    # Each prompt is billed once for its group of samples; every generated token is output.
    prompt_tokens = sum(m["tokens/prompt_cached"] + m["tokens/prompt_uncached"] for m in history)
    assert prompt_tokens == sum(prompts)
    assert all(m["tokens/output"] == m["generated_tokens"] for m in history)
    assert all(m["cost/fast_usd"] == pytest.approx(2 * m["cost/standard_usd"]) for m in history)
    stored = json.loads((tmp_path / "tiny" / COST_FILE).read_text())
    expected = summarize(read_metrics(tmp_path / "tiny" / "metrics.jsonl"), DEFAULT_PRICES)
    assert stored == json.loads(json.dumps(expected.to_dict()))
    assert Decimal(stored["cost/standard_usd_total"]) > 0
