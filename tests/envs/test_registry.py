"""The registry: names, lookups, plug-ins through entry points, and mixtures."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import (
    BUILTIN_FAMILIES,
    ENTRY_POINT_GROUP,
    EnvRegistry,
    Mixture,
    default_registry,
    load_mixture,
    parse_env_spec,
)
from tether.envs.rubric import answer_rubric, format_followed
from tether.envs.tasks import ChatRenderer, Problem


class Constant:
    def problem(self, seed: int) -> Problem:
        return Problem("q", "a")


def make(name: str) -> Environment:
    return Environment(name, Constant(), ChatRenderer("s"), ANSWER_TAG, answer_rubric(format_followed))


def registry_of(*names: str) -> EnvRegistry:
    registry = EnvRegistry()
    for name in names:
        registry.register(name, lambda name=name: make(name))
    return registry


def test_factories_run_once_on_first_lookup() -> None:
    calls: list[str] = []
    registry = EnvRegistry()

    def factory() -> Environment:
        calls.append("built")
        return make("fam/one")

    registry.register("fam/one", factory)
    assert calls == []
    assert registry.get("fam/one") is registry.get("fam/one")
    assert calls == ["built"]


def test_unknown_names_suggest_the_nearest_names_not_the_first_alphabetically() -> None:
    registry = registry_of("fam/aaa", "fam/abb", "fam/acc", "fam/add", "fam/aee", "fam/counting", "other/x")
    with pytest.raises(EnvError, match=r"unknown environment 'fam/countin' \(did you mean fam/counting\?\)"):
        registry.get("fam/countin")
    with pytest.raises(EnvError, match="families: fam, other"):  # nothing close: the families
        registry.get("zzzz/qqqqqqq")


def test_a_typo_in_a_builtin_name_is_answered_with_the_name_meant() -> None:
    with pytest.raises(EnvError, match=r"'rg/leg_countin' \(did you mean rg/leg_counting,"):
        default_registry().get("rg/leg_countin")


def test_duplicates_are_refused_unless_replaced() -> None:
    registry = registry_of("fam/one")
    with pytest.raises(EnvError, match="already registered"):
        registry.register("fam/one", lambda: make("fam/one"))
    registry.register("fam/one", lambda: make("fam/one"), replace=True)


@pytest.mark.parametrize("name", ["bad", "Fam/x", "fam/"])
def test_bad_names_are_refused_at_registration(name: str) -> None:
    with pytest.raises(EnvError, match="invalid"):
        EnvRegistry().register(name, lambda: make("fam/x"))


def test_a_factory_must_build_the_environment_it_was_registered_as() -> None:
    registry = EnvRegistry()
    registry.register("fam/one", lambda: make("fam/two"))
    with pytest.raises(EnvError, match="built an environment named 'fam/two'"):
        registry.get("fam/one")


def test_names_families_globs_and_info() -> None:
    registry = registry_of("b/x", "a/y", "a/x")
    assert registry.names() == ["a/x", "a/y", "b/x"]
    assert registry.names("a/*") == ["a/x", "a/y"]
    assert registry.families() == ["a", "b"]
    assert len(registry) == 3 and "a/x" in registry
    info = registry.info("a/x")
    assert info.to_dict() == {
        "name": "a/x",
        "family": "a",
        "turns": 1,
        "rewards": ["correctness", "format", "length"],
        "tools": [],
        "description": "",
    }


def test_resolve_expands_globs_keeps_order_and_refuses_what_matches_nothing() -> None:
    registry = registry_of("a/x", "a/y", "b/x")
    assert registry.resolve("b/x, a/*,a/x") == ["b/x", "a/x", "a/y"]
    with pytest.raises(EnvError, match="matches no registered"):
        registry.resolve("c/*")
    with pytest.raises(EnvError, match="no environment named"):
        registry.resolve(" , ")
    with pytest.raises(EnvError, match="unknown environment"):
        registry.resolve("a/z")


@pytest.fixture
def plugin_module() -> Iterator[str]:
    module = types.ModuleType("tether_test_plugin")

    def register(registry: EnvRegistry) -> None:
        registry.register("plug/one", lambda: make("plug/one"))

    module.register = register  # type: ignore[attr-defined]
    module.not_callable = 3  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module.__name__
    del sys.modules[module.__name__]


def test_entry_points_register_third_party_environments(plugin_module: str) -> None:
    point = importlib.metadata.EntryPoint("plug", f"{plugin_module}:register", ENTRY_POINT_GROUP)
    registry = EnvRegistry()
    registry.load_entry_points([point])
    assert registry.names() == ["plug/one"]


@pytest.mark.parametrize(
    ("value", "message"),
    [("tether_no_such_module:register", "failed to load"), ("{module}:not_callable", "not a register")],
)
def test_broken_entry_points_are_named(plugin_module: str, value: str, message: str) -> None:
    point = importlib.metadata.EntryPoint("broken", value.format(module=plugin_module), ENTRY_POINT_GROUP)
    with pytest.raises(EnvError, match=f"entry point 'broken'.*{message}"):
        EnvRegistry().load_entry_points([point])


def test_a_module_without_register_is_refused() -> None:
    with pytest.raises(EnvError, match="has no register"):
        EnvRegistry().load_module("json")


def test_the_default_registry_holds_every_builtin_family_each_from_its_module() -> None:
    registry = default_registry()
    for family, module in BUILTIN_FAMILIES.items():
        names = registry.names(f"{family}/*")
        assert names and all(registry.source_of(name).startswith(module) for name in names), family
    assert set(registry.families()) == set(BUILTIN_FAMILIES)
    assert len(registry) >= 100


def test_the_bench_task_is_a_builtin_environment_for_every_command() -> None:
    assert default_registry().names("bench/*") == ["bench/integer_arithmetic"]


def test_a_family_module_is_imported_only_when_a_name_of_it_is_needed(plugin_module: str) -> None:
    # The second family's module does not exist: importing it would fail the lookups below.
    registry = default_registry(
        {"plug": plugin_module, "absent": "tether_no_such_module"}, entry_points=False
    )
    assert registry.families() == ["absent", "plug"]
    assert registry.get("plug/one").name == "plug/one"
    assert registry.names("plug/*") == ["plug/one"] and "plug/one" in registry
    with pytest.raises(ModuleNotFoundError, match="tether_no_such_module"):
        registry.names()


def test_deferred_entry_points_load_when_a_name_is_not_built_in(plugin_module: str) -> None:
    point = importlib.metadata.EntryPoint("plug", f"{plugin_module}:register", ENTRY_POINT_GROUP)
    registry = EnvRegistry()
    registry.defer_entry_points([point])
    assert registry.get("plug/one").name == "plug/one"
    assert registry.source_of("plug/one") == "entry point plug"


def test_mixture_counts_split_by_weight_and_sum_to_the_total() -> None:
    mixture = Mixture((("a/x", 1.0), ("a/y", 2.0), ("b/x", 1.0)))
    assert mixture.counts(8) == {"a/x": 2, "a/y": 4, "b/x": 2}
    counts = mixture.counts(7)
    assert sum(counts.values()) == 7 and counts["a/y"] >= 3
    assert mixture.counts(0) == {"a/x": 0, "a/y": 0, "b/x": 0}


def test_mixture_samples_are_reproducible_and_follow_the_weights() -> None:
    mixture = Mixture((("a/x", 1.0), ("a/y", 9.0)))
    draws = mixture.sample(2000, seed=3)
    assert draws == mixture.sample(2000, seed=3)
    assert draws != mixture.sample(2000, seed=4)
    share = sum(name == "a/y" for name, _ in draws) / len(draws)
    assert 0.85 < share < 0.95


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ((), "at least one"),
        ((("a/x", 0.0),), "positive"),
        ((("a/x", float("nan")),), "positive"),
        ((("a/x", 1.0), ("a/x", 2.0)), "twice"),
        ((("bad", 1.0),), "invalid"),
    ],
)
def test_invalid_mixtures_are_refused(entries: tuple[tuple[str, float], ...], message: str) -> None:
    with pytest.raises(EnvError, match=message):
        Mixture(entries)


def test_mixture_files_expand_globs(tmp_path: Path) -> None:
    registry = registry_of("a/x", "a/y", "b/x")
    path = tmp_path / "mix.toml"
    path.write_text('[weights]\n"a/*" = 2\n"b/x" = 1.5\n')
    assert load_mixture(registry, path).entries == (("a/x", 2.0), ("a/y", 2.0), ("b/x", 1.5))
    assert parse_env_spec(registry, f"@{path}").names == ["a/x", "a/y", "b/x"]
    assert parse_env_spec(registry, "b/x,a/x").entries == (("b/x", 1.0), ("a/x", 1.0))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("weights = [", "not valid TOML"),
        ("[weights]\n", "weights"),
        ('[weights]\n"a/x" = "heavy"\n', "weights.a/x"),
        ('[weights]\n"a/x" = -1\n', "positive"),
        ('[weights]\n"c/*" = 1\n', "matches no registered"),
        ('name = "x"\n[weights]\n"a/x" = 1\n', "unknown key 'name'"),
    ],
)
def test_bad_mixture_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "mix.toml"
    path.write_text(text)
    with pytest.raises(EnvError, match=message):
        load_mixture(registry_of("a/x"), path)


def test_a_missing_mixture_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match="does not exist"):
        parse_env_spec(registry_of("a/x"), f"@{tmp_path / 'nope.toml'}")
