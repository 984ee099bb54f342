"""`report.html`: the held-out evaluation first, curves per domain, per reward component and per learner
metric from metrics, one style per domain throughout, self-contained, rewritten by the trainer at each
checkpoint."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from pathlib import Path

from tether.rl.report import (
    ALL,
    charts,
    components,
    curve,
    domains,
    learner_metrics,
    read_metrics,
    render_report,
    write_report,
)

from .test_trainer import make_trainer, tiny_config

PNG = b"\x89PNG\r\n\x1a\n"


def _rows() -> list[dict[str, float]]:
    rows = []
    for step in (1, 2, 3):
        rows.append(
            {
                "step": float(step),
                "reward": 0.1 * step,
                "time/generate_s": 1.0,
                "time/score_s": 0.1,
                "time/learn_s": 2.0,
                "domain/math/arithmetic/reward": 0.2 * step,
                "domain/math/arithmetic/response_tokens": 30.0 + step,
                "domain/math/arithmetic/reward/correctness": 0.2 * step,
                "domain/math/arithmetic/reward/format": 1.0,
                "domain/code/python/reward": 0.05 * step,
                "domain/code/python/response_tokens": 60.0,
                "domain/code/python/reward/tests": 0.05 * step,
            }
        )
    return rows


def test_domains_components_and_curves_are_read_from_flat_keys() -> None:
    rows = _rows()
    assert domains(rows) == ["code/python", "math/arithmetic"]
    assert components(rows, "math/arithmetic") == ["correctness", "format"]
    assert curve(rows, "domain/code/python/reward") == ([1.0, 2.0, 3.0], [0.05, 0.1, 0.15000000000000002])
    assert curve(rows, "missing") == ([], [])


def test_report_embeds_one_png_per_chart_and_needs_no_server() -> None:
    page = render_report(_rows(), "tether run demo")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    # reward, response length, components of each of the two domains, seconds per step
    assert len(images) == 5
    assert all(base64.b64decode(image).startswith(PNG) for image in images)
    for title in ("Reward per domain", "Response length per domain", "Reward components: math/arithmetic"):
        assert title in page
    assert "http" not in page.replace("data:image", "")  # nothing fetched from anywhere
    assert "math/arithmetic</td><td>0.200</td><td>0.600</td>" in page


def test_a_run_without_steps_still_gets_a_page(tmp_path: Path) -> None:
    path = write_report(tmp_path)
    assert path == tmp_path / "report.html"
    assert "Steps recorded: 0." in path.read_text()
    assert "<img" not in path.read_text()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_the_trainer_writes_the_report_at_each_checkpoint(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(tiny_model("llama"), tmp_path, run={"steps": 2, "checkpoint_every": 1})
    trainer = make_trainer(config)
    seen: list[str] = []
    report = tmp_path / "tiny" / "report.html"
    trainer.run(on_step=lambda metrics: seen.append(report.read_text() if report.exists() else ""))
    trainer.close()
    assert seen[0] == ""  # the first step's metrics arrive before its checkpoint
    assert "Steps recorded: 1." in seen[1]
    page = report.read_text()
    assert "Steps recorded: 2." in page
    assert "test/vowels" in page and "test/digits" in page
    assert "Reward components: test/vowels" in page


LEARNED = {
    "learner/loss": 0.5,
    "learner/kl": 0.01,
    "learner/grad_norm": 2.0,
    "learner/max_logprob_diff": 1e-6,
}
EVALUATION = [
    {
        "env": env,
        "prompts": 16,
        "samples_per_prompt": 4,
        "reward_before": 0.2,
        "reward_after": after,
        "delta": after - 0.2,
        "stderr": 0.02,
        "noise": 0.04,
        "pass_before": 0.2,
        "pass_after": after,
        "clear": after - 0.2 > 0.04,
    }
    for env, after in (("math/arithmetic", 0.5), ("code/python", 0.21), (ALL, 0.35))
]


def _recorded_run() -> list[dict[str, float]]:
    return [{**row, **{key: value * row["step"] for key, value in LEARNED.items()}} for row in _rows()]


def test_the_report_opens_with_the_held_out_evaluation_table() -> None:
    page = render_report(_recorded_run(), "tether run demo", EVALUATION)
    table = page.index('<table id="evaluation">')
    assert table < page.index("<img") and table < page.index("Steps recorded")
    assert "Held-out evaluation before and after 3 RL steps" in page
    header, *rows = re.findall(r"<tr[^>]*>(.*?)</tr>", page[table:].split("</table>")[0])
    assert header.startswith("<th>domain</th>") and header.endswith("<th>verdict</th>")
    assert ["math/arithmetic" in rows[0], "code/python" in rows[1], "all" in rows[2]] == [True] * 3
    assert "<td>0.200</td><td>0.500</td><td>+0.300</td><td>0.040</td>" in rows[0] and "clear gain" in rows[0]
    assert "within noise" in rows[1]


def test_every_logged_learner_metric_gets_its_own_chart() -> None:
    rows = _recorded_run()
    assert learner_metrics(rows) == sorted(LEARNED)
    learner = [chart for chart in charts(rows) if chart.section == "Learner"]
    assert [chart.title for chart in learner] == sorted(LEARNED)
    assert all(
        chart.lines[0].values == [value * step for step in (1, 2, 3)]
        for chart, value in zip(learner, (LEARNED[key] for key in sorted(LEARNED)), strict=True)
    )
    page = render_report(rows, "tether run demo")
    for key in LEARNED:
        assert f'alt="{key}" src="data:image/png;base64,' in page


def test_a_domain_keeps_one_colour_in_every_chart_and_overlapping_lines_stay_apart() -> None:
    planned = charts(_recorded_run())
    colours: dict[str, set[str]] = {}
    for chart in planned:
        for line in chart.lines:
            owner = (
                chart.title.removeprefix("Reward components: ") if "components" in chart.title else line.label
            )
            if owner in ("math/arithmetic", "code/python", ALL):
                colours.setdefault(owner, set()).add(line.style.color)
    assert all(len(found) == 1 for found in colours.values()), colours
    assert len({next(iter(found)) for found in colours.values()}) == 3  # and no two domains share one
    [reward] = [chart for chart in planned if chart.title == "Reward per domain"]
    styles = [line.style for line in reward.lines]
    # Lines that lie on each other differ in dash, marker and width: the one below still shows.
    assert len({(s.linestyle, s.marker) for s in styles}) == len(styles)
    assert [s.linewidth for s in styles] == sorted((s.linewidth for s in styles), reverse=True)


def test_the_evaluation_survives_the_trainers_later_rewrites(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _recorded_run()))
    write_report(tmp_path, EVALUATION)
    page = write_report(tmp_path).read_text()  # a checkpoint of a resumed run: no evaluation passed
    assert page.index('<table id="evaluation">') < page.index("<img")


def test_the_report_says_when_the_run_resumed_or_replaced_rollout_workers() -> None:
    assert "failover" not in render_report(_rows(), "tether run demo")  # nothing to say: no line
    rows = _rows()
    rows[1]["rollout/workers_replaced"] = 2.0
    rows[2].update({"run/resumptions": 1.0, "rollout/workers_replaced": 1.0})
    page = render_report(rows, "tether run demo")
    assert (
        '<p class="failover">Resumed from its last checkpoint 1 time(s) after losing the learner; '
        "3 rollout worker(s) replaced.</p>"
    ) in page


def test_the_report_shows_cost_per_step_exact_totals_monitors_and_their_warnings(tmp_path: Path) -> None:
    rows = [
        {
            **row,
            "tokens/prompt_cached": 100.0 * row["step"],
            "tokens/prompt_uncached": 50.0,
            "tokens/output": 7.0,
            "cost/standard_usd": 0.0001,
            "cost/fast_usd": 0.0002,
            "monitor/math/arithmetic/exploit_reward_share": 0.05 * row["step"],
        }
        for row in _rows()
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    warning = {"step": 3, "domain": "math/arithmetic", "monitor": "exploit_reward_share", "value": 0.15}
    (tmp_path / "warnings.jsonl").write_text(json.dumps({**warning, "threshold": 0.1}) + "\n")
    page = write_report(tmp_path).read_text()
    for title in ("Rollout cost per step", "Rollout tokens per step", "exploit_reward_share"):
        assert f'alt="{title}"' in page
    # No cost.json (a run from before it existed): the totals at the gateway's default prices, exactly.
    # 600 cached x 0.18 + 150 uncached x 1.80 + 21 output x 9.50 = 577.5 micro-dollars.
    assert "<td>standard</td><td>$0.0005775</td><td>600</td><td>150</td><td>21</td>" in page
    assert "at the gateway's default prices" in page
    assert "<td>math/arithmetic</td><td>exploit_reward_share</td><td>1</td><td>3</td><td>3</td>" in page
    assert "No monitor went over its threshold." in render_report(rows, "quiet")
