"""Episode quality checks: a polluted start and a changed protected file are violations, found in the
sandbox by trusted programs that planted modules cannot fool."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.envs import qc
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.scoring import EpisodeState
from tether.envs.tasks import Task
from tether.sandbox import PoolConfig, SandboxSpec

DIGEST = "a" * 64


@pytest_asyncio.fixture
async def state() -> AsyncIterator[EpisodeState]:
    async with SandboxProvider(SandboxSpec(timeout_s=10, memory_mib=256), PoolConfig(slots=1)) as sandbox:
        ctx = ScoringContext(sandbox)
        session = await ctx.open_session()
        task = Task(env="shell/test", seed=0, messages=[], reference="")
        yield EpisodeState(task=task, ctx=ctx, messages=[], session=session)
        await session.close()


@pytest.mark.parametrize(
    ("after", "reason"),
    [
        ({"t.py": DIGEST}, None),
        ({"t.py": "b" * 64}, "protected file t.py changed"),
        ({"t.py": "missing"}, "protected file t.py missing"),
        ({}, "protected file t.py missing"),
        ({"t.py": "not a regular file"}, "protected file t.py not a regular file"),
    ],
)
def test_violation_names_the_file_and_what_happened(after: dict[str, str], reason: str | None) -> None:
    assert qc.violation_after_step({"t.py": DIGEST}, after) == reason


async def test_a_fresh_session_is_clean_and_a_used_one_is_not(state: EpisodeState) -> None:
    await qc.start_clean(state)
    assert await qc.protected_files_unchanged(state) is None
    await state.require_session().upload({"leftover.txt": "from an earlier episode"})
    await state.run("touch /tmp/stale", "bash")
    await qc.start_clean(state)
    reason = await qc.protected_files_unchanged(state)
    assert reason is not None and "./leftover.txt" in reason and "/tmp/stale" in reason


async def test_protected_checksums_catch_edits_links_and_removal(state: EpisodeState) -> None:
    await state.require_session().upload({"tests/t.py": "assert True\n", "grader.py": "x = 1\n"})
    await qc.protect(state, ["tests/t.py", "grader.py"])
    assert await qc.protected_files_unchanged(state) is None
    await state.run("echo '# harmless' >> notes.txt", "bash")
    assert await qc.protected_files_unchanged(state) is None
    await state.run("echo 'assert 1' > tests/t.py", "bash")
    assert await qc.protected_files_unchanged(state) == "protected file tests/t.py changed"
    await state.run("printf 'assert True\\n' > tests/t.py && ln -sf /dev/null grader.py", "bash")
    assert await qc.protected_files_unchanged(state) == "protected file grader.py not a regular file"


async def test_planted_hashlib_cannot_forge_checksums(state: EpisodeState) -> None:
    await state.require_session().upload({"t.py": "original\n"})
    await qc.protect(state, ["t.py"])
    planted = (
        "def sha256(data=b''):\n    class H:\n        def hexdigest(self):\n"
        "            return %r\n    return H()\n"
    )
    await state.require_session().upload({"hashlib.py": planted % state.info["qc.protected"]["t.py"]})
    await state.run("echo changed > t.py", "bash")
    assert await qc.protected_files_unchanged(state) == "protected file t.py changed"


async def test_protecting_a_missing_fixture_is_an_error(state: EpisodeState) -> None:
    with pytest.raises(RuntimeError, match="not in place"):
        await qc.protect(state, ["nope.txt"])
