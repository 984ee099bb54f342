"""`report.html`: curves per domain and per reward component from metrics, self-contained, rewritten by
the trainer at each checkpoint."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from pathlib import Path

from tether.rl.report import components, curve, domains, read_metrics, render_report, write_report

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
    assert "<td>math/arithmetic</td><td>0.200</td><td>0.600</td>" in page


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
