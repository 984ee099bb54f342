"""What an environment is: a task source, a prompt renderer, an answer parser and a rubric, composed.

How a domain plugs in (see `registry.py` for naming and registration):

    env = Environment(
        name="family/name",
        source=MySource(),                  # TaskSource: seed -> Problem (prompt, reference answer, data)
        renderer=ChatRenderer(SYSTEM),      # Problem -> chat messages; the system prompt never varies
        parser=ANSWER_TAG,                  # completion text -> Parsed (see parsers.py)
        rubric=Rubric((Reward("correctness", check, weight=0.9, gate=True), Reward("format", ...))),
        tools=(python_tool(), submit_tool()),  # multi-turn only (see tools.py); OpenAI tool-call format
        max_turns=8,
        setup=write_fixtures,               # multi-turn: prepare the sandbox session of an episode
        validators=(protected_files_unchanged,),  # run after every step; a reason ends the episode at 0
    )

Every episode, single-turn or multi-turn, runs the same protocol: `env.task(seed)` builds a
JSON-serialisable `Task`; `env.start(task, ctx)` opens an `Episode`; each model reply goes to
`episode.step(reply)`, which runs its tool calls and validators; `episode.score()` applies the rubric
to the final state (`run_episode` drives all four). Rewards that execute code go through `ctx`
(`context.py`: a sandbox pool started lazily, timed per episode); nothing here executes model output in
this process. This module does no generation and knows nothing of models: a policy is any async
callable from (messages, tools) to an assistant message.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tether.envs.context import SandboxProvider as SandboxProvider
from tether.envs.context import ScoringContext as ScoringContext
from tether.envs.errors import EnvError as EnvError

if TYPE_CHECKING:
    from tether.sandbox.result import RunResult
    from tether.sandbox.session import SandboxSession
    from tether.sandbox.spec import SandboxSpec

# One chat message in the OpenAI format: {"role": ..., "content": ..., "tool_calls"?: [...]}.
Message = dict[str, Any]
Messages = list[Message]
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-+]*$")
MAX_SEED = 2**63 - 1


def check_name(name: str) -> str:
    """`family/name`: lowercase family, then a name of letters, digits and `_.-+`."""
    if not NAME_PATTERN.match(name):
        raise EnvError(
            f"environment name {name!r} is invalid: expected 'family/name' "
            "(family: lowercase letters, digits, '_.-'; name: letters, digits, '_.-+')"
        )
    return name


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise EnvError(f"seed {seed!r} is invalid: expected an integer between 0 and 2**63-1")
    return seed


def _check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be JSON-serialisable: {error}") from None


# --- tasks -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    """What a task source produces for one seed, before rendering."""

    prompt: str  # the user-facing question (the renderer wraps it in chat messages)
    answer: str  # the reference answer, in the form the parser extracts (not wrapped in tags)
    data: dict[str, Any] = field(default_factory=dict)  # JSON: whatever the rubric needs to check


@dataclass(frozen=True, slots=True)
class Task:
    """One seeded instance of an environment, ready to send to a model and to log as JSON."""

    env: str
    seed: int
    messages: Messages
    reference: str
    data: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI `tools` entries; empty: single-turn
    max_turns: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "seed": self.seed,
            "messages": self.messages,
            "reference": self.reference,
            "data": self.data,
            "tools": self.tools,
            "max_turns": self.max_turns,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Task:
        missing = {"env", "seed", "messages", "reference"} - set(raw)
        if missing:
            raise EnvError(f"task is missing {', '.join(sorted(missing))}")
        expected = {"messages": list, "reference": str, "data": dict, "tools": list, "max_turns": int}
        for key, kind in expected.items():
            if key in raw and (not isinstance(raw[key], kind) or isinstance(raw[key], bool)):
                raise EnvError(f"task {key} = {raw[key]!r}: expected a {kind.__name__}")
        return cls(
            env=check_name(str(raw["env"])),
            seed=check_seed(raw["seed"]),
            messages=list(raw["messages"]),
            reference=raw["reference"],
            data=dict(raw.get("data", {})),
            tools=list(raw.get("tools", [])),
            max_turns=raw.get("max_turns", 1),
        )


class TaskSource(Protocol):
    """Seeded and reproducible: the same seed always gives the same problem."""

    def problem(self, seed: int) -> Problem: ...


class Renderer(Protocol):
    def render(self, problem: Problem) -> Messages: ...


@dataclass(frozen=True, slots=True)
class ChatRenderer:
    """A fixed system prompt and the problem as the user turn; fixed so that prefix caching pays."""

    system: str

    def render(self, problem: Problem) -> Messages:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": problem.prompt}]


@dataclass(frozen=True, slots=True)
class Parsed:
    """The answer extracted from a completion, and whether the completion followed the convention."""

    answer: str | None
    well_formed: bool


class Parser(Protocol):
    @property
    def instructions(self) -> str:
        """The sentence of the system prompt that states the convention."""
        ...

    def parse(self, completion: str) -> Parsed: ...

    def format(self, answer: str) -> str:
        """A completion that states `answer` exactly as the convention asks (reference completions)."""
        ...


# --- scoring -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class EpisodeState:
    """Everything a tool, a validator or a reward function may look at; `info` is the domain's scratch."""

    task: Task
    ctx: ScoringContext
    messages: Messages
    session: SandboxSession | None = None
    turns: int = 0
    tool_calls: int = 0
    submitted: str | None = None
    qc_violation: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def require_session(self) -> SandboxSession:
        if self.session is None:
            raise EnvError(f"environment {self.task.env} has no sandbox session in this episode")
        return self.session

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        """Run in the episode's sandbox session (files persist between runs), timed."""
        return await self.ctx.run_in(self.require_session(), code, language, **kwargs)

    @property
    def final_text(self) -> str:
        """The last assistant message's text (the answer of a single-turn episode)."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return message_text(message)
        return ""


def message_text(message: Message) -> str:
    """The text of a message whose content is a string, a list of parts, or absent."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    raise EnvError(f"message content must be a string or a list of parts, got {type(content).__name__}")


@dataclass(frozen=True, slots=True)
class RewardInput:
    """What every reward function receives; `state` is None when scoring a bare completion."""

    task: Task
    completion: str
    parsed: Parsed
    ctx: ScoringContext
    state: EpisodeState | None = None
    # Reward functions may note why they scored as they did (failing test, error); it becomes Score.detail.
    detail: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[RewardInput], float | Awaitable[float]]


@dataclass(frozen=True, slots=True)
class Reward:
    """A named reward component in [0, 1]. A gate multiplies the total: a wrong answer earns nothing."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    gate: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"reward name {self.name!r}: expected lowercase letters, digits and '_'")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"reward {self.name!r}: weight {self.weight!r} must be finite and >= 0")


@dataclass(frozen=True, slots=True)
class Score:
    """Every component of one rollout's reward, the total, and why it was zeroed if it was."""

    total: float
    components: dict[str, float]
    weights: dict[str, float]
    passed: bool  # the pass component scored 1.0 (pass rate in eval)
    answer: str | None = None
    qc_violation: str | None = None
    sandbox_time_s: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "components": self.components,
            "weights": self.weights,
            "passed": self.passed,
            "answer": self.answer,
            "qc_violation": self.qc_violation,
            "sandbox_time_s": self.sandbox_time_s,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class Rubric:
    """Weighted components: total = (product of gates) * (weighted mean of all components)."""

    rewards: tuple[Reward, ...]
    pass_component: str | None = None  # default: the first gate, else the first component

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("a rubric needs at least one reward")
        names = [reward.name for reward in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        if sum(reward.weight for reward in self.rewards) <= 0:
            raise ValueError("the rubric's weights sum to 0")
        if self.pass_component is not None and self.pass_component not in names:
            raise ValueError(f"pass_component {self.pass_component!r} is not one of {names}")

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self.rewards]

    @property
    def passing(self) -> str:
        if self.pass_component is not None:
            return self.pass_component
        gates = [reward.name for reward in self.rewards if reward.gate]
        return gates[0] if gates else self.rewards[0].name

    async def score(self, inp: RewardInput) -> Score:
        components: dict[str, float] = {}
        for reward in self.rewards:
            value = reward.fn(inp)
            if inspect.isawaitable(value):
                value = await value
            value = float(value)
            if not 0.0 <= value <= 1.0:  # also rejects NaN
                raise ValueError(f"reward {reward.name!r} returned {value!r}, outside [0, 1]")
            components[reward.name] = value
        weights = {reward.name: reward.weight for reward in self.rewards}
        mean = sum(components[n] * w for n, w in weights.items()) / sum(weights.values())
        gate = math.prod(components[reward.name] for reward in self.rewards if reward.gate)
        return Score(
            total=gate * mean,
            components=components,
            weights=weights,
            passed=components[self.passing] >= 1.0,
            answer=inp.parsed.answer,
            sandbox_time_s=inp.ctx.sandbox_time_s,
            detail=dict(inp.detail),
        )

    def zero(self, reason: str, ctx: ScoringContext) -> Score:
        """The score of an episode ended by a quality-check violation."""
        return Score(
            total=0.0,
            components=dict.fromkeys(self.names, 0.0),
            weights={reward.name: reward.weight for reward in self.rewards},
            passed=False,
            qc_violation=reason,
            sandbox_time_s=ctx.sandbox_time_s,
        )


# --- tools -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call, described by a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The entry of an OpenAI chat request's `tools` list."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call from an assistant message's `tool_calls`; `arguments` is the raw JSON string."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_openai(cls, raw: Mapping[str, Any], index: int = 0) -> ToolCall:
        function = raw.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise EnvError(f"tool call {raw!r} has no function name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):  # some servers send an object; normalise to the OpenAI string
            arguments = json.dumps(arguments)
        return cls(str(raw.get("id") or f"call_{index}"), function["name"], arguments)

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def parsed_arguments(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments or "{}")
        except json.JSONDecodeError as error:
            raise EnvError(f"arguments of {self.name} are not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise EnvError(f"arguments of {self.name} must be a JSON object, got {type(value).__name__}")
        return value


ToolFn = Callable[[dict[str, Any], EpisodeState], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool's spec and implementation. `ends_episode`: calling it is the final action (`submit`)."""

    spec: ToolSpec
    fn: ToolFn
    needs_session: bool = False
    ends_episode: bool = False


# --- environments and episodes -------------------------------------------------------------------------

SetupHook = Callable[[EpisodeState], Awaitable[None]]
# Returns None when the state is sound, else the reason of the violation (recorded as `qc_violation`).
StepValidator = Callable[[EpisodeState], Awaitable[str | None]]
Policy = Callable[[Messages, list[dict[str, Any]]], Awaitable[Message]]


@dataclass(frozen=True, slots=True)
class Environment:
    """One domain: the composition of a task source, renderer, parser and rubric, plus tools and hooks."""

    name: str
    source: TaskSource
    renderer: Renderer
    parser: Parser
    rubric: Rubric
    tools: tuple[Tool, ...] = ()
    max_turns: int = 1
    description: str = ""
    setup: SetupHook | None = None
    validators: tuple[StepValidator, ...] = ()
    sandbox_spec: SandboxSpec | None = None  # limits of the episode's session (None: the pool's)
    # Assistant replies that solve a task (default: one reply stating the reference answer).
    reference_replies: Callable[[Task], Messages] | None = None
    # Domain-specific wrong or adversarial completions, on top of the generic ones.
    adversarial: Callable[[Task], Sequence[str]] | None = None
    max_tool_output_chars: int = 8000

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.max_turns < 1:
            raise ValueError(f"{self.name}: max_turns {self.max_turns!r} must be >= 1")
        names = [tool.spec.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: tool names must be unique, got {names}")
        if self.tools and self.max_turns == 1:
            raise ValueError(f"{self.name}: an environment with tools needs max_turns > 1")

    @property
    def family(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def multi_turn(self) -> bool:
        return self.max_turns > 1

    @property
    def needs_session(self) -> bool:
        return self.setup is not None or any(tool.needs_session for tool in self.tools)

    def tool_specs(self) -> list[dict[str, Any]]:
        return [tool.spec.openai() for tool in self.tools]

    def task(self, seed: int) -> Task:
        check_seed(seed)
        problem = self.source.problem(seed)
        _check_json(problem.data, f"{self.name} seed {seed}: problem data")
        messages = self.renderer.render(problem)
        return Task(
            env=self.name,
            seed=seed,
            messages=messages,
            reference=problem.answer,
            data=problem.data,
            tools=self.tool_specs(),
            max_turns=self.max_turns,
        )

    def reference(self, task: Task) -> Messages:
        if self.reference_replies is not None:
            return self.reference_replies(task)
        return [{"role": "assistant", "content": self.parser.format(task.reference)}]

    def wrong_answers(self, task: Task) -> list[str]:
        """Completions that must score 0: no answer, an empty one, a made-up one, and the domain's own."""
        generic = [
            "",
            "I don't know.",
            self.parser.format(""),
            self.parser.format("tether-wrong-answer-0xdead"),
        ]
        return generic + list(self.adversarial(task) if self.adversarial else [])

    async def start(self, task: Task, ctx: ScoringContext) -> Episode:
        if task.env != self.name:
            raise EnvError(f"task of {task.env!r} given to environment {self.name!r}")
        state = EpisodeState(task=task, ctx=ctx, messages=[dict(m) for m in task.messages])
        if self.needs_session:
            state.session = await ctx.open_session(self.sandbox_spec)
            if self.setup is not None:
                try:
                    await self.setup(state)
                except BaseException:
                    await state.session.close()
                    raise
        return Episode(self, state)

    async def score(self, task: Task, completion: str, ctx: ScoringContext | None = None) -> Score:
        """Score one single-turn completion (multi-turn environments: use `run_episode`)."""
        episode = await self.start(task, ctx or ScoringContext())
        try:
            await episode.step({"role": "assistant", "content": completion})
            return await episode.score()
        finally:
            await episode.close()


class Episode:
    """One rollout: apply replies with `step` until `done`, then `score`; always `close`."""

    def __init__(self, env: Environment, state: EpisodeState) -> None:
        self.env = env
        self.state = state
        self.done = False
        self._tools = {tool.spec.name: tool for tool in env.tools}

    @property
    def messages(self) -> Messages:
        return self.state.messages

    async def step(self, reply: Message) -> Messages:
        """Apply one assistant message: run its tool calls, then the validators. Returns the tool replies."""
        if self.done:
            raise EnvError(f"episode of {self.env.name} is already done")
        if reply.get("role", "assistant") != "assistant":
            raise EnvError(f"a step takes an assistant message, got role {reply.get('role')!r}")
        message_text(reply)  # rejects malformed content early
        state = self.state
        state.messages.append({**reply, "role": "assistant"})
        state.turns += 1
        raw_calls = reply.get("tool_calls") or []
        results: Messages = []
        for index, raw in enumerate(raw_calls if self._tools else []):
            call = ToolCall.from_openai(raw, index)
            output, ends = await self._call(call)
            results.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": output})
            state.tool_calls += 1
            if ends:
                self.done = True
                break
        state.messages.extend(results)
        if not results or state.turns >= self.env.max_turns:
            self.done = True  # a reply without tool calls is the final answer
        for validate in self.env.validators:
            reason = await validate(state)
            if reason is not None:
                state.qc_violation = reason
                self.done = True
                break
        return results

    async def _call(self, call: ToolCall) -> tuple[str, bool]:
        tool = self._tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; available: {', '.join(self._tools)}", False
        try:
            arguments = call.parsed_arguments()
        except EnvError as error:
            return f"error: {error}", False
        try:
            output = await tool.fn(arguments, self.state)
        except EnvError as error:  # bad arguments are the model's mistake: tell it, do not crash
            return f"error: {error}", False
        limit = self.env.max_tool_output_chars
        if len(output) > limit:
            output = output[:limit] + f"\n[output truncated to {limit} characters]"
        return output, tool.ends_episode

    async def score(self) -> Score:
        state = self.state
        if state.qc_violation is not None:
            return self.env.rubric.zero(state.qc_violation, state.ctx)
        if state.submitted is not None:
            completion, parsed = state.submitted, Parsed(state.submitted, True)
        else:
            completion = state.final_text
            parsed = self.env.parser.parse(completion)
        return await self.env.rubric.score(RewardInput(state.task, completion, parsed, state.ctx, state))

    async def close(self) -> None:
        if self.state.session is not None:
            await self.state.session.close()

    async def __aenter__(self) -> Episode:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    task: Task
    messages: Messages
    score: Score
    turns: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task.to_dict(),
            "messages": self.messages,
            "score": self.score.to_dict(),
            "turns": self.turns,
        }


async def run_episode(env: Environment, task: Task, policy: Policy, ctx: ScoringContext) -> EpisodeResult:
    """Drive one episode to the end: ask the policy, step, repeat; then score and close."""
    episode = await env.start(task, ctx)
    async with episode:
        while not episode.done:
            reply = await policy(list(episode.messages), task.tools)
            await episode.step(reply)
        score = await episode.score()
    return EpisodeResult(task, list(episode.messages), score, episode.state.turns)


def scripted_policy(replies: Sequence[Message]) -> Policy:
    """A policy that plays fixed replies in order (reference solutions, tests)."""
    queue = list(replies)

    async def policy(messages: Messages, tools: list[dict[str, Any]]) -> Message:
        if not queue:
            raise EnvError("the scripted policy ran out of replies before the episode ended")
        return queue.pop(0)

    return policy
