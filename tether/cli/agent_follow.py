"""Running a task here: an in-process worker drives it while its timeline prints, step by step, until it
ends or Ctrl-C stops it (resumable either way). Used by `tether agent run` and `resume --run`; `logs
--follow` prints the same timeline without running anything."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from tether.agents.timeline import task_line, timeline_lines
from tether.cli.common import CliState, err_console
from tether.cli.worker import run_worker, stop_on_interrupt
from tether.store.records import StepRecord, TaskRecord

if TYPE_CHECKING:
    from tether.agents.service import AgentsConfig
    from tether.chat import ChatClient
    from tether.store.journal import Journal

console = Console(soft_wrap=True)  # timeline lines stay one line each, even when piped


def print_new_steps(journal: Journal, task_id: str, printed: dict[int, int]) -> TaskRecord:
    """Print steps, tool calls and nudges not printed yet: a step's line when it starts, its calls with
    their results (and any nudge) once it is committed.

    Every step is read again each time: a step's loop mark depends on the steps before it."""
    task = journal.get_task(task_id)
    steps = journal.steps(task_id)
    for step, lines in zip(steps, timeline_lines(steps, task.spec), strict=True):
        shown = lines if step.committed_at is not None else lines[:1]
        for line in shown[printed.get(step.step_no, 0) :]:
            console.print(line, highlight=False, markup=False)
        printed[step.step_no] = len(shown)
    return journal.get_task(task_id)


async def follow(journal: Journal, task_id: str, printed: dict[int, int], poll_s: float = 0.5) -> TaskRecord:
    while True:
        task = print_new_steps(journal, task_id, printed)
        if task.status.terminal:
            print_new_steps(journal, task_id, printed)
            console.print(task_line(task), highlight=False, markup=False)
            return task
        await asyncio.sleep(poll_s)


def open_model_client(
    cli: CliState,
    model: str | None,
    base_url: str | None,
    device: str,
    dtype: str,
    kv_cache_mib: int = 256,
    max_model_len: int | None = None,
    rope_scaling: str | None = None,
) -> ChatClient:
    """Loaded before the timeline starts, so whatever loading prints comes before it, not inside it."""
    if base_url is None and model is not None and not model.startswith("scripted:"):
        err_console.print(f"loading model {model} ...", highlight=False, soft_wrap=True)
    from tether.serving.engine_client import open_client

    return open_client(
        model,
        base_url,
        cli.settings().cache_dir,
        device=device,
        dtype=dtype,
        kv_cache_mib=kv_cache_mib,
        max_model_len=max_model_len,
        rope_scaling=rope_scaling,
    )


def stopped_line(task: TaskRecord, steps: list[StepRecord]) -> str:
    committed = sum(step.committed_at is not None for step in steps)
    where = f"after step {committed - 1}" if committed else "before its first step"
    return (
        f"stopped {where}: task {task.task_id} is {task.status.value} with its {committed} committed "
        f"step(s) in the journal; continue it with `tether agent resume {task.task_id} --run` "
        "or a `tether worker`"
    )


def work_and_follow(cli: CliState, config: AgentsConfig, task_id: str, model: ChatClient) -> TaskRecord:
    """Run an in-process worker and print the task's timeline until the task ends.

    Ctrl-C stops the task after its current step (queued, resumable); a second Ctrl-C stops at once,
    mid-step (equally resumable: the journal holds the step's intent). Both exit 130."""
    from tether.agents.worker import WorkerConfig
    from tether.store.journal import Journal

    async def main() -> TaskRecord:
        stop = asyncio.Event()
        stop_on_interrupt(stop, "interrupted: stopping after the current step (Ctrl-C again to stop at once)")
        journal = Journal(config.store_url, table_prefix=config.table_prefix)
        worker = asyncio.create_task(run_worker(cli, config, model, WorkerConfig(max_in_flight=1), stop))
        printed: dict[int, int] = {}
        follower = asyncio.create_task(follow(journal, task_id, printed))
        try:
            done, _ = await asyncio.wait({worker, follower}, return_when=asyncio.FIRST_COMPLETED)
            if follower in done:
                return follower.result()
            worker.result()  # a worker that failed to start raises here, with its message
            follower.cancel()  # the worker stopped between steps: the task will not end here
            return print_new_steps(journal, task_id, printed)
        except asyncio.CancelledError:
            worker.cancel()
            raise
        finally:
            stop.set()
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            journal.close()
            await model.close()

    try:
        task = asyncio.run(main())
    except asyncio.CancelledError:
        err_console.print(
            f"stopped at once: task {task_id} resumes from its journal (the interrupted step is finished "
            f"first) with `tether agent resume {task_id} --run` or a `tether worker`",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    if not task.status.terminal:
        journal = Journal(config.store_url, table_prefix=config.table_prefix)
        try:
            err_console.print(stopped_line(task, journal.steps(task_id)), highlight=False, soft_wrap=True)
        finally:
            journal.close()
        raise typer.Exit(130)
    return task
