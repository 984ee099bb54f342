"""The structured-output benchmark: a shrunk CLI run on a tiny model proves its shape and that random
schemas come out valid; the 200-schema SmolLM2 run (marked slow) is the issue's acceptance figure."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tether.cli import engine as engine_cli
from tether.engine.llm_engine import LLMEngine
from tether.engine.sampling import SamplingParams
from tether.engine.structured import StructuredOutput
from tether.engine.structured_bench import StructuredBenchConfig, is_valid, run_pass, schema_prompt
from tether.errors import ConfigError
from tether.machine import machine_record
from tether.models import pull
from tether.testing.schemas import random_schema

REPO_CACHE = Path(__file__).resolve().parents[2] / ".tether" / "cache"
FIGURES = (
    "schema_valid_fraction",
    "constrained_overhead",
    "constrained_ms_per_token",
    "unconstrained_ms_per_token",
)


def bench_cli(args: list[str]) -> typer.testing.Result:
    root = typer.Typer()
    root.add_typer(engine_cli.app, name="engine")
    return CliRunner().invoke(root, ["engine", "bench", "--structured", *args])


def test_cli_reports_validity_and_overhead_as_json(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    args = ["--model", str(tiny_model("qwen3")), "--schemas", "4", "--repeats", "1", "--threads", "1"]
    outcome = bench_cli([*args, "--json", "--out", str(out)])
    assert outcome.exit_code == 0, outcome.output
    printed = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["schemas"] == 4 and printed["schema_valid_fraction"] == 1.0
    assert all(isinstance(printed[figure], float) for figure in FIGURES)
    assert printed["constrained_overhead"] > 0
    assert machine_record(1, 0.0).keys() <= printed["machine"].keys()
    assert "timing: repeat 1 of 1" in outcome.stderr, "plain progress lines when not on a terminal"


@pytest.mark.parametrize(
    ("field", "value"), [("schemas", 0), ("max_tokens", True), ("repeats", -1), ("threads", 0)]
)
def test_bad_structured_bench_config_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"structured bench: {field} = {value!r}"):
        StructuredBenchConfig(**{field: value})  # type: ignore[arg-type]


def test_cli_exits_non_zero_on_a_bad_option(tiny_model: Callable[[str], Path]) -> None:
    outcome = bench_cli(["--model", str(tiny_model("qwen3")), "--schemas", "0"])
    assert outcome.exit_code == 2
    assert "schemas = 0" in outcome.output


def test_random_schemas_are_valid_json_schemas_and_repeat_with_their_seed() -> None:
    import jsonschema

    first = [random_schema(random.Random(seed)) for seed in range(50)]
    assert first == [random_schema(random.Random(seed)) for seed in range(50)]
    for schema in first:
        jsonschema.Draft202012Validator.check_schema(schema)
    kinds = json.dumps(first)
    for keyword in ('"enum"', '"array"', '"required"', '"number"', '"boolean"', '"integer"', '"string"'):
        assert keyword in kinds
    assert any('"type": "object"' in json.dumps(schema["properties"]) for schema in first), "nesting"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 5 minutes on 2 idle cores; much more on shared ones
def test_200_random_schemas_all_validate_on_smollm2() -> None:
    """The issue's acceptance figure: 200 of 200 greedy SmolLM2 documents parse and validate."""
    engine, tokenizer = LLMEngine.from_pretrained(pull("smollm2-135m-instruct", REPO_CACHE), kv_cache_mib=256)
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(200)]
    params = [
        SamplingParams(
            max_tokens=512, temperature=0, structured=StructuredOutput("json_schema", json.dumps(s))
        )
        for s in schemas
    ]
    _, completions = run_pass(engine, [schema_prompt(tokenizer, s) for s in schemas], params)
    invalid = [
        (i, c.text) for i, (c, s) in enumerate(zip(completions, schemas, strict=True)) if not is_valid(c, s)
    ]
    assert invalid == []
