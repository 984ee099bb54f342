"""Agent tasks for the console's tests: a real `TaskRunner` over a real sandbox in a background thread, driven
by a scripted model the test lets through one step at a time, and a long journal written step by step the
way a worker writes it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import TaskSpec
from tether.chat import ChatRequest, Completion
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store.journal import Journal
from tether.store.records import StepRecord, TaskStatus, ToolCallRecord, idempotency_key
from tether.testing.scripted import ScriptedClient


class WorkerCrash(BaseException):
    """A worker dying in the middle of a step: nothing of the runner's own error handling catches it."""


class GatedModel(ScriptedClient):
    """A scripted model that answers a step only when the test lets one through (`step()`), so a page can
    be watched between steps; its worker dies once on being asked for step `crash_at`, if given."""

    def __init__(self, replies: list[dict[str, Any]], crash_at: int | None = None) -> None:
        super().__init__(replies, "gated")
        self.gate = threading.Semaphore(0)
        self.crash_at = crash_at

    def step(self) -> None:
        self.gate.release()

    async def complete(self, request: ChatRequest) -> Completion:
        if request.step_no == self.crash_at:
            self.crash_at = None
            raise WorkerCrash(f"the worker died before step {request.step_no}'s reply was journaled")
        deadline = time.monotonic() + 60
        while not self.gate.acquire(blocking=False):  # polled, so that a cancelled call takes no permit
            if time.monotonic() > deadline:
                raise TimeoutError("the test did not let the step through")
            await asyncio.sleep(0.02)
        return await super().complete(request)


@contextmanager
def worker_thread(
    config: AgentsConfig, task_id: str, model: ScriptedClient, owners: tuple[str, ...] = ("worker-a",)
) -> Iterator[threading.Thread]:
    """Workers running `task_id` to its end in a thread and loop of their own, hand-offs included (as
    `tether worker` takes a handed-off task up again); when one dies the next takes the task over once its
    lease expires. Joined on exit."""

    async def work() -> None:
        stack = AgentStack(config)
        try:
            async with SandboxPool(SandboxSpec(timeout_s=20), PoolConfig(slots=1)) as pool:
                for owner in owners:
                    runner = TaskRunner(
                        stack.journal, stack.artifacts, pool, model, owner, RunnerConfig(lease_s=3)
                    )
                    with contextlib.suppress(WorkerCrash):
                        await _run_to_end(runner, task_id)
                        return
        finally:
            await stack.close()

    thread = threading.Thread(target=asyncio.run, args=(work(),), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        thread.join(90)


async def _run_to_end(runner: TaskRunner, task_id: str) -> None:
    while True:
        status = await runner.run(task_id)
        if status is None:  # a dead worker's lease has not expired yet
            await asyncio.sleep(0.2)
        elif status is not TaskStatus.QUEUED:
            return


def submit(config: AgentsConfig, spec: TaskSpec) -> str:
    """`tether agent submit`'s path, in a thread of its own (a browser test's thread runs Playwright)."""

    async def go() -> str:
        stack = AgentStack(config)
        try:
            return await stack.submit(spec)
        finally:
            await stack.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, go()).result()


def journal_long_task(
    journal: Journal, task_id: str, steps: int, running: bool = True, end: TaskStatus | None = None
) -> None:
    """`steps` committed steps of a claimed task, each a reply and two shell calls with their output; then
    the worker keeps the task (running), gives it up between steps (queued, as after a hand-off), or ends
    it (`end`)."""
    epoch = journal.claim(task_id, "worker-long", lease_s=3600)
    assert epoch is not None
    for step_no in range(steps):
        now = time.time()
        calls = tuple(
            ToolCallRecord(
                idempotency_key(task_id, step_no, index),
                task_id,
                step_no,
                index,
                "shell",
                {"command": f"grep -c ERROR logs/part-{step_no:03d}-{index}.log"},
                now,
            )
            for index in range(2)
        )
        journal.append_step(
            StepRecord(
                task_id=task_id,
                step_no=step_no,
                epoch=epoch,
                role="agent",
                message={"role": "assistant", "content": f"Counting errors in part {step_no}."},
                usage={"prompt_tokens": 800 + step_no, "cached_tokens": 600, "completion_tokens": 40},
                messages_in=2 * step_no + 2,
                messages_in_digest="0" * 32,
                started_at=now,
                model_done_at=now + 0.01,
                tool_calls=calls,
            )
        )
        observations = {
            call.idempotency_key: {
                "content": f"status: ok\nexit code: 0\nstdout:\n{step_no % 7}\n",
                "error": False,
            }
            for call in calls
        }
        journal.commit_step(task_id, step_no, epoch, observations, None)
    if end is not None:
        failed = end is TaskStatus.FAILED
        journal.finish(task_id, epoch, end, None if failed else "counted", "gave up" if failed else None)
    elif not running:
        journal.release(task_id, epoch)
