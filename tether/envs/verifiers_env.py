"""Environments written for `verifiers` (PyPI, the classic 0.1.x API that prime-rl's Environments Hub
packages use) as tether `Environment`s, so the community's environments train here without rewriting.

What maps to what (`from_verifiers`):
- the dataset (verifiers has already formatted it: `prompt` messages with its system prompt and
  few-shot, `answer`, `task`, `info`) -> tasks: seed `s` is row `s % len(rows)`, its prompt as it is;
- the parser -> `Parsed`: the answer is `parser.parse_answer(completion)`, well formed when not empty;
- the rubric's functions and weights -> one `Reward` per function (its `__name__`, made a valid name),
  each called with verifiers' own keyword arguments (prompt, completion, answer, state, task, info,
  parser and the rubric's other class objects), sync or async. verifiers sums `weight * value`; tether
  takes a weighted mean of components in [0, 1], so a function of negative weight `w` becomes the
  component `1 - value` of weight `|w|`, and our total is `(verifiers total + sum of |negative
  weights|) / sum of |weights|`: the same ranking, an affine rescaling. Values are first mapped from
  `reward_range` (default [0, 1]) to [0, 1]; a value outside it is not clipped: the rubric rejects it
  (an invalid reward, never a silent 0), and so is a function that raises or returns no number, where
  verifiers would log and score 0;
- `SingleTurnEnv` -> single-turn; `ToolEnv` -> tether `Tool`s that run the environment's own
  `call_tool` (its error formatting included); any other `MultiTurnEnv` -> a `responder` calling its
  `is_completed` and `env_response` after each reply, with verifiers' `state` dict (`setup_state` run
  once) kept in the episode's `info` and given to the reward functions.

Registration: `register_verifiers(registry, {"NAME": VerifiersSpec(module, args)})` names them
`vf/NAME`; a train config's `[envs.verifiers.NAME]` does it for a run (and for `tether envs ... --config`),
and a plug-in's `tether.envs` entry point may call it from its `register(registry)`.

Limits: verifiers tools, `env_response` and reward functions run in this process (the trainer's), not
in the sandbox as tether's own tools do: load only environments you trust. No model is ever reached
(`rollout` and `get_model_response` are not called), so `state["responses"]` stays empty. Completion
(non-chat) environments, `EnvGroup`, `StatefulToolEnv`, `ToolEnv` subclasses that override
`env_response` or `is_completed`, and `JudgeRubric` (it calls a model: use tether's `judge` component)
are refused with a clear error.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tether.chat import ChatError, JsonDict, Messages, ToolSpec, message_text
from tether.envs.episode import Environment, Responder
from tether.envs.errors import EnvError
from tether.envs.scoring import EpisodeState, Reward, RewardInput, Rubric
from tether.envs.tasks import Parsed, Problem, check_json
from tether.tools import ReplayPolicy, Tool, Workspace

if TYPE_CHECKING:
    from tether.envs.registry import EnvRegistry

FAMILY = "vf"
STATE_KEY = "verifiers_state"  # EpisodeState.info key of verifiers' own state dict
DEFAULT_MAX_TURNS = 10  # for a MultiTurnEnv whose own max_turns is unlimited (-1)
INSTALL_HINT = "install the extra: pip install 'tether[verifiers]'"


def _verifiers() -> Any:
    """The `verifiers` package, imported on first use (it pulls in `datasets`, seconds to import)."""
    try:
        return importlib.import_module("verifiers")
    except ImportError as error:
        raise EnvError(
            f"verifiers environments need the `verifiers` package ({INSTALL_HINT}): {error}"
        ) from None


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass(frozen=True, slots=True)
class VerifiersSpec:
    """Where a verifiers environment comes from and how it is adapted (`[envs.verifiers.NAME]`)."""

    module: str  # a module with load_environment(**args), e.g. an installed Hub package `vf_gsm8k`
    args: dict[str, Any] = field(default_factory=dict)
    max_turns: int = DEFAULT_MAX_TURNS  # used when the environment's own max_turns is unlimited
    reward_range: tuple[float, float] = (0.0, 1.0)  # what its reward functions return, mapped to [0, 1]


def load_verifiers_environment(source: str | ModuleType, args: Mapping[str, Any] | None = None) -> Any:
    """The verifiers `Environment` that `source` (a module or its name; '-' read as '_', as verifiers
    does) builds with `load_environment(**args)`."""
    vf = _verifiers()
    module = source
    if isinstance(source, str):
        name = source.replace("-", "_")
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            raise EnvError(
                f"verifiers environment module {name!r} is not installed ({error}); install its package "
                "(e.g. from the Environments Hub) into this environment"
            ) from None
    assert isinstance(module, ModuleType)
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise EnvError(
            f"module {module.__name__!r} has no load_environment(**args) function: it is not a verifiers "
            "environment (or another module shadows its name)"
        )
    try:
        inspect.signature(load).bind(**dict(args or {}))
    except TypeError as error:
        raise EnvError(
            f"{module.__name__}.load_environment{inspect.signature(load)} does not accept args "
            f"{dict(args or {})!r}: {error}"
        ) from None
    env = load(**dict(args or {}))
    if not isinstance(env, vf.Environment):
        raise EnvError(
            f"{module.__name__}.load_environment returned {type(env).__name__}, not a verifiers Environment"
        )
    return env


@dataclass(frozen=True, slots=True)
class DatasetSource:
    """Tasks from verifiers' formatted rows: seed `s` is row `s % len(rows)`."""

    rows: tuple[JsonDict, ...]

    def problem(self, seed: int) -> Problem:
        index = seed % len(self.rows)
        row = self.rows[index]
        user = [m for m in row["prompt"] if m.get("role") == "user"]
        return Problem(
            prompt=message_text(user[-1]) if user else "",
            answer=str(row["answer"]),
            data={"row": index, **copy.deepcopy(row)},
        )


@dataclass(frozen=True, slots=True)
class RowRenderer:
    """The row's own prompt messages: verifiers already put its system prompt and few-shot in them."""

    def render(self, problem: Problem) -> Messages:
        return copy.deepcopy(problem.data["prompt"])


def _rows(env: Any, name: str) -> tuple[JsonDict, ...]:
    dataset = env.dataset if env.dataset is not None else env.eval_dataset
    if dataset is None or len(dataset) == 0:
        raise EnvError(f"{name}: the verifiers environment has no dataset rows to draw tasks from")
    rows = []
    for index, raw in enumerate(dataset):
        prompt = raw.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise EnvError(f"{name}: dataset row {index} has no chat `prompt` (a list of messages)")
        row = {
            "prompt": prompt,
            "answer": raw.get("answer", ""),
            "task": raw.get("task", "default"),
            "info": raw.get("info") or {},
        }
        try:
            check_json(row, f"{name}: dataset row {index}")
        except TypeError as error:
            raise EnvError(str(error)) from None
        rows.append(json.loads(json.dumps(row)))  # plain JSON: tasks are logged and journaled as they are
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class VerifiersParser:
    """A verifiers parser read as tether's `Parser` (the format is stated in the env's own prompt)."""

    parser: Any

    @property
    def instructions(self) -> str:
        return ""

    def parse(self, completion: str) -> Parsed:
        answer = self.parser.parse_answer([{"role": "assistant", "content": completion}])
        text = None if answer is None else str(answer)
        return Parsed(text, bool(text and text.strip()))

    def format(self, answer: str) -> str:
        vf = _verifiers()
        if isinstance(self.parser, vf.XMLParser):
            fields = self.parser.get_fields()
            return str(
                self.parser.format(**{f: answer if f == self.parser.answer_field else "" for f in fields})
            )
        if isinstance(self.parser, vf.ThinkParser):
            return f"<think>\n</think>\n{answer}"
        return answer


def completion_of(state: EpisodeState) -> Messages:
    """The messages after the task's prompt: verifiers' `completion`."""
    return [dict(m) for m in state.messages[len(state.task.messages) :]]


async def verifiers_state(env: Any, state: EpisodeState) -> dict[str, Any]:
    """verifiers' `state` dict of this episode, made on first use (and `setup_state` run once), with
    `turn` and `completion` kept current."""
    vf_state = state.info.get(STATE_KEY)
    if vf_state is None:
        data = state.task.data
        vf_state = {
            "id": data.get("row", 0),
            "prompt": copy.deepcopy(data["prompt"]),
            "completion": [],
            "answer": data.get("answer", ""),
            "task": data.get("task", "default"),
            "info": copy.deepcopy(data.get("info", {})),
            "responses": [],
            "turn": 0,
            "timing": {"generation_ms": 0.0, "scoring_ms": 0.0, "total_ms": 0.0},
        }
        setup = getattr(env, "setup_state", None)
        if setup is not None:
            vf_state = await _maybe_await(setup(vf_state))
        state.info[STATE_KEY] = vf_state
    vf_state["turn"] = state.turns
    vf_state["completion"] = completion_of(state)
    return vf_state


@dataclass(frozen=True, slots=True)
class VerifiersReward:
    """One verifiers reward function as a tether reward component (see the module docstring)."""

    env: Any
    func: Callable[..., Any]
    owner: Any  # the verifiers Rubric that holds `func` (its class objects: parser, ...)
    negative: bool  # the function's weight was negative: the component is 1 - value
    reward_range: tuple[float, float]

    async def __call__(self, inp: RewardInput) -> float:
        state = inp.state
        if state is None:  # a bare completion: an episode state of that one reply
            state = EpisodeState(
                inp.task, inp.ctx, [*inp.task.messages, {"role": "assistant", "content": inp.completion}]
            )
        vf_state = await verifiers_state(self.env, state)
        returned: list[Any] = []
        raised: list[Exception] = []
        func = self.func

        @functools.wraps(func)
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                value = await _maybe_await(func(*args, **kwargs))
            except Exception as error:
                raised.append(error)
                raise
            returned.append(value)
            return value if isinstance(value, int | float) else 0.0

        data = inp.task.data
        await self.owner.call_reward_func(
            guarded,
            prompt=copy.deepcopy(data["prompt"]),
            completion=completion_of(state),
            answer=data.get("answer", ""),
            state=vf_state,
            task=data.get("task", "default"),
            info=vf_state["info"],
        )
        name = getattr(func, "__name__", type(func).__name__)
        if raised:
            error = raised[0]
            raise EnvError(
                f"verifiers reward function {name!r} raised {type(error).__name__}: {error}"
            ) from error
        value = returned[0] if returned else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EnvError(f"verifiers reward function {name!r} returned {value!r}, expected a number")
        low, high = self.reward_range
        scaled = (float(value) - low) / (high - low)
        return 1.0 - scaled if self.negative else scaled


def _reward_functions(rubric: Any, name: str) -> list[tuple[Callable[..., Any], float, Any]]:
    """(function, weight, owning rubric) of a rubric, a RubricGroup's members flattened in order."""
    vf = _verifiers()
    if isinstance(rubric, vf.JudgeRubric):
        raise EnvError(
            f"{name}: JudgeRubric calls a model from the rubric; use tether's `judge` reward component"
        )
    if isinstance(rubric, vf.RubricGroup):
        return [entry for member in rubric.rubrics for entry in _reward_functions(member, name)]
    funcs, weights = rubric.get_reward_funcs(), rubric.get_reward_weights()
    if len(funcs) != len(weights):
        raise EnvError(f"{name}: the rubric has {len(funcs)} reward functions but {len(weights)} weights")
    return [(func, float(weight), rubric) for func, weight in zip(funcs, weights, strict=True)]


def component_name(func: Callable[..., Any], taken: set[str]) -> str:
    """A reward component name (lowercase letters, digits, '_') for `func`, unique among `taken`."""
    raw = getattr(func, "__name__", type(func).__name__)
    base = re.sub(r"[^a-z0-9_]+", "_", raw.lower()).strip("_") or "reward"
    base = base if base[0].isalpha() else f"r_{base}"
    name, suffix = base, 2
    while name in taken:
        name, suffix = f"{base}_{suffix}", suffix + 1
    taken.add(name)
    return name


def verifiers_rubric(env: Any, name: str, reward_range: tuple[float, float] = (0.0, 1.0)) -> Rubric:
    low, high = reward_range
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise EnvError(f"{name}: reward_range {reward_range!r} must be two finite numbers, low < high")
    entries = _reward_functions(env.rubric, name)
    if not entries:
        raise EnvError(f"{name}: the verifiers rubric has no reward functions")
    bad = [weight for _, weight, _ in entries if not math.isfinite(weight)]
    if bad or sum(abs(weight) for _, weight, _ in entries) <= 0:
        raise EnvError(f"{name}: rubric weights {[w for _, w, _ in entries]} must be finite, not all 0")
    taken: set[str] = set()
    return Rubric(
        tuple(
            Reward(
                component_name(func, taken),
                VerifiersReward(env, func, owner, weight < 0, reward_range),
                abs(weight),
            )
            for func, weight, owner in entries
        )
    )


def verifiers_tools(env: Any, name: str) -> tuple[Tool, ...]:
    """A ToolEnv's tools: each runs the env's own `call_tool` in this process (not in the sandbox)."""

    def tool(spec: ToolSpec) -> Tool:
        async def run(workspace: Workspace, arguments: JsonDict, key: str) -> str:
            message = await _maybe_await(env.call_tool(spec.name, arguments, key))
            return message_text(message)

        # Their effects are unknown to us and nothing journals an RL episode: never run twice on replay.
        return Tool(spec, run, policy=ReplayPolicy.EXTERNAL_AT_MOST_ONCE)

    try:
        return tuple(tool(ToolSpec.from_openai(raw)) for raw in env.oai_tools or [])
    except (ChatError, ValueError) as error:
        raise EnvError(f"{name}: a tool's schema is not usable: {error}") from error


def verifiers_responder(env: Any) -> Responder:
    """After each reply: done if `is_completed`, else `env_response`'s messages (done if then completed)."""

    async def respond(state: EpisodeState) -> tuple[Messages, bool]:
        vf_state = await verifiers_state(env, state)
        rollout = [dict(m) for m in state.messages]
        if await _maybe_await(env.is_completed(rollout, vf_state)):
            return [], True
        messages, vf_state = await _maybe_await(env.env_response(rollout, vf_state))
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise EnvError(
                f"env_response of {type(env).__name__} returned {messages!r}, not a list of messages"
            )
        state.info[STATE_KEY] = vf_state
        done = await _maybe_await(env.is_completed(rollout + messages, vf_state))
        return [dict(m) for m in messages], bool(done)

    return respond


def from_verifiers(env: Any, name: str, spec: VerifiersSpec | None = None) -> Environment:
    """The tether `Environment` named `name` for the verifiers environment `env` (see the docstring)."""
    vf = _verifiers()
    spec = spec or VerifiersSpec(module="")
    if not isinstance(env, vf.Environment):
        raise EnvError(f"{name}: expected a verifiers Environment, got {type(env).__name__}")
    kind = type(env).__name__
    if isinstance(env, vf.EnvGroup | vf.StatefulToolEnv):
        raise EnvError(f"{name}: {kind} is not supported; register its environments one by one")
    if env.message_type != "chat":
        raise EnvError(f"{name}: message_type {env.message_type!r} is not supported, only 'chat'")
    if not isinstance(env, vf.MultiTurnEnv):
        raise EnvError(f"{name}: {kind} is neither a SingleTurnEnv nor a MultiTurnEnv")
    own_turns = int(getattr(env, "max_turns", -1))
    max_turns = 1 if isinstance(env, vf.SingleTurnEnv) else own_turns if own_turns > 0 else spec.max_turns
    tools: tuple[Tool, ...] = ()
    responder: Responder | None = None
    if isinstance(env, vf.ToolEnv):
        overridden = [
            m for m in ("env_response", "is_completed") if getattr(type(env), m) is not getattr(vf.ToolEnv, m)
        ]
        if overridden:
            raise EnvError(
                f"{name}: {kind} overrides {', '.join(overridden)} of ToolEnv, which is not supported"
            )
        tools = verifiers_tools(env, name)
        max_turns = max(max_turns, 2)
    elif max_turns > 1:
        responder = verifiers_responder(env)
    elif env.oai_tools:
        raise EnvError(f"{name}: {kind} offers tools but is not a ToolEnv")
    return Environment(
        name=name,
        source=DatasetSource(_rows(env, name)),
        renderer=RowRenderer(),
        parser=VerifiersParser(env.parser),
        rubric=verifiers_rubric(env, name, spec.reward_range),
        tools=tools,
        max_turns=max_turns,
        description=f"verifiers {kind}" + (f" from {spec.module}" if spec.module else ""),
        responder=responder,
    )


def build(name: str, spec: VerifiersSpec) -> Environment:
    return from_verifiers(load_verifiers_environment(spec.module, spec.args), name, spec)


def register_verifiers(registry: EnvRegistry, specs: Mapping[str, VerifiersSpec]) -> None:
    """Register each spec as `vf/<key>`, built (its module imported, load_environment called) on first use."""
    for key, spec in specs.items():
        name = f"{FAMILY}/{key}"
        registry.register(
            name, functools.partial(build, name, spec), source=f"verifiers {spec.module}", replace=True
        )
