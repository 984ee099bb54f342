"""Agent task families: each task's check passes on the environments' reference solution and fails on
the untouched workdir, in a real sandbox; names, seeds and history settings are as documented."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.agents.check import run_check
from tether.agents.families import FAMILIES, MAX_STEPS, family
from tether.agents.task import TaskSpec
from tether.envs.long_horizon.env import RepoSource
from tether.envs.shell import TASKS as SHELL_TASKS
from tether.envs.shell import ShellSource
from tether.errors import ConfigError
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    async with SandboxPool(SandboxSpec(timeout_s=30), PoolConfig(slots=2)) as running:
        yield running


def reference(name: str, seed: int) -> list[tuple[str, str]]:
    """(language, code) that solve the family's task of `seed`, from the environment's own source."""
    if name == "agent/shell":
        kinds = sorted(SHELL_TASKS)
        data = ShellSource(kinds[seed % len(kinds)]).problem(seed // len(kinds)).data
        return [("bash", command) for command in data["commands"]]
    modules = RepoSource(name.removeprefix("agent/")).problem(seed).data["modules"]
    return [("python", f"open({path!r}, 'w').write({source!r})") for path, source in modules.items()]


async def check_after(pool: SandboxPool, spec: TaskSpec, work: list[tuple[str, str]]) -> tuple[bool, float]:
    assert spec.check is not None
    async with await pool.open_session(spec.sandbox) as session:
        await session.upload(dict(spec.files))
        for language, code in work:
            await session.run(code, language)
        outcome = await run_check(session, spec, spec.check)
    return outcome.passed, outcome.fraction


@pytest.mark.parametrize(
    ("name", "seed"),
    [("agent/shell", seed) for seed in range(len(SHELL_TASKS))] + [("agent/ledger", 3), ("agent/textkit", 5)],
)
async def test_the_reference_solution_passes_the_check_and_no_work_fails_it(
    pool: SandboxPool, name: str, seed: int
) -> None:
    spec = family(name).task(seed)
    assert await check_after(pool, spec, reference(name, seed)) == (True, 1.0)
    passed, fraction = await check_after(pool, spec, [])
    assert not passed and fraction < 1.0


async def test_tampering_with_a_protected_file_fails_the_check(pool: SandboxPool) -> None:
    spec = family("agent/ledger").task(3)
    tamper = ("bash", "for f in tests/*.py; do echo '# edited' >> \"$f\"; done")
    passed, fraction = await check_after(pool, spec, [*reference("agent/ledger", 3), tamper])
    assert not passed and 0.5 < fraction < 1.0


FAKE_PASS = "import os\nprint('checks: 9/9', flush=True)\nos._exit(0)\n"


@pytest.mark.parametrize("module", ["json", "base64", "hashlib", "subprocess", "types"])
async def test_a_module_planted_in_the_workdir_cannot_fake_the_shell_check(
    pool: SandboxPool, module: str
) -> None:
    spec = family("agent/shell").task(0)
    plant = ("python", f"open({module + '.py'!r}, 'w').write({FAKE_PASS!r})")
    passed, fraction = await check_after(pool, spec, [plant])
    assert not passed and fraction < 1.0


# Each would have passed the checker that imported the package into its own process.
_EXIT_ON_IMPORT = FAKE_PASS
_PATCH_ON_IMPORT = (
    "import builtins, sys\n"
    "_print = builtins.print\n"
    "builtins.print = lambda *args, **kwargs: _print('checks: 9/9')\n"
    "sys.exit = lambda *args: None\n"
)
_EXIT_WHEN_CALLED = (
    "import os as _os\n"
    "def _fake(*args, **kwargs):\n"
    "    print('checks: 9/9', flush=True)\n"
    "    _os._exit(0)\n"
    "for _name, _value in list(globals().items()):\n"
    "    if callable(_value) and getattr(_value, '__module__', None) == __name__:\n"
    "        globals()[_name] = _fake\n"
)


def _append_to_modules(name: str, seed: int, code: str) -> list[tuple[str, str]]:
    modules = RepoSource(name.removeprefix("agent/")).problem(seed).data["modules"]
    return [("python", f"open({path!r}, 'a').write({code!r})") for path in modules]


@pytest.mark.parametrize(
    ("name", "seed", "attack"),
    [
        ("agent/ledger", 3, [("python", f"open('ledger/__init__.py', 'w').write({_EXIT_ON_IMPORT!r})")]),
        ("agent/textkit", 5, [("python", f"open('textkit/__init__.py', 'w').write({_PATCH_ON_IMPORT!r})")]),
        (
            "agent/ledger",
            3,
            [*reference("agent/ledger", 3), *_append_to_modules("agent/ledger", 3, _EXIT_WHEN_CALLED)],
        ),
        ("agent/ledger", 3, [("python", f"open('json.py', 'w').write({FAKE_PASS!r})")]),
    ],
    ids=["exit-on-import", "patch-on-import", "exit-when-called", "planted-json"],
)
async def test_a_package_that_fakes_its_result_fails_the_repository_check(
    pool: SandboxPool, name: str, seed: int, attack: list[tuple[str, str]]
) -> None:
    passed, fraction = await check_after(pool, family(name).task(seed), attack)
    assert not passed and fraction < 0.5


def test_family_tasks_keep_the_whole_history_and_end_with_finish() -> None:
    for name, agent_family in FAMILIES.items():
        spec = agent_family.task(1, max_steps=12)
        assert name.startswith("agent/") and spec.check is not None and spec.require_finish
        assert spec.limits.max_steps == 12 and spec.context.recent_steps == 12 and spec.context.recall_k == 0
        assert "finish" in spec.roles[0].tools and spec.files
    assert family("agent/shell").task(0).limits.max_steps == MAX_STEPS


def test_the_same_seed_gives_the_same_task_and_seeds_differ() -> None:
    shell = family("agent/shell")
    assert shell.task(4) == shell.task(4)
    assert len({json.dumps(shell.task(seed).files) for seed in range(14)}) == 14


@pytest.mark.parametrize("seed", [-1, True, 1.5])
def test_a_bad_seed_is_refused(seed: object) -> None:
    with pytest.raises(ConfigError, match="task seed"):
        family("agent/shell").task(seed)  # type: ignore[arg-type]


def test_an_unknown_family_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="agent/shell, agent/ledger, agent/textkit"):
        family("agent/nope")
