"""`TaskRunner`: drive one task from wherever its journal stands to its end, durably.

Each step reads as plan -> run -> apply: build the context from the journal, call the model, journal the
reply and its tool-call intents (before anything acts on them), run the calls in the sandbox session,
checkpoint the workdir, commit the step. A runner holds the task's lease and renews it in the
background; if the lease is lost (it stalled and another worker took over) every further write fails
with `LeaseLost` and the runner stops. Resuming is not a special path: every run starts by restoring.
A sandbox session lost mid-task (its fleet instance died: `SessionLost`) is resumed the same way, at
once and by this runner: it re-claims the task (a new lease epoch, as a crash resumption has), opens a
new session elsewhere and restores the last committed snapshot, journaled like any resumption.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from pydantic import ValidationError

from tether.agents.check import run_check, with_outcome
from tether.agents.context_budget import ContextBudgetError, ContextFitter, step_budget
from tether.agents.loops import last_mark
from tether.agents.memory import Embedder
from tether.agents.recall import Recaller
from tether.agents.replay import (
    OUTCOME_UNKNOWN,
    CallAction,
    Outcome,
    StepOutcome,
    call_of,
    observation_of,
    parse_arguments,
    plan_resume,
    resolve_call,
    spent_budget,
    step_outcome,
)
from tether.agents.task import MIN_CONTEXT_BUDGET_TOKENS, TaskSpec
from tether.agents.telemetry import Telemetry
from tether.chat import ChatClient, ChatRequest, ToolCall
from tether.chat.tokens import PromptCounter, estimate_prompt_tokens
from tether.errors import ConfigError
from tether.sandbox.interface import Sandbox, SessionLost
from tether.store.artifacts import ArtifactStore
from tether.store.journal import Journal, LeaseLost
from tether.store.records import (
    JsonDict,
    StepRecord,
    TaskStatus,
    ToolCallRecord,
    idempotency_key,
    messages_digest,
)
from tether.tools import BUILTIN_TOOLS, HANDOFF, ReplayPolicy, SandboxWorkspace, Toolbox, ToolError, refusal


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    lease_s: float = 30.0  # another worker may take the task over this long after the last renewal
    max_session_losses: int = 5  # sessions lost in one run of a task before the loss is raised
    context_budget_tokens: int | None = None  # caps every task's context.budget_tokens (None: no cap)
    # Training (`rl/agent_rollouts.py`): a run the sandbox failed (sandbox error, failed worker QC) in a
    # tool call or the check raises `InfraError`, so the episode is run again from its journal and never
    # scored on it; hosted agents keep showing the status to their model.
    infra_errors: bool = False

    def __post_init__(self) -> None:
        assert self.lease_s > 0
        assert self.max_session_losses >= 0
        if self.context_budget_tokens is not None and self.context_budget_tokens < MIN_CONTEXT_BUDGET_TOKENS:
            raise ConfigError(
                f"context_budget_tokens = {self.context_budget_tokens}: expected at least "
                f"{MIN_CONTEXT_BUDGET_TOKENS} tokens, or None for the tasks' own budgets"
            )


class TaskRunner:
    def __init__(
        self,
        journal: Journal,
        artifacts: ArtifactStore,
        pool: Sandbox,
        model: ChatClient,
        owner: str,
        config: RunnerConfig | None = None,
        tools: Toolbox | None = None,
        telemetry: Telemetry | None = None,
        clock: Callable[[], float] = time.time,
        embedder: Callable[[], Embedder] | None = None,
    ) -> None:
        self.journal = journal
        self.artifacts = artifacts
        self.pool = pool
        self.model = model
        self.owner = owner
        self.config = config or RunnerConfig()
        self.tools = tools if tools is not None else BUILTIN_TOOLS
        self.telemetry = telemetry or Telemetry()
        self._clock = clock
        self._recaller = Recaller(embedder)
        # The model's own count where its client can give one: the budget then bounds what it prefills.
        counter = model if isinstance(model, PromptCounter) else None
        self._fitter = ContextFitter(counter.count_prompt_tokens if counter else estimate_prompt_tokens)
        self._model_len = counter.max_model_len if counter else None

    async def run(
        self,
        task_id: str,
        heartbeat: Callable[[], Awaitable[None]] | None = None,
        stop: asyncio.Event | None = None,
    ) -> TaskStatus | None:
        """Run the task to its end, to a hand-off between roles, or (once `stop` is set) to the end of the
        current step; the last two return QUEUED: the lease is given up and the task is to be published
        again. None if another worker holds the task or took it over meanwhile."""
        epoch = self.journal.claim(task_id, self.owner, self.config.lease_s)
        if epoch is None:
            return None
        lease = [epoch]  # the keeper renews whichever epoch is current
        driver = asyncio.current_task()
        assert driver is not None
        keeper = asyncio.create_task(self._keep_lease(task_id, lease, driver, heartbeat))
        try:
            losses = 0
            while True:
                try:
                    return await self._drive(task_id, lease[0], stop or asyncio.Event())
                except SessionLost as lost:
                    losses += 1
                    if losses > self.config.max_session_losses:
                        raise
                    resumed = self._resume_after_loss(task_id, lost)
                    if resumed is None:
                        return None
                    lease[0] = resumed
        except LeaseLost:
            return None
        except asyncio.CancelledError:
            if keeper.done() and not keeper.cancelled() and isinstance(keeper.exception(), LeaseLost):
                return None  # our own keeper stopped us: another worker owns the task now
            raise
        finally:
            self._recaller.forget(task_id)
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, LeaseLost):
                await keeper

    def _resume_after_loss(self, task_id: str, lost: SessionLost) -> int | None:
        """Take the task over from ourselves, as a worker does after a crash: a new lease epoch fences
        anything of the lost attempt, and the next `_drive` restores the last committed snapshot."""
        epoch = self.journal.claim(task_id, self.owner, self.config.lease_s)
        self.telemetry.errors.labels(kind="session_lost").inc()
        self.telemetry.event(
            "session_lost",
            task_id=task_id,
            session=lost.session_id,
            instance=lost.instance,
            reason=lost.reason,
            epoch=epoch,
        )
        return epoch

    async def _keep_lease(
        self,
        task_id: str,
        lease: list[int],
        driver: asyncio.Task[TaskStatus | None],
        heartbeat: Callable[[], Awaitable[None]] | None,
    ) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            try:
                self.journal.renew(task_id, lease[0], self.config.lease_s)
            except LeaseLost:
                driver.cancel()  # stop acting for a task another worker now owns
                raise
            if heartbeat is not None:
                try:
                    await heartbeat()
                except Exception as error:  # a bus hiccup must not stop the lease renewals
                    self.telemetry.errors.labels(kind="heartbeat").inc()
                    self.telemetry.event("heartbeat_failed", task_id=task_id, error=repr(error))

    async def _drive(self, task_id: str, epoch: int, stop: asyncio.Event) -> TaskStatus:
        task = self.journal.get_task(task_id)
        try:
            spec = TaskSpec.model_validate(task.spec)
        except ValidationError as error:
            return self._finish(task_id, epoch, TaskStatus.FAILED, error=f"invalid task spec: {error}")
        hands_off = {role.name: role.hands_off_to for role in spec.roles}
        steps = self.journal.steps(task_id)
        plan = plan_resume(steps, self.tools, spec.roles[0].name, hands_off, spec.require_finish)
        if plan.ended is not None and spec.check is None:
            return self._finish(task_id, epoch, TaskStatus.SUCCEEDED, result=plan.ended.summary)
        async with await self.pool.open_session(spec.sandbox) as session:
            workspace = SandboxWorkspace(session, infra_errors=self.config.infra_errors)
            await self._restore(workspace, spec, plan.snapshot_key, plan.reapply)

            async def end(
                status: TaskStatus, result: str | None = None, error: str | None = None
            ) -> TaskStatus:
                return await self._end(workspace, task_id, epoch, spec, status, result, error)

            if plan.ended is not None:  # finished before a crash, its check not journaled yet
                return await end(TaskStatus.SUCCEEDED, result=plan.ended.summary)
            role = plan.role
            if plan.pending is not None:
                finished = await self._complete_step(workspace, spec, epoch, plan.pending, hands_off)
                steps[-1] = finished[0]
                if finished[1].outcome is Outcome.FINISHED:
                    return await end(TaskStatus.SUCCEEDED, result=finished[1].summary)
                if finished[1].outcome is Outcome.HANDOFF:
                    return self._hand_off(task_id, epoch, plan.pending.role, finished[1])
                role = finished[1].next_role
            started_at = steps[0].started_at if steps else self._clock()
            while True:
                verdict = self._check_limits(task_id, spec, steps, started_at)
                if verdict is not None:
                    return await end(verdict[0], error=verdict[1])
                if stop.is_set():
                    return self._stop_between_steps(task_id, epoch, len(steps))
                try:
                    step = await self._model_step(task_id, epoch, spec, role, steps)
                except ContextBudgetError as error:
                    return await end(TaskStatus.FAILED, error=str(error))
                step, outcome = await self._complete_step(workspace, spec, epoch, step, hands_off)
                steps.append(step)
                if outcome.outcome is Outcome.FINISHED:
                    return await end(TaskStatus.SUCCEEDED, result=outcome.summary)
                if outcome.outcome is Outcome.HANDOFF:
                    return self._hand_off(task_id, epoch, step.role, outcome)
                role = outcome.next_role

    def _check_limits(
        self, task_id: str, spec: TaskSpec, steps: list[StepRecord], started_at: float
    ) -> tuple[TaskStatus, str] | None:
        if self.journal.get_task(task_id).cancel_requested:
            return TaskStatus.CANCELLED, "cancelled on request"
        spent = spent_budget(spec.limits, steps, self._clock() - started_at)
        if spent is not None:
            return TaskStatus.FAILED, spent
        loop = last_mark(steps, spec.loop)
        if loop is not None:
            self.telemetry.event("loop", task_id=task_id, step_no=len(steps) - 1, verdict=loop.describe())
            if loop.stop:
                return TaskStatus.FAILED, loop.describe()
        return None

    async def _end(
        self,
        workspace: SandboxWorkspace,
        task_id: str,
        epoch: int,
        spec: TaskSpec,
        status: TaskStatus,
        result: str | None,
        error: str | None,
    ) -> TaskStatus:
        """End the task; a task with a success check (and not cancelled) runs it first, and it decides:
        a finished task whose check fails has failed. The outcome is journaled with the end."""
        if spec.check is None or status is TaskStatus.CANCELLED:
            return self._finish(task_id, epoch, status, result=result, error=error)
        with self.telemetry.span("agent.check", task_id=task_id):
            outcome = await run_check(workspace.session, spec, spec.check, self.config.infra_errors)
        self.telemetry.event("check", task_id=task_id, passed=outcome.passed, fraction=outcome.fraction)
        if status is TaskStatus.SUCCEEDED and not outcome.passed:
            status, error = TaskStatus.FAILED, f"the success check failed (exit status {outcome.exit_code})"
        if status is TaskStatus.SUCCEEDED:
            return self._finish(task_id, epoch, status, result=with_outcome(result, outcome))
        return self._finish(task_id, epoch, status, result=result, error=with_outcome(error, outcome))

    def _finish(
        self,
        task_id: str,
        epoch: int,
        status: TaskStatus,
        result: str | None = None,
        error: str | None = None,
    ) -> TaskStatus:
        self.journal.finish(task_id, epoch, status, result=result, error=error)
        self.telemetry.event("task", task_id=task_id, status=status.value, error=error)
        return status

    def _hand_off(self, task_id: str, epoch: int, from_role: str, outcome: StepOutcome) -> TaskStatus:
        """The step is committed; give the lease up so the next role's turn can go to any worker."""
        self.journal.release(task_id, epoch)
        self.telemetry.event("handoff", task_id=task_id, from_role=from_role, to_role=outcome.next_role)
        return TaskStatus.QUEUED

    def _stop_between_steps(self, task_id: str, epoch: int, done_steps: int) -> TaskStatus:
        """Every step so far is committed: give the lease up so the task resumes from here."""
        self.journal.release(task_id, epoch)
        self.telemetry.event("stopped", task_id=task_id, steps=done_steps)
        return TaskStatus.QUEUED

    async def _restore(
        self,
        workspace: SandboxWorkspace,
        spec: TaskSpec,
        snapshot_key: str | None,
        reapply: tuple[ToolCallRecord, ...],
    ) -> None:
        if snapshot_key is not None:
            await workspace.restore(self.artifacts.get(snapshot_key))
        elif spec.files:
            await workspace.session.upload(dict(spec.files))
        for call in reapply:  # committed after the checkpoint: rebuild their effects, keep their observations
            tool = self.tools.get(call.tool)
            assert tool is not None  # plan_resume re-applies only calls of known tools
            # A call that failed when it first ran fails again here, with the same effect on the workdir.
            with contextlib.suppress(ToolError):
                await tool.function(workspace, call.arguments, call.idempotency_key)

    async def _model_step(
        self, task_id: str, epoch: int, spec: TaskSpec, role: str, steps: list[StepRecord]
    ) -> StepRecord:
        step_no = len(steps)
        role_spec = spec.role(role)
        tools = self.tools.only(role_spec.tools).specs()
        budget = step_budget(spec, self.config.context_budget_tokens, self._model_len)
        recalled = await self._recaller.recall(spec, steps)
        messages = self._fitter.fit(spec, role_spec, steps, recalled, tools, budget).messages
        request = ChatRequest(
            messages, tools=tools, max_tokens=spec.limits.max_output_tokens, step_no=step_no
        )
        started = self._clock()
        with self.telemetry.span("agent.model", task_id=task_id, step_no=step_no, role=role):
            clock = time.perf_counter()
            completion = await self.model.complete(request)
            self.telemetry.model_seconds.observe(time.perf_counter() - clock)
        done = self._clock()
        intents = []
        for index, call in enumerate(completion.tool_calls):
            arguments = parse_arguments(call.arguments)
            intents.append(
                ToolCallRecord(
                    idempotency_key=idempotency_key(task_id, step_no, index),
                    task_id=task_id,
                    step_no=step_no,
                    call_index=index,
                    tool=call.name,
                    arguments=arguments if isinstance(arguments, dict) else {"_invalid": arguments},
                    intent_at=done,
                )
            )
        usage = completion.usage
        record = StepRecord(
            task_id=task_id,
            step_no=step_no,
            epoch=epoch,
            role=role,
            message=completion.message,
            usage={
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "cached_tokens": usage.cached_tokens,
            },
            messages_in=len(messages),
            messages_in_digest=messages_digest(messages),
            started_at=started,
            model_done_at=done,
            tool_calls=tuple(intents),
        )
        return self.journal.append_step(record)

    async def _complete_step(
        self,
        workspace: SandboxWorkspace,
        spec: TaskSpec,
        epoch: int,
        step: StepRecord,
        hands_off: dict[str, tuple[str, ...]],
    ) -> tuple[StepRecord, StepOutcome]:
        clock = time.perf_counter()
        allowed = self.tools.only(spec.role(step.role).tools)
        observations: dict[str, JsonDict] = {}
        with self.telemetry.span("agent.step", task_id=step.task_id, step_no=step.step_no, role=step.role):
            for call in step.tool_calls:
                action = resolve_call(call, allowed.get(call.tool))
                if action is CallAction.REUSE:
                    continue
                if action is CallAction.OUTCOME_UNKNOWN:
                    observations[call.idempotency_key] = OUTCOME_UNKNOWN
                    continue
                observations[call.idempotency_key] = await self._call_tool(
                    workspace, epoch, call_of(step, call), call, allowed, hands_off.get(step.role, ())
                )
            provisional = tuple(
                call
                if call.observation is not None
                else _with_observation(call, observations[call.idempotency_key])
                for call in step.tool_calls
            )
            outcome = step_outcome(
                _with_calls(step, provisional), self.tools, hands_off.get(step.role, ()), spec.require_finish
            )
            snapshot_key = None
            if outcome.outcome is Outcome.FINISHED or (step.step_no + 1) % spec.snapshot_every == 0:
                snapshot_key = self.artifacts.put(await workspace.snapshot())
            self.journal.commit_step(step.task_id, step.step_no, epoch, observations, snapshot_key)
        committed = self.journal.step(step.task_id, step.step_no)
        assert committed is not None
        self.telemetry.step_committed(
            step.task_id, step.step_no, step.role, step.usage, time.perf_counter() - clock
        )
        outcome = step_outcome(committed, self.tools, hands_off.get(step.role, ()), spec.require_finish)
        return committed, outcome

    async def _call_tool(
        self,
        workspace: SandboxWorkspace,
        epoch: int,
        request: ToolCall,
        call: ToolCallRecord,
        allowed: Toolbox,
        hands_off_to: tuple[str, ...],
    ) -> JsonDict:
        """Check the call against the role's tools, journal that it starts, run it; the model's mistakes
        (unknown tool, bad arguments, a hand-off to a role it may not pass to) become error observations
        and never start."""
        try:
            tool, arguments = allowed.check(request)
            if tool.name == HANDOFF.name and arguments["to"] not in hands_off_to:
                raise ToolError(
                    f"cannot hand off to {arguments['to']!r}; this role may hand off to: "
                    f"{', '.join(hands_off_to) or 'no one'}"
                )
        except ToolError as error:
            return observation_of(refusal(request, str(error)))
        self.journal.mark_started(call.task_id, epoch, call.idempotency_key)
        clock = time.perf_counter()
        with self.telemetry.span("agent.tool", tool=call.tool, key=call.idempotency_key):
            result = await tool.run(workspace, request, arguments, call.idempotency_key)
        self.telemetry.tool_finished(
            call.task_id, call.step_no, call.tool, time.perf_counter() - clock, result.error
        )
        observation = observation_of(result)
        if tool.policy in (ReplayPolicy.EXTERNAL_IDEMPOTENT, ReplayPolicy.EXTERNAL_AT_MOST_ONCE):
            # Effects outside the workdir are not undone by a restore: record them at once.
            self.journal.record_observation(call.task_id, epoch, call.idempotency_key, observation)
        return observation


def _with_observation(call: ToolCallRecord, observation: JsonDict) -> ToolCallRecord:
    return replace(call, observation=observation)


def _with_calls(step: StepRecord, calls: tuple[ToolCallRecord, ...]) -> StepRecord:
    return replace(step, tool_calls=calls)
