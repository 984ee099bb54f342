"""SQL environments: the database is seeded, queries run read-only in the sandbox, result sets compare."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.errors import EnvError
from tether.envs.sql import KINDS, same_result, sql_env
from tether.sandbox import PoolConfig, SandboxSpec

module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop that holds the module's pool


# One pool for the module: starting one costs about 0.4 s, more than most tests here.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(SandboxSpec(timeout_s=10, memory_mib=256), PoolConfig(slots=2)) as sandbox:
        yield ScoringContext(sandbox)


def test_the_database_and_question_follow_the_seed() -> None:
    env = sql_env("join")
    assert env.task(4) == env.task(4)
    assert env.task(4).data["setup"] != env.task(5).data["setup"]
    assert "INSERT INTO orders" in env.task(4).data["setup"]
    assert env.task(4).reference not in env.task(4).messages[1]["content"]


def test_unknown_kind_is_a_clear_error() -> None:
    with pytest.raises(EnvError, match=r"'pivot'.*filter"):
        sql_env("pivot")


@pytest.mark.parametrize(
    ("candidate", "ordered", "same"),
    [
        ({"columns": 1, "rows": [[2], [1]]}, False, True),
        ({"columns": 1, "rows": [[2], [1]]}, True, False),
        ({"columns": 1, "rows": [[1.0], [2]]}, True, True),
        ({"columns": 1, "rows": [[1], [2], [2]]}, False, False),
        ({"columns": 2, "rows": [[1, 0], [2, 0]]}, False, False),
        ({"error": "OperationalError"}, False, False),
    ],
)
def test_result_sets_compare_as_multisets_unless_ordered(
    candidate: dict[str, object], ordered: bool, same: bool
) -> None:
    reference = {"columns": 1, "rows": [[1], [2]]}
    assert same_result(reference, candidate, ordered) is same


@pytest.mark.parametrize("kind", list(KINDS))
@module_loop
async def test_reference_scores_one_and_wrong_queries_zero(kind: str, ctx: ScoringContext) -> None:
    env = sql_env(kind)
    for seed in range(2):
        task = env.task(seed)
        assert (await env.score(task, env.reference(task)[0]["content"], ctx.child())).total == 1.0
        for wrong in env.wrong_answers(task):
            assert (await env.score(task, wrong, ctx.child())).total == 0.0, wrong


@module_loop
async def test_an_equivalent_query_in_another_order_scores_one(ctx: ScoringContext) -> None:
    env = sql_env("filter")
    task = env.task(0)
    rewritten = f"SELECT * FROM ({task.reference}) ORDER BY name DESC"
    assert (await env.score(task, env.parser.format(rewritten), ctx.child())).total == 1.0


@pytest.mark.parametrize(
    "query",
    [
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
        "ATTACH DATABASE 'x.db' AS x",
        "PRAGMA writable_schema = ON",
        "SELECT load_extension('/tmp/x.so')",
        "INSERT INTO customers VALUES (999, 'x', 'y', 2020) RETURNING name",
    ],
)
@module_loop
async def test_runaway_or_writing_queries_score_zero(query: str, ctx: ScoringContext) -> None:
    env = sql_env("filter")
    task = env.task(1)
    assert (await env.score(task, env.parser.format(query), ctx.child())).total == 0.0
