"""`AgentWorker`: take task ids from the bus, run each with a `TaskRunner`, ack when the task has ended.

Backpressure: the worker pulls only as many messages as it has free slots (`max_in_flight`), so a flood
of submissions waits in the queue. A message is acked only once its task is in a terminal state; a
worker that dies leaves its messages unacked, the bus redelivers them after the visibility timeout, and
whichever worker gets one resumes the task from its journal. A task held by a live worker is left
unacked (its redelivery is a no-op until the holder finishes). A hand-off between roles ends the
delivery and publishes the task again, so each role's turn is a message any worker may take.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from tether.agents.runner import TaskRunner
from tether.bus.base import Delivery, TaskBus
from tether.errors import ConfigError, TetherError
from tether.store.journal import UnknownTask
from tether.store.records import TaskStatus

log = logging.getLogger("tether.agents.worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    max_in_flight: int = 2  # tasks run at once by this worker (each holds one sandbox session)
    poll_s: float = 1.0  # longest wait on an empty queue before checking for shutdown
    max_deliveries: int = 50  # a task delivered this often without ending is failed (a poison task)

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight = {self.max_in_flight}: must be at least 1")
        if self.max_deliveries < 1:
            raise ConfigError(f"max_deliveries = {self.max_deliveries}: must be at least 1")


class AgentWorker:
    def __init__(self, bus: TaskBus, runner: TaskRunner, config: WorkerConfig | None = None) -> None:
        self.bus = bus
        self.runner = runner
        self.journal = runner.journal
        self.config = config or WorkerConfig()
        self.in_flight: set[asyncio.Task[None]] = set()
        self.finished = 0

    async def serve(self, stop: asyncio.Event, exit_when_idle: bool = False) -> None:
        """Consume until `stop` is set (or, with `exit_when_idle`, until the queue has nothing for us).

        Once `stop` is set no task is taken; each running task stops at its next step boundary, queued
        again with its journal intact. Cancelling `serve` stops them at once (mid-step, equally safe)."""
        try:
            while not stop.is_set():
                free = self.config.max_in_flight - len(self.in_flight)
                if free == 0:
                    await asyncio.wait(self.in_flight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                deliveries = await self.bus.receive(free, wait_s=self.config.poll_s)
                if not deliveries and exit_when_idle and not self.in_flight:
                    return
                for delivery in deliveries:
                    job = asyncio.create_task(self._handle(delivery, stop))
                    self.in_flight.add(job)
                    job.add_done_callback(self.in_flight.discard)
            if self.in_flight:
                await asyncio.wait(self.in_flight)
        finally:
            for job in list(self.in_flight):
                job.cancel()
            for job in list(self.in_flight):
                with contextlib.suppress(asyncio.CancelledError):
                    await job

    async def _handle(self, delivery: Delivery, stop: asyncio.Event) -> None:
        try:
            await self._attempt(delivery, stop)
        except TetherError as error:
            # Left unacked on purpose: the bus redelivers after the visibility timeout and a worker resumes.
            self.runner.telemetry.errors.labels(kind="task_attempt").inc()
            log.warning("task %s attempt failed, will be retried: %s", delivery.task_id, error)
        except Exception:
            # Anything else (a database outage, a bug) must not take the other in-flight tasks down with it;
            # the same redelivery retries it, and max_deliveries ends a task that fails every time.
            self.runner.telemetry.errors.labels(kind="task_attempt").inc()
            log.exception("task %s attempt failed unexpectedly, will be retried", delivery.task_id)

    async def _attempt(self, delivery: Delivery, stop: asyncio.Event) -> None:
        try:
            task = self.journal.get_task(delivery.task_id)
        except UnknownTask:
            log.warning(
                "dropping message %s: no task %s in the journal", delivery.message_id, delivery.task_id
            )
            await self.bus.ack(delivery)
            return
        if task.status.terminal:
            await self.bus.ack(delivery)
            return
        if delivery.attempt > self.config.max_deliveries:
            await self._give_up(delivery)
            return
        status = await self.runner.run(
            delivery.task_id, heartbeat=lambda: self.bus.extend(delivery), stop=stop
        )
        if status is TaskStatus.QUEUED:
            # A hand-off between roles (or a stop between steps) travels as a new message; publish before
            # ack, so a crash in between can only duplicate the message (harmless: the journal decides).
            await self.bus.publish(delivery.task_id)
            await self.bus.ack(delivery)
        elif status is not None:
            self.finished += 1
            await self.bus.ack(delivery)

    async def _give_up(self, delivery: Delivery) -> None:
        epoch = self.journal.claim(delivery.task_id, self.runner.owner, self.runner.config.lease_s)
        if epoch is None:
            return
        self.journal.finish(
            delivery.task_id,
            epoch,
            TaskStatus.FAILED,
            error=f"delivered {delivery.attempt} times without ending "
            f"(max_deliveries={self.config.max_deliveries})",
        )
        await self.bus.ack(delivery)
