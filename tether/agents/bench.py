"""Checkpoint overhead: how long persisting one step takes (journal append of the model output and
intents, then the commit with observations), measured on a real journal. No model, no sandbox.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tether.machine import load_average, machine_record
from tether.store.journal import Journal
from tether.store.records import StepRecord, ToolCallRecord, idempotency_key


@dataclass(frozen=True, slots=True)
class PersistBench:
    steps: int
    tool_calls_per_step: int
    append_median_ms: float
    commit_median_ms: float
    step_median_ms: float  # append + commit: the whole cost of persisting a step
    step_p95_ms: float
    machine: dict[str, Any]
    """`tether.machine.machine_record`; threads: the one writer."""


def _step(task_id: str, step_no: int, epoch: int, calls: int) -> StepRecord:
    now = time.time()
    return StepRecord(
        task_id=task_id,
        step_no=step_no,
        epoch=epoch,
        role="agent",
        message={"role": "assistant", "content": "x" * 400},
        usage={"prompt_tokens": 900, "completion_tokens": 100},
        messages_in=2 * step_no + 2,
        messages_in_digest="0" * 32,
        started_at=now,
        model_done_at=now,
        tool_calls=tuple(
            ToolCallRecord(
                idempotency_key(task_id, step_no, i), task_id, step_no, i, "shell", {"command": "ls"}, now
            )
            for i in range(calls)
        ),
    )


def bench_step_persist(journal: Journal, steps: int = 500, tool_calls_per_step: int = 2) -> PersistBench:
    load_start = load_average()
    task_id = f"bench-{uuid.uuid4().hex[:12]}"
    journal.create_task(task_id, {"goal": "benchmark"})
    epoch = journal.claim(task_id, "bench", lease_s=3600)
    assert epoch is not None
    appends, commits, totals = [], [], []
    observation = {"content": "status: ok\nexit code: 0\nstdout:\n" + "y" * 300, "error": False}
    for step_no in range(steps):
        record = _step(task_id, step_no, epoch, tool_calls_per_step)
        start = time.perf_counter()
        journal.append_step(record)
        appended = time.perf_counter()
        journal.commit_step(
            task_id, step_no, epoch, {call.idempotency_key: observation for call in record.tool_calls}, None
        )
        done = time.perf_counter()
        appends.append((appended - start) * 1000)
        commits.append((done - appended) * 1000)
        totals.append((done - start) * 1000)
    return PersistBench(
        steps=steps,
        tool_calls_per_step=tool_calls_per_step,
        append_median_ms=statistics.median(appends),
        commit_median_ms=statistics.median(commits),
        step_median_ms=statistics.median(totals),
        step_p95_ms=statistics.quantiles(totals, n=20)[-1],
        machine=machine_record(1, load_start),
    )
