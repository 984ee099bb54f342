"""Environments by name (`family/name`), from built-in domain modules and third-party entry points.

How a domain plugs in: a module exposes `register(registry: EnvRegistry) -> None`, which calls
`registry.register("family/name", factory)` for each environment (the factory builds the
`Environment` on first lookup, so listing hundreds of names stays cheap). Built-in modules are named
by family in `BUILTIN_FAMILIES`; a third-party package declares the same function under the
entry-point group `tether.envs`:

    [project.entry-points."tether.envs"]
    mydomain = "mypackage.envs:register"

`default_registry()` holds every built-in family and plug-in, every command uses it, and it imports
nothing up front: a family's module is imported when a name of that family is first looked up
(reasoning-gym alone takes seconds), and every module and plug-in when all names are needed (listing,
a glob over families, a name no loaded module has). A name is looked up in its own family's module
first.

A mixture is a weighted list of names (`Mixture`, read from TOML by `load_mixture`).
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import importlib.metadata
import math
import random
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.tasks import MAX_SEED, check_name
from tether.errors import describe_validation_error

ENTRY_POINT_GROUP = "tether.envs"
# Family -> the module whose `register(registry)` registers that family's names (and only those).
# A new built-in domain is one more line here.
BUILTIN_FAMILIES: dict[str, str] = {
    "rg": "tether.envs.reasoning_gym",
    "math": "tether.envs.math",
    "structured": "tether.envs.structured",
    "finance": "tether.envs.finance",
    "code": "tether.envs.code",
    "sql": "tether.envs.sql",
    "shell": "tether.envs.shell",
    "long": "tether.envs.long_horizon",
    "bench": "tether.envs.bench",
}
SUGGESTIONS = 5  # nearest names offered for an unknown one

EnvFactory = Callable[[], Environment]
RegisterFn = Callable[["EnvRegistry"], None]


@dataclass(frozen=True, slots=True)
class EnvInfo:
    """What `tether envs list` shows, without generating any task."""

    name: str
    family: str
    max_turns: int
    rewards: list[str]
    tools: list[str]
    description: str

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "family": self.family,
            "turns": self.max_turns,
            "rewards": self.rewards,
            "tools": self.tools,
            "description": self.description,
        }


class EnvRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, EnvFactory] = {}
        self._built: dict[str, Environment] = {}
        self._sources: dict[str, str] = {}  # name -> module or entry point that registered it
        self._deferred: dict[str, str] = {}  # family -> module not imported yet
        self._deferred_plugins: Callable[[], None] | None = None  # loads the entry points

    def register(self, name: str, factory: EnvFactory, *, source: str = "", replace: bool = False) -> None:
        check_name(name)
        if name in self._factories and not replace:
            raise EnvError(
                f"environment {name!r} is already registered (by {self._sources[name] or 'unknown'}); "
                "pass replace=True to override it"
            )
        self._factories[name] = factory
        self._sources[name] = source
        self._built.pop(name, None)

    def add(self, env: Environment, *, source: str = "", replace: bool = False) -> None:
        """Register an environment that is already built."""
        self.register(env.name, lambda: env, source=source, replace=replace)

    def defer(self, family: str, module: str) -> None:
        """Import `module` and call its `register(registry)` when `family` is first needed."""
        self._deferred[family] = module

    def defer_entry_points(self, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> None:
        """Load the plug-ins (default: the installed `tether.envs` entry points) when they may be needed."""
        self._deferred_plugins = lambda: self.load_entry_points(entry_points)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name)

    def __len__(self) -> int:
        self._load_everything()
        return len(self._factories)

    def get(self, name: str) -> Environment:
        if not self._find(name):
            raise EnvError(f"unknown environment {name!r}{self._suggest(name)}; `tether envs list` shows all")
        if name not in self._built:
            env = self._factories[name]()
            if env.name != name:
                raise EnvError(f"the factory registered as {name!r} built an environment named {env.name!r}")
            self._built[name] = env
        return self._built[name]

    def _find(self, name: str) -> bool:
        """Whether `name` is registered, loading its family's module, then everything, until it is."""
        if name not in self._factories:
            self._load_family(name.split("/", 1)[0])
        if name not in self._factories:
            self._load_everything()
        return name in self._factories

    def _load_family(self, family: str) -> None:
        module = self._deferred.pop(family, None)
        if module is not None:
            before = set(self._factories)
            self.load_module(module)
            outside = sorted(n for n in set(self._factories) - before if not n.startswith(f"{family}/"))
            assert not outside, f"{module}, deferred as family {family!r}, registered {outside}"

    def _load_plugins(self) -> None:
        load, self._deferred_plugins = self._deferred_plugins, None
        if load is not None:
            load()

    def _load_everything(self) -> None:
        for family in list(self._deferred):
            self._load_family(family)
        self._load_plugins()

    def close_names(self, name: str) -> list[str]:
        """The registered names nearest to `name` (a typo, a glob without matches), nearest first."""
        self._load_everything()
        return difflib.get_close_matches(name, self._factories, n=SUGGESTIONS)

    def _suggest(self, name: str) -> str:
        close = self.close_names(name)
        if close:
            return f" (did you mean {', '.join(close)}?)"
        return f" (families: {', '.join(self.families())})" if self._factories else ""

    def names(self, pattern: str | None = None) -> list[str]:
        """All names, sorted; `pattern` is a shell glob such as `rg/*`."""
        family = (pattern or "*").split("/", 1)[0]
        if any(c in family for c in "*?["):
            self._load_everything()
        else:  # one family: its module and the plug-ins, which may add to it
            self._load_family(family)
            self._load_plugins()
        names = sorted(self._factories)
        return names if pattern is None else [n for n in names if fnmatch.fnmatchcase(n, pattern)]

    def source_of(self, name: str) -> str:
        """The module or entry point that registered `name` ('' when registered directly)."""
        self.get(name)
        return self._sources[name]

    def families(self) -> list[str]:
        """Every family, without importing the deferred modules."""
        self._load_plugins()
        return sorted({name.split("/", 1)[0] for name in self._factories} | set(self._deferred))

    def info(self, name: str) -> EnvInfo:
        env = self.get(name)
        return EnvInfo(
            name=env.name,
            family=env.family,
            max_turns=env.max_turns,
            rewards=env.rubric.names,
            tools=[tool.spec.name for tool in env.tools],
            description=env.description,
        )

    def resolve(self, spec: str) -> list[str]:
        """Names from a comma-separated list whose items may be globs; every item must match something."""
        names: list[str] = []
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            matched = self.names(item) if any(c in item for c in "*?[") else [item]
            if not matched:
                raise EnvError(f"pattern {item!r} matches no registered environment")
            for name in matched:
                self.get(name)  # validates the name and builds the environment
                if name not in names:
                    names.append(name)
        if not names:
            raise EnvError(f"no environment named in {spec!r}")
        return names

    def load_module(self, module: str) -> None:
        register = getattr(importlib.import_module(module), "register", None)
        if not callable(register):
            raise EnvError(f"environment module {module!r} has no register(registry) function")
        self._call(register, module)

    def load_entry_points(self, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> None:
        points = (
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if entry_points is None else entry_points
        )
        for point in points:
            try:
                register = point.load()
            except Exception as error:  # a broken plug-in is named, not allowed to hide the others' error
                raise EnvError(
                    f"entry point {point.name!r} ({point.value}) failed to load: {error}"
                ) from error
            if not callable(register):
                raise EnvError(
                    f"entry point {point.name!r} ({point.value}) is not a register(registry) function"
                )
            self._call(register, f"entry point {point.name}")

    def _call(self, register: RegisterFn, source: str) -> None:
        before = set(self._factories)
        register(self)
        for name in set(self._factories) - before:
            self._sources[name] = self._sources[name] or source


def default_registry(families: dict[str, str] = BUILTIN_FAMILIES, entry_points: bool = True) -> EnvRegistry:
    """The registry every command uses: the built-in families and, unless disabled, every installed
    plug-in, each imported on first use."""
    registry = EnvRegistry()
    for family, module in families.items():
        registry.defer(family, module)
    if entry_points:
        registry.defer_entry_points()
    return registry


@dataclass(frozen=True, slots=True)
class Mixture:
    """A weighted list of environment names: what the trainer samples from and eval splits over."""

    entries: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        if not self.entries:
            raise EnvError("a mixture needs at least one environment")
        for name, weight in self.entries:
            check_name(name)
            if not (math.isfinite(weight) and weight > 0):
                raise EnvError(f"mixture weight of {name!r} is {weight!r}: expected a positive number")
        names = [name for name, _ in self.entries]
        if len(set(names)) != len(names):
            raise EnvError(f"mixture names an environment twice: {names}")

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.entries]

    def counts(self, total: int) -> dict[str, int]:
        """`total` episodes split by weight (largest remainder), so the counts always sum to `total`."""
        if total < 0:
            raise EnvError(f"episode count {total!r} must be >= 0")
        weight_sum = sum(weight for _, weight in self.entries)
        exact = {name: total * weight / weight_sum for name, weight in self.entries}
        counts = {name: math.floor(value) for name, value in exact.items()}
        by_remainder = sorted(exact, key=lambda name: (counts[name] - exact[name], name))
        for name in by_remainder[: total - sum(counts.values())]:
            counts[name] += 1
        return counts

    def sample(self, count: int, seed: int) -> list[tuple[str, int]]:
        """`count` (environment, task seed) pairs drawn by weight; the same seed gives the same list."""
        rng = random.Random(seed)
        names, weights = self.names, [weight for _, weight in self.entries]
        return [(rng.choices(names, weights)[0], rng.randint(0, MAX_SEED)) for _ in range(count)]


class _MixtureFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float] = Field(
        min_length=1, description="Environment name or glob -> weight; a glob gives each match the weight."
    )


def mixture_from_weights(registry: EnvRegistry, weights: dict[str, float]) -> Mixture:
    entries: dict[str, float] = {}
    for item, weight in weights.items():
        for name in registry.resolve(item):
            entries[name] = weight
    return Mixture(tuple(entries.items()))


def load_mixture(registry: EnvRegistry, path: Path) -> Mixture:
    """A mixture file: a TOML table `[weights]` of `"name-or-glob" = weight` lines."""
    if not path.is_file():
        raise EnvError(f"mixture file {str(path)!r} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise EnvError(f"mixture file {str(path)!r} is not valid TOML: {error}") from None
    try:
        parsed = _MixtureFile.model_validate(raw)
    except ValidationError as error:
        raise EnvError(describe_validation_error(error, f"mixture file {path}", _MixtureFile)) from None
    return mixture_from_weights(registry, parsed.weights)


def parse_env_spec(registry: EnvRegistry, spec: str) -> Mixture:
    """`NAME[,NAME...]` (globs allowed, equal weights) or `@file.toml` (a mixture file)."""
    if spec.startswith("@"):
        return load_mixture(registry, Path(spec[1:]))
    return Mixture(tuple((name, 1.0) for name in registry.resolve(spec)))
