"""The long-session benchmark: a many-step agent task whose context must stay within its token budget
while the server's prefix cache keeps paying, measured with real prompt and cached token counts.

A scripted policy (`SurveyPolicy`) decides each step's tool calls (reading a repository's files, grepping
and appending to a notes file in a real sandbox session), so the run is deterministic and takes no
generation time; each prompt the runner builds is still sent to a real model client (the in-process
engine, `max_tokens` 1) whose usage reports how many of its tokens were prefilled and how many came
from the prefix cache. The numbers are the journal's: what every step's usage recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tether.agents.context import DIGEST_TITLE
from tether.agents.context_budget import step_budget
from tether.agents.memory import Embedder
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentStack
from tether.agents.task import MIN_CONTEXT_BUDGET_TOKENS, ContextSpec, Limits, RoleSpec, TaskSpec
from tether.chat import ChatClient, ChatRequest, Completion, FinishReason, ToolCall, assistant_message
from tether.chat.tokens import PromptCounter
from tether.errors import ConfigError
from tether.sandbox.interface import Sandbox
from tether.store.records import TaskStatus

MODULES = 24  # files of the surveyed repository
LAST_WINDOW_STEPS = 100  # the steady state is judged on the last this many steps (all, if fewer)
SYSTEM_PROMPT = "You survey a Python repository in a sandbox with your tools, step by step."


def _module(index: int) -> str:
    functions = "\n\n".join(
        f"def handler_{index}_{n}(value):\n"
        f"    # TODO({'alice' if (index + n) % 3 else 'bob'}): validate value before use\n"
        f"    return value * {n + 1} + {index}"
        for n in range(6)
    )
    return f'"""Module {index}: request handlers of service {index % 5}."""\n\n{functions}\n'


def survey_task(steps: int, budget_tokens: int, recall_k: int = 3) -> TaskSpec:
    """A task that takes exactly `steps` model calls: `steps - 1` survey steps, then `finish`."""
    if steps < 2:
        raise ConfigError(f"steps = {steps}: the long-session task needs at least 2 steps")
    if budget_tokens < MIN_CONTEXT_BUDGET_TOKENS:
        raise ConfigError(
            f"budget_tokens = {budget_tokens}: expected at least {MIN_CONTEXT_BUDGET_TOKENS} tokens"
        )
    return TaskSpec(
        goal="List every TODO in src/ with its owner, writing your findings to notes.md as you go.",
        roles=(RoleSpec(name="agent", system_prompt=SYSTEM_PROMPT, tools=("shell", "read_file", "finish")),),
        limits=Limits(max_steps=steps + 1, max_tokens=100_000_000, max_output_tokens=1),
        context=ContextSpec(
            recent_steps=8,
            budget_tokens=budget_tokens,
            observation_chars=600,
            summary_chars=40,
            recall_k=recall_k,
        ),
        files={f"src/module_{i}.py": _module(i) for i in range(MODULES)},
        snapshot_every=1000,  # a checkpoint per step measures the sandbox, not the context
        require_finish=True,
    )


def survey_step(step_no: int, steps: int) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    """What the policy says and calls at `step_no`: four kinds of steps over the modules in turn."""
    if step_no >= steps - 1:
        return "Survey complete.", [("finish", {"summary": f"surveyed {MODULES} modules"})]
    module = f"src/module_{(step_no // 4) % MODULES}.py"
    kind = step_no % 4
    if kind == 0:
        return f"Reading {module}.", [("read_file", {"path": module})]
    if kind == 1:
        return f"Finding the TODOs of {module}.", [("shell", {"command": f"grep -n TODO {module}"})]
    if kind == 2:
        owners = f"grep -o 'TODO([a-z]*)' {module} | sort | uniq -c"
        return f"Counting owners in {module}.", [("shell", {"command": owners})]
    note = f"echo 'step {step_no}: {module} checked' >> notes.md && tail -n 2 notes.md"
    return f"Noting {module}.", [("shell", {"command": note})]


@dataclass(frozen=True, slots=True)
class StepTokens:
    step_no: int
    prompt_tokens: int
    cached_tokens: int
    digest_changed: bool  # the digest message differs from the previous call's: a fold point


class SurveyPolicy:
    """A `ChatClient` replying with `survey_step`, after sending each prompt to `model` for its usage.

    It counts prompts with `model` (a `PromptCounter`), so the runner budgets in the model's tokens."""

    def __init__(self, model: ChatClient, steps: int) -> None:
        if not isinstance(model, PromptCounter):
            raise ConfigError(
                f"model {model.name!r}: the long-session bench needs a client that counts prompt tokens "
                "(the in-process engine)"
            )
        self.name = f"survey-policy over {model.name}"
        self._model, self._counter, self.steps = model, model, steps
        self.digests: dict[int, str | None] = {}

    @property
    def max_model_len(self) -> int:
        return self._counter.max_model_len

    def count_prompt_tokens(self, request: ChatRequest) -> int:
        return self._counter.count_prompt_tokens(request)

    async def complete(self, request: ChatRequest) -> Completion:
        measured = await self._model.complete(replace(request, max_tokens=1))
        digest = next(
            (str(m["content"]) for m in request.messages[2:3] if DIGEST_TITLE in str(m.get("content"))),
            None,
        )
        self.digests[request.step_no] = digest
        said, calls = survey_step(request.step_no, self.steps)
        tool_calls = [
            ToolCall(f"call_{request.step_no}_{i}", name, json.dumps(arguments))
            for i, (name, arguments) in enumerate(calls)
        ]
        return Completion(assistant_message(said, tool_calls), measured.usage, FinishReason.TOOL_CALLS)

    async def close(self) -> None:
        await self._model.close()


@dataclass(frozen=True, slots=True)
class LongSessionResult:
    steps: int
    budget_tokens: int
    max_prompt_tokens: int
    median_prompt_tokens: float
    cached_share: float  # cached prompt tokens / prompt tokens, over all steps
    last_window_steps: int
    cached_share_last_window: float  # the same over the last `last_window_steps` steps
    fold_points: int  # steps whose digest differs from the previous step's
    status: str
    seconds: float
    load_average_1m: float
    per_step: list[StepTokens] = field(default_factory=list)


def _share(tokens: list[StepTokens]) -> float:
    prompt = sum(step.prompt_tokens for step in tokens)
    return sum(step.cached_tokens for step in tokens) / prompt if prompt else 0.0


async def run_long_session(
    stack: AgentStack,
    pool: Sandbox,
    model: ChatClient,
    steps: int,
    budget_tokens: int,
    embedder: Callable[[], Embedder] | None = None,
) -> LongSessionResult:
    """Run the survey task for `steps` steps on `model` and read its token counts from the journal."""
    spec = survey_task(steps, budget_tokens, recall_k=3 if embedder is not None else 0)
    policy = SurveyPolicy(model, steps)
    budget_tokens = step_budget(spec, None, policy.max_model_len)  # the model's window may cap it
    task_id = await stack.submit(spec)
    runner = TaskRunner(
        stack.journal, stack.artifacts, pool, policy, "long-session", RunnerConfig(), embedder=embedder
    )
    started = time.perf_counter()
    status = await runner.run(task_id)
    seconds = time.perf_counter() - started
    records = stack.journal.steps(task_id)
    per_step = [
        StepTokens(
            step.step_no,
            int(step.usage.get("prompt_tokens", 0)),
            int(step.usage.get("cached_tokens", 0)),
            step.step_no > 0 and policy.digests.get(step.step_no) != policy.digests.get(step.step_no - 1),
        )
        for step in records
    ]
    if not per_step:
        raise ConfigError(f"the long-session task ran no step (status {status})")
    prompts = [step.prompt_tokens for step in per_step]
    window = per_step[-LAST_WINDOW_STEPS:]
    return LongSessionResult(
        steps=len(per_step),
        budget_tokens=budget_tokens,
        max_prompt_tokens=max(prompts),
        median_prompt_tokens=float(statistics.median(prompts)),
        cached_share=round(_share(per_step), 4),
        last_window_steps=len(window),
        cached_share_last_window=round(_share(window), 4),
        fold_points=sum(step.digest_changed for step in per_step),
        status=(status or TaskStatus.QUEUED).value,
        seconds=round(seconds, 2),
        load_average_1m=os.getloadavg()[0],
        per_step=per_step,
    )
