"""Code environments: references score 1, wrong and adversarial answers 0, and the harness holds."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.envs.code import CodeBlockParser, family_env, humaneval_env, run_calls, run_check
from tether.envs.code.envs import FAMILIES, task_from_data
from tether.envs.code.families import Lang, same_value
from tether.envs.code.harness import decode, encode
from tether.envs.code.humaneval import problem_by_id, problems
from tether.envs.code.native import encode_inputs, render_value
from tether.envs.code.runner import parse_call_frames
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.errors import EnvError
from tether.sandbox import PoolConfig, SandboxSpec

PYTHON = [f for f in FAMILIES if f.language is Lang.PYTHON]
NATIVE = [f for f in FAMILIES if f.language is not Lang.PYTHON]


module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop that holds the module's pool


# One pool for the module: starting one costs about 0.4 s, more than most tests here.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(SandboxSpec(timeout_s=10, memory_mib=256), PoolConfig(slots=2)) as sandbox:
        yield ScoringContext(sandbox)


# --- pure parts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -3,
        2**80,
        1.5,
        float("inf"),
        "s",
        b"\x00b",
        1 + 2j,
        [1, (2, 3)],
        {"a": {1, 2}},
        {(1, 2): frozenset({3})},
        ([], {}, set()),
    ],
)
def test_codec_round_trips_plain_data(value: object) -> None:
    assert same_value(decode(json.loads(json.dumps(encode(value)))), value)


@pytest.mark.parametrize("value", [object(), type("L", (list,), {})([1]), type("I", (int,), {})(3), len])
def test_codec_refuses_anything_but_plain_data(value: object) -> None:
    with pytest.raises(TypeError, match="plain data only"):
        encode(value)


@pytest.mark.parametrize(
    "data", [{"x": [1]}, {"l": 1}, {"l": [], "t": []}, {"d": [[1]]}, {"s": [{"l": []}]}, [1]]
)
def test_decode_rejects_forged_values(data: object) -> None:
    with pytest.raises(ValueError):
        decode(data)


@pytest.mark.parametrize(
    ("got", "want", "same"),
    [
        (True, 1, False),
        (1, 1.0, True),
        ((1,), [1], False),
        ([1.0], [1.0000000000001], True),
        ({"a": 1}, {"a": 1}, True),
    ],
)
def test_same_value_does_not_coerce(got: object, want: object, same: bool) -> None:
    assert same_value(got, want) is same


def test_parser_takes_exactly_one_block_in_the_right_language() -> None:
    parser = CodeBlockParser("python")
    assert (
        parser.parse("Here:\n```python\ndef f():\n    return 1\n```\nDone.").answer
        == "def f():\n    return 1\n"
    )
    assert parser.parse("```\nx = 1\n```").well_formed
    assert parser.parse("def f(): return 1").answer is None
    assert parser.parse("```c\nint f(void);\n```").answer is None
    assert parser.parse("```python\na = 1\n```\n```python\na = 2\n```").answer is None
    assert parser.parse("```python\n\n```").answer is None
    assert parser.parse(parser.format("x = 1")).answer == "x = 1\n"


def test_parser_rejects_an_unknown_language() -> None:
    with pytest.raises(ValueError, match="'cobol'"):
        CodeBlockParser("cobol")


def test_frames_need_the_nonce_and_exactly_one_result_per_call() -> None:
    stdout = (
        'junk\nN 0 {"ok": 1}\nX 1 {"ok": 2}\nN 1 {"ok": 2}\nN 1 {"ok": 3}\nN 2 {"error": "boom"}\nN 3 oops\n'
    )
    outcomes = parse_call_frames(stdout, "N", 5)
    assert outcomes[0].value == 1 and outcomes[0].ok
    assert outcomes[1].error == "duplicate result"
    assert outcomes[2].error == "boom"
    assert outcomes[3].error is not None and outcomes[3].error.startswith("malformed frame")
    assert outcomes[4].error == "no result"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_families_are_seeded_and_vary_with_the_seed(family: object) -> None:
    env = family_env(family)  # type: ignore[arg-type]
    first, again = env.task(7), env.task(7)
    assert first.to_dict() == again.to_dict()
    prompts = {env.task(seed).messages[1]["content"] for seed in range(12)}
    assert len(prompts) >= 6
    # Two examples in the prompt; the other hidden tests (at least ten more) are not shown.
    prompt = first.messages[1]["content"]
    entry = first.data["entry"]
    assert sum(line.startswith(f"    {entry}(") for line in prompt.splitlines()) == 2
    assert len(first.data["calls"]) >= 12


def test_native_values_cross_as_text() -> None:
    task = family_env(next(f for f in NATIVE if f.name == "cpp-words")).task(0)
    line = encode_inputs(task_from_data(task.data), "NONCE")
    assert line.startswith(f"NONCE {len(task.data['calls'])} ")
    first = task.data["calls"][0][0]
    assert f" {len(first)} {first}" in line
    assert render_value("string", "ab") == "x6162"
    assert render_value("int_list", [3, -1]) == "2 3 -1"
    assert render_value("bool", True) == "1"


def test_unknown_humaneval_task_is_a_clear_error() -> None:
    assert len(problems()) == 164
    with pytest.raises(EnvError, match="HumanEval/999"):
        problem_by_id("HumanEval/999")


# --- through the sandbox -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", PYTHON, ids=lambda f: f.name)
@module_loop
async def test_python_family_reference_scores_one_and_wrong_answers_zero(
    family: object, ctx: ScoringContext
) -> None:
    env = family_env(family)  # type: ignore[arg-type]
    for seed in range(2):  # the registry-wide slow test covers 20 seeds
        task = env.task(seed)
        score = await env.score(task, env.reference(task)[0]["content"], ctx.child())
        assert score.total == 1.0, score
        for wrong in env.wrong_answers(task):
            bad = await env.score(task, wrong, ctx.child())
            assert bad.total == 0.0, (wrong, bad)


@pytest.mark.parametrize("family", NATIVE, ids=lambda f: f.name)
@module_loop
async def test_native_family_reference_scores_one_and_wrong_answers_zero(
    family: object, ctx: ScoringContext
) -> None:
    env = family_env(family)  # type: ignore[arg-type]
    task = env.task(1)
    assert (await env.score(task, env.reference(task)[0]["content"], ctx.child())).total == 1.0
    for wrong in env.wrong_answers(task):
        assert (await env.score(task, wrong, ctx.child())).total == 0.0, wrong


@module_loop
async def test_partial_credit_counts_passing_tests_but_the_gate_zeroes_the_total(ctx: ScoringContext) -> None:
    env = family_env(next(f for f in PYTHON if f.name == "py-rotate"))
    task = env.task(3)
    # Right except for k >= len(xs): some hidden tests pass, not all.
    answer = "def rotate(xs, k):\n    return [] if not xs or k >= len(xs) else " + (
        "xs[-k:] + xs[:-k] if k else list(xs)"
        if "right" in task.messages[1]["content"]
        else "xs[k:] + xs[:k]"
    )
    score = await env.score(task, env.parser.format(answer), ctx.child())
    assert 0.0 < score.components["tests"] < 1.0
    assert score.components["correctness"] == 0.0 and score.total == 0.0


@module_loop
async def test_a_runaway_call_times_out_and_earlier_results_still_count(ctx: ScoringContext) -> None:
    source = "def f(x):\n    while x == 2:\n        pass\n    return x\n"
    outcomes = await run_calls(ctx, source, "f", [[1], [2], [3]], call_timeout_s=0.3)
    assert outcomes[0].value == 1
    assert outcomes[1].error is not None and "timed out" in outcomes[1].error
    assert outcomes[2].value == 3


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "class E:\n    def __eq__(self, o):\n        return True\n\ndef f(x):\n    return E()\n",
        "def f(x):\n    return [E for E in [1]] and type('L', (list,), {})([x])\n",
        "import os\ndef f(x):\n    os.write(1, b'NONCE 0 {\"ok\": 1}\\n')\n    return 0\n",
        "import sys\ndef f(x):\n    return sys.stdin.read()\n",
    ],
)
@module_loop
async def test_candidate_tricks_do_not_produce_a_right_result(source: str, ctx: ScoringContext) -> None:
    outcomes = await run_calls(ctx, source, "f", [[1]])
    assert not (outcomes[0].ok and same_value(outcomes[0].value, 1))


@module_loop
async def test_printing_does_not_disturb_the_frames(ctx: ScoringContext) -> None:
    source = (
        "import sys\ndef f(x):\n    print('noise', end='')\n    sys.stderr.write('x' * 10**5)\n    return x\n"
    )
    outcomes = await run_calls(ctx, source, "f", [[1], [2]])
    assert [o.value for o in outcomes] == [1, 2]


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos._exit(0)\n",
        "import os\ndef add(x, y):\n    os.write(1, b'verdict {\"passed\": true}\\n')\n    os.kill(1, 9)\n",
        "def add(x, y):\n    raise SystemExit(0)\n",
        "def add(x, y):\n    print('verdict {\"passed\": true}')\n    return 0\n",
        "import gc\ndef add(x, y):\n    return [o for o in gc.get_objects() if type(o) is str][-40:]\n",
    ],
)
@module_loop
async def test_check_mode_verdict_cannot_be_forged(source: str, ctx: ScoringContext) -> None:
    test = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
    verdict = await run_check(ctx, source, "add", test)
    assert not verdict.passed


@module_loop
async def test_check_mode_passes_a_right_answer_that_prints(ctx: ScoringContext) -> None:
    test = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert add(1, 1) == 2\n"
    verdict = await run_check(ctx, "def add(x, y):\n    print('hi')\n    return x + y\n", "add", test)
    assert verdict.passed, verdict


@module_loop
async def test_humaneval_references_pass_and_adversarial_answers_fail(ctx: ScoringContext) -> None:
    env = humaneval_env()
    for seed in (0, 32, 33, 38, 163):
        task = env.task(seed)
        assert (await env.score(task, env.reference(task)[0]["content"], ctx.child())).total == 1.0
        for wrong in env.wrong_answers(task):
            assert (await env.score(task, wrong, ctx.child())).total == 0.0, wrong


@pytest.mark.slow
@module_loop
async def test_all_humaneval_canonical_solutions_pass_and_stubs_fail(ctx: ScoringContext) -> None:
    env = humaneval_env()
    for seed in range(164):
        task = env.task(seed)
        assert (await env.score(task, env.reference(task)[0]["content"], ctx.child())).total == 1.0, seed
        stub = env.parser.format(problem_by_id(task.data["task_id"]).prompt + "    return None\n")
        assert (await env.score(task, stub, ctx.child())).total == 0.0, seed


@module_loop
async def test_a_looping_compiled_answer_is_cut_short(ctx: ScoringContext) -> None:
    env = family_env(next(f for f in NATIVE if f.name == "c-digits"))
    task = env.task(0)
    started = time.monotonic()
    answer = env.parser.format("long long digit_sum(long long n) {\n    for (;;) {}\n}\n")
    assert (await env.score(task, answer, ctx.child())).total == 0.0
    assert time.monotonic() - started < 9  # the run is capped at 5 s; this module's pool allows 10 s
