"""What an environment is: a task source, a prompt renderer, an answer parser and a rubric, composed,
and the episode protocol every rollout follows.

How a domain plugs in (see `registry.py` for naming and registration):

    env = Environment(
        name="family/name",
        source=MySource(),                  # TaskSource: seed -> Problem (prompt, reference answer, data)
        renderer=ChatRenderer(SYSTEM),      # Problem -> chat messages; the system prompt never varies
        parser=ANSWER_TAG,                  # completion text -> Parsed (see parsers.py)
        rubric=Rubric((Reward("correctness", check, weight=0.9, gate=True), Reward("format", ...))),
        tools=(PYTHON, SUBMIT),             # multi-turn only: the tools of `tether.tools`, OpenAI tool calls
        max_turns=8,
        setup=write_fixtures,               # multi-turn: prepare the sandbox session of an episode
        validators=(protected_files_unchanged,),  # run after every step; a reason ends the episode at 0
        responder=None,                     # multi-turn without tools: the environment answers each reply
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

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tether.chat import ChatError, Message, Messages, ToolCall, ToolResult, message_text, tool_calls_of
from tether.envs.context import ScoringContext
from tether.envs.errors import EnvError
from tether.envs.exploits import Exploit, parser_exploits
from tether.envs.scoring import EpisodeState, RewardInput, Rubric, Score
from tether.envs.tasks import Parsed, Parser, Renderer, Task, TaskSource, check_json, check_name, check_seed
from tether.tools import NoWorkspace, Tool, Toolbox, Workspace

if TYPE_CHECKING:
    from tether.sandbox.spec import SandboxSpec


SetupHook = Callable[[EpisodeState], Awaitable[None]]
# Returns None when the state is sound, else the reason of the violation (recorded as `qc_violation`).
StepValidator = Callable[[EpisodeState], Awaitable[str | None]]
Policy = Callable[[Messages, list[dict[str, Any]]], Awaitable[Message]]
# Multi-turn environments that answer replies themselves, not through tools (a game master, a user
# simulator, an adapted `verifiers` MultiTurnEnv): called after each assistant reply is appended, it
# returns the messages the environment answers with and whether the episode is over.
Responder = Callable[[EpisodeState], Awaitable[tuple[Messages, bool]]]


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
    responder: Responder | None = None
    # Known ways to game this domain (`envs/exploits.py`), on top of its parser's; watched in training.
    exploits: tuple[Exploit, ...] = ()

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.max_turns < 1:
            raise ValueError(f"{self.name}: max_turns {self.max_turns!r} must be >= 1")
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: tool names must be unique, got {names}")
        if self.tools and self.max_turns == 1:
            raise ValueError(f"{self.name}: an environment with tools needs max_turns > 1")
        if self.responder is not None and (self.tools or self.max_turns == 1):
            raise ValueError(
                f"{self.name}: a responder needs max_turns > 1 and no tools (it answers replies)"
            )

    @property
    def family(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def multi_turn(self) -> bool:
        return self.max_turns > 1

    @property
    def needs_session(self) -> bool:
        return self.setup is not None or any(tool.needs_workspace for tool in self.tools)

    def tool_specs(self) -> list[dict[str, Any]]:
        return [tool.spec.openai() for tool in self.tools]

    def task(self, seed: int) -> Task:
        check_seed(seed)
        problem = self.source.problem(seed)
        check_json(problem.data, f"{self.name} seed {seed}: problem data")
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

    def exploits_in(self, task: Task, completion: str) -> list[str]:
        """The names of the known exploits (the parser's and the domain's) that `completion` matches."""
        return [
            e.name for e in (*parser_exploits(self.parser), *self.exploits) if e.matches(task, completion)
        ]

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
        self._tools = Toolbox(env.tools)

    @property
    def messages(self) -> Messages:
        return self.state.messages

    async def step(self, reply: Message) -> Messages:
        """Apply one assistant message: run its tool calls, then the validators. Returns the tool replies."""
        if self.done:
            raise EnvError(f"episode of {self.env.name} is already done")
        if reply.get("role", "assistant") != "assistant":
            raise EnvError(f"a step takes an assistant message, got role {reply.get('role')!r}")
        try:
            message_text(reply)  # rejects malformed content and tool calls early
            calls = tool_calls_of(reply)
        except ChatError as error:
            raise EnvError(f"a step takes a well-formed assistant message: {error}") from None
        state = self.state
        state.messages.append({**reply, "role": "assistant"})
        state.turns += 1
        results: Messages = []
        ended = False
        if self.env.responder is not None:
            results, ended = await self.env.responder(state)
            results = list(results)
        for call in calls if len(self._tools) else []:
            result, ends = await self._call(call)
            results.append(result.message())
            state.tool_calls += 1
            if ends:
                state.submitted = result.content
                self.done = True
                break
        state.messages.extend(results)
        if ended or not results or state.turns >= self.env.max_turns:
            self.done = True  # a reply nothing answers (no tool calls, no response) is the final answer
        for validate in self.env.validators:
            reason = await validate(state)
            if reason is not None:
                state.qc_violation = reason
                self.done = True
                break
        return results

    def _workspace(self) -> Workspace:
        if self.state.session is None:
            return NoWorkspace(f"environment {self.env.name} has no sandbox session in this episode")
        return self.state.workspace()

    async def _call(self, call: ToolCall) -> tuple[ToolResult, bool]:
        """Run one call in the episode's sandbox; the model's mistakes come back as error results."""
        result, ends = await self._tools.call(self._workspace(), call)
        limit = self.env.max_tool_output_chars
        if len(result.content) > limit and not ends:
            shown = result.content[:limit] + f"\n[output truncated to {limit} characters]"
            result = ToolResult(result.call_id, result.name, shown, result.error)
        return result, ends

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
