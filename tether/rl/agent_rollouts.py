"""RL over agent tasks (`agent/*` in the mixture) through the agents' own `TaskRunner`: no second loop.

Each sample of an agent task is a task in a journal, driven by `TaskRunner` with the built-in `Toolbox`
and the step code that hosts agents (`tether agent run`). Only the model differs: `TokenClient`, a
`ChatClient` over the trainer's engine that keeps token in, token out. Turn k+1's prompt is turn k's
prompt and generated ids followed by the observation rendered as a token suffix (`ObservationEncoder`),
never a re-tokenization of decoded text; replies are parsed by the template's tool format. So the
runner's context must only grow: family tasks keep their whole history (nothing folded or recalled),
and a request whose history changed is refused. The success check is the reward.

Every turn's tokens go to a turn log beside the journal as it returns. With `agents.journal = "run"` both
live in the run directory: a rollout killed mid-batch resumes (`tether train --resume`) where the
journal stands, and the agents' replay machinery applies no step twice. An episode whose runner raises
(the sandbox lost its session, a tool broke) is resumed from the journal the same way, up to
`[rollout] infra_retries` times, and then marked infra-failed. This module imports the agents' public
API (rl -> agents).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.agents.check import CheckOutcome
from tether.agents.context import build_messages
from tether.agents.families import FAMILIES, AgentFamily
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.task import TaskSpec
from tether.chat import ChatError, ChatRequest, Completion, Message, Messages, Usage
from tether.chat import FinishReason as ChatFinish
from tether.chat.template import ChatTemplate
from tether.engine.sampling import SamplingParams
from tether.engine.sequence import FinishReason
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import Problem, Task
from tether.errors import ConfigError
from tether.rl.episodes import ObservationEncoder, Trajectory, assemble
from tether.rl.retries import RetryPolicy, describe, infra_reason
from tether.rl.rollout import PromptPlan, Rollout, Turn, billed_prompts, derive_seed
from tether.store.artifacts import ArtifactStore
from tether.store.journal import Journal
from tether.tools import FINISH, PYTHON, READ_FILE, SHELL, WRITE_FILE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine, RequestOutput

FAMILY = "agent"  # the mixture's names of agent task families: agent/<name>
OWNER = "rl-rollout"  # one owner: a resumed rollout takes its own leases back at once
_CHECK_WEIGHT = 0.8  # of the reward for passing the check; the rest is its partial credit


def is_agent_env(name: str) -> bool:
    return name.split("/", 1)[0] == FAMILY


def append_only(spec: TaskSpec) -> None:
    """Refuse a task whose context would fold or recall steps: its prompts would not extend each other."""
    context = spec.context
    if context.recent_steps < spec.limits.max_steps or context.recall_k:
        raise ConfigError(
            f"agent-task RL needs the whole history in context: context.recent_steps = "
            f"{context.recent_steps} (must be >= limits.max_steps = {spec.limits.max_steps}) and "
            f"context.recall_k = {context.recall_k} (must be 0)"
        )


@dataclass(frozen=True, slots=True)
class _FamilySource:
    family: AgentFamily
    max_steps: int

    def problem(self, seed: int) -> Problem:
        spec = self.family.task(seed, self.max_steps)
        return Problem(prompt=spec.goal, answer="", data={"agent_task": spec.model_dump(mode="json")})


@dataclass(frozen=True, slots=True)
class _FirstPrompt:
    """The task's messages as the runner sends them at its first step (what transcripts show)."""

    def render(self, problem: Problem) -> Messages:
        spec = TaskSpec.model_validate(problem.data["agent_task"])
        return build_messages(spec, spec.roles[0], [])


async def _scored_by_the_check(inp: RewardInput) -> float:
    raise EnvError(f"{inp.task.env} is an agent task: its episodes are scored by the task's success check")


def agent_environment(family: AgentFamily, max_steps: int) -> Environment:
    """A family as the mixture sees it: its tasks (the spec in `data["agent_task"]`) and tools; rolled
    out by `AgentRollouts`, never by an `Episode`."""
    return Environment(
        name=family.name,
        source=_FamilySource(family, max_steps),
        renderer=_FirstPrompt(),
        parser=ANSWER_TAG,
        rubric=Rubric((Reward("check", _scored_by_the_check),)),
        tools=(SHELL, PYTHON, READ_FILE, WRITE_FILE, FINISH),
        max_turns=max(2, max_steps),
        description=f"agent task family: {family.description}",
    )


def register_agent_families(registry: EnvRegistry, max_steps: int) -> None:
    for family in FAMILIES.values():
        registry.register(family.name, partial(agent_environment, family, max_steps), replace=True)


class EngineTurns:
    """Requests from many episodes through one engine: submissions and aborts wait for the engine to
    be between steps (`LLMEngine.step_async`), and each caller awaits its own request's output."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queued: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._waiting: dict[str, asyncio.Future[RequestOutput]] = {}
        self._stepper: asyncio.Task[None] | None = None

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self._queued.append((request_id, prompt, params))
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._step())
        try:
            return await future
        finally:
            if not future.done():
                self._aborts.append(request_id)
            self._waiting.pop(request_id, None)

    async def aclose(self) -> None:
        """Wait for the engine to be between steps, then abort what the callers left (a cancelled batch)."""
        if self._stepper is not None:
            await asyncio.gather(self._stepper, return_exceptions=True)
        for request_id in self._aborts:
            self.engine.abort(request_id)
        self._aborts.clear()

    async def _step(self) -> None:
        while self._waiting or self._queued:
            try:
                for request_id, prompt, params in self._queued:
                    self.engine.add_request(request_id, prompt, params)
                self._queued.clear()
                for request_id in self._aborts:
                    self.engine.abort(request_id)
                self._aborts.clear()
                outputs = await self.engine.step_async()
            except Exception as error:  # fail every waiter rather than leave them hanging
                for waiter in self._waiting.values():
                    if not waiter.done():
                        waiter.set_exception(error)
                self._queued.clear()
                return
            for output in outputs:
                future = self._waiting.get(output.request_id)
                if output.finished and future is not None and not future.done():
                    future.set_result(output)


@dataclass(slots=True)
class TurnLog:
    """The turns of one episode (and the conversation each saw), appended to a JSONL file as they come,
    so a resumed episode continues the same token sequence. A turn regenerated for a step replaces it."""

    path: Path
    turns: list[Turn] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the step of each turn
    seens: list[list[Message]] = field(default_factory=list)  # each turn's request messages and reply

    def __post_init__(self) -> None:
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                row = json.loads(line)
                self._keep(row["step_no"], Turn(**row["turn"]), row["seen"])

    @property
    def seen(self) -> list[Message]:
        """The conversation so far: the last turn's request and its reply."""
        return self.seens[-1] if self.seens else []

    def drop_from(self, step_no: int) -> None:
        """Forget the turn of `step_no` and any later: the step is being generated again."""
        keep = self.steps.index(step_no) if step_no in self.steps else len(self.steps)
        del self.turns[keep:], self.steps[keep:], self.seens[keep:]

    def _keep(self, step_no: int, turn: Turn, seen: list[Message]) -> None:
        self.drop_from(step_no)
        self.turns.append(turn)
        self.steps.append(step_no)
        self.seens.append(seen)

    def add(self, step_no: int, turn: Turn, seen: list[Message]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step_no": step_no, "turn": asdict(turn), "seen": seen}) + "\n")
        self._keep(step_no, turn, seen)


def _same(a: Sequence[Message], b: Sequence[Message]) -> bool:
    def text(messages: Sequence[Message]) -> str:
        return json.dumps(list(messages), sort_keys=True, default=str)

    return text(a) == text(b)


class TokenClient:
    """A `ChatClient` over the trainer's engine for one episode, token in and token out (see above).

    Sampling follows the rollout's parameters (the request's temperature is not used: RL samples), each
    turn capped at the request's `max_tokens`; every token keeps its logprob and policy version."""

    name = "policy"

    def __init__(
        self,
        turns: EngineTurns,
        template: ChatTemplate,
        encoder: ObservationEncoder,
        params: SamplingParams,
        log: TurnLog,
        request_prefix: str,
        seed: int,
    ) -> None:
        self.engine_turns = turns
        self.template = template
        self.encoder = encoder
        self.params = params
        self.log = log
        self.request_prefix = request_prefix
        self.seed = seed

    def _prompt(self, request: ChatRequest) -> list[int]:
        self.log.drop_from(request.step_no)  # a step generated again on resume: from the turn before it
        if not self.log.turns:
            return self.template.encode(request.messages, request.tools)
        last, seen = self.log.turns[-1], self.log.seen
        if len(request.messages) <= len(seen) or not _same(request.messages[: len(seen)], seen):
            raise ChatError(
                "agent-task RL: the runner's context does not extend the previous turn's (history folded, "
                "recalled or rewritten); token-in/token-out episodes need an append-only context"
            )
        observation = self.encoder.encode(
            list(request.messages[len(seen) :]), last.completion_ids[-1], request.tools
        )
        return last.prompt_ids + last.completion_ids + observation

    async def complete(self, request: ChatRequest) -> Completion:
        prompt = self._prompt(request)
        room = self.engine_turns.engine.config.max_model_len - len(prompt)
        if room < 1:
            raise ChatError(f"agent-task RL: the episode's {len(prompt)} tokens fill the model's context")
        turn_no = len(self.log.turns)
        params = replace(
            self.params,
            n=1,
            max_tokens=min(self.params.max_tokens, request.max_tokens, room),
            seed=derive_seed("agent-turn", self.seed, request.step_no),
        )
        request_id = f"{self.request_prefix}-{request.step_no}-{turn_no}"
        output = await self.engine_turns.generate(request_id, prompt, params)
        (completion,) = output.completions
        assert completion.finish_reason is not None and completion.token_ids, "a turn generates a token"
        turn = Turn(
            request_id,
            list(output.prompt_token_ids),
            list(completion.token_ids),
            list(completion.logprobs),
            list(completion.versions),
            completion.finish_reason.value,
            output.num_cached_tokens,
        )
        text = str(self.template.tokenizer.decode(turn.completion_ids, skip_special_tokens=True))
        message = (
            self.template.tool_format().parse(text).message()
            if request.tools
            else {"role": "assistant", "content": text}
        )
        self.log.add(request.step_no, turn, [*request.messages, message])
        return Completion(
            message,
            Usage(len(turn.prompt_ids), turn.cached_tokens, len(turn.completion_ids)),
            _finish_reason(completion.finish_reason, message),
            tuple(turn.completion_ids),
            tuple(turn.logprobs),
        )

    async def close(self) -> None:
        return None


def _finish_reason(reason: FinishReason, message: Message) -> ChatFinish:
    if reason is FinishReason.LENGTH:
        return ChatFinish.LENGTH
    return ChatFinish.TOOL_CALLS if message.get("tool_calls") else ChatFinish.STOP


def reward_of(outcome: CheckOutcome | None) -> tuple[float, dict[str, float], bool]:
    """(total, components, passed) from the check: passing earns most, its partial credit the rest."""
    if outcome is None:
        return 0.0, {"check": 0.0, "checks": 0.0}, False
    passed = 1.0 if outcome.passed else 0.0
    total = _CHECK_WEIGHT * passed + (1 - _CHECK_WEIGHT) * outcome.fraction
    return total, {"check": passed, "checks": outcome.fraction}, outcome.passed


@dataclass(slots=True)
class AgentRollouts:
    """A step's agent-task plans, `params.n` episodes each, run concurrently through `TaskRunner`.

    `state_dir`: where the journal, artifacts and turn logs live (None: a temporary directory per batch;
    a directory: kept, so a batch run again after a crash resumes its episodes)."""

    engine: LLMEngine
    tokenizer: PreTrainedTokenizerBase
    params: SamplingParams
    state_dir: Path | None = None
    lease_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    template: ChatTemplate = field(init=False)
    encoder: ObservationEncoder = field(init=False)

    def __post_init__(self) -> None:
        self.template = ChatTemplate(self.tokenizer)
        self.encoder = ObservationEncoder(self.template)

    async def run(
        self, plans: Sequence[PromptPlan], registry: EnvRegistry, ctx: ScoringContext
    ) -> tuple[list[Task], list[Rollout]]:
        tasks = [registry.get(plan.env).task(plan.seed) for plan in plans]
        specs = [TaskSpec.model_validate(task.data["agent_task"]) for task in tasks]
        for spec in specs:
            append_only(spec)
        if self.state_dir is not None:
            return tasks, await self._run(plans, specs, self.state_dir, ctx)
        with tempfile.TemporaryDirectory(prefix="tether-agent-rollouts-") as root:
            return tasks, await self._run(plans, specs, Path(root), ctx)

    async def _run(
        self, plans: Sequence[PromptPlan], specs: Sequence[TaskSpec], root: Path, ctx: ScoringContext
    ) -> list[Rollout]:
        (root / "turns").mkdir(parents=True, exist_ok=True)
        journal = Journal(f"sqlite:///{root / 'journal.db'}")
        artifacts = ArtifactStore(str(root / "artifacts"))
        engine_turns = EngineTurns(self.engine)
        pool = await ctx.pool()
        episodes = [
            asyncio.ensure_future(self._episode(journal, artifacts, pool, engine_turns, root, plan, spec, i))
            for plan, spec in zip(plans, specs, strict=True)
            for i in range(self.params.n)
        ]
        try:
            return list(await asyncio.gather(*episodes))
        finally:
            # A batch that fails (or is cancelled) stops every episode now: none runs on later, unseen.
            for episode in episodes:
                episode.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            await engine_turns.aclose()
            journal.close()

    async def _episode(
        self,
        journal: Journal,
        artifacts: ArtifactStore,
        pool: Any,
        engine_turns: EngineTurns,
        root: Path,
        plan: PromptPlan,
        spec: TaskSpec,
        sample: int,
    ) -> Rollout:
        task_id = f"rl-{plan.sample_seed}-{plan.group}-{sample}"
        log = TurnLog(root / "turns" / f"{task_id}.jsonl")
        seed = plan.sample_seed + sample
        client = TokenClient(engine_turns, self.template, self.encoder, self.params, log, task_id, seed)
        runner = TaskRunner(
            journal, artifacts, pool, client, OWNER, RunnerConfig(lease_s=self.lease_s, infra_errors=True)
        )
        journal.create_task(task_id, spec.model_dump(mode="json"))  # already there when resumed: kept
        error = None
        failure: BaseException | None = None
        retry_reasons: list[str] = []
        while not journal.get_task(task_id).status.terminal:
            try:
                status = await runner.run(task_id)
            except Exception as raised:  # one broken episode must not stop the batch
                failure, error = raised, describe(raised)
                if len(retry_reasons) < self.retry.infra_retries:
                    # Run again from the journal: the same seeds, and no step applied twice.
                    retry_reasons.append(infra_reason(raised).value)
                    continue
                break
            failure = error = None
            if status is None or not status.terminal:
                error = f"the episode stopped before its end ({status.value if status else 'lease held'})"
            break
        record = journal.get_task(task_id)
        outcome = CheckOutcome.find(record.result) or CheckOutcome.find(record.error)
        reward, components, passed = reward_of(outcome)
        if failure is None and not log.turns:
            failure = ChatError(f"agent task {task_id} ended before its first model call: {record.error}")
            error = describe(failure)
        # No turn at all: nothing to learn from, and the rollout is marked failed (never trained on).
        trajectory = assemble(log.turns) if log.turns else Trajectory([], [], [], [], [])
        last = log.seen[-1] if log.seen else {}
        billed, cached = billed_prompts(log.turns)
        return Rollout(
            env=plan.env,
            seed=plan.seed,
            group=plan.group,
            prompt_ids=trajectory.prompt_ids,
            completion_ids=trajectory.completion_ids,
            logprobs=trajectory.logprobs,
            versions=trajectory.versions,
            finish_reason=log.turns[-1].finish_reason if log.turns else FinishReason.ABORT.value,
            text=str(last.get("content") or ""),
            reward=reward if failure is None else 0.0,
            components=components if failure is None else {},
            passed=passed and failure is None,
            billed_prompt_tokens=billed,
            cached_prompt_tokens=cached,
            error=error,  # an episode that failed its check or spent its budget is scored, not an error
            infra_failure=infra_reason(failure).value if failure is not None else None,
            retry_reasons=retry_reasons,
            loss_mask=trajectory.loss_mask,
            turns=list(log.turns),
            transcript=json.loads(json.dumps(log.seen, default=str)),
        )
