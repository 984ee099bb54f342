"""Acceptance: an RL run and an agent task on a fleet of 3 `tether sandbox serve` processes, one of
which is SIGKILLed mid-run: the run finishes every step with its full batch and no sandbox failure,
and the agent task resumes in a new session from its last snapshot, every effect exactly once."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.live_server import sandbox_fleet
from tests.rl.test_agent_rollouts import long_model  # noqa: F401 - the tiny model with room for tools
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import ContextSpec, Limits, TaskSpec
from tether.cli.main import app
from tether.sandbox import SandboxSpec
from tether.sandbox.pool import SandboxPool
from tether.store import StepStatus, TaskStatus

Server = tuple[subprocess.Popen[bytes], str]


@pytest.fixture
def fleet() -> Iterator[list[Server]]:
    with sandbox_fleet(3, "--slots", "2") as servers:
        yield servers


def fleet_env(servers: list[Server]) -> str:
    return json.dumps([url for _, url in servers])


def open_sessions(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/v1/load", timeout=2).json()["open_sessions"])
    except httpx.TransportError:
        return 0


def kill_busiest(servers: list[Server], within_s: float = 10.0) -> tuple[Server, int]:
    """SIGKILL the instance holding the most sessions (the first to hold one within `within_s`);
    returns it and how many sessions it held."""
    deadline = time.monotonic() + within_s
    while True:
        counts = [open_sessions(url) for _, url in servers]
        if max(counts) > 0 or time.monotonic() > deadline:
            victim = servers[counts.index(max(counts))]
            os.kill(victim[0].pid, signal.SIGKILL)
            victim[0].wait()
            return victim, max(counts)
        time.sleep(0.05)


def train_config(path: Path, model: Path, out_dir: Path) -> Path:
    path.write_text(
        f"""
[model]
name = "{model}"
kv_cache_mib = 32

[envs.weights]
"agent/shell" = 1.0

[agents]
max_steps = 2

[rollout]
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 8

[algorithm]
kl_coef = 0.01

[optim]
lr = 1e-3
micro_batch = 2

[run]
name = "fleet"
out_dir = "{out_dir}"
steps = 4
seed = 3
checkpoint_every = 100
"""
    )
    return path


def test_an_rl_run_on_a_fleet_finishes_every_step_when_an_instance_is_killed(
    fleet: list[Server],
    long_model: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tether.agents")
    monkeypatch.setenv("TETHER_SANDBOX__FLEET", fleet_env(fleet))
    created: list[object] = []
    init = SandboxPool.__init__

    def recording_init(self: SandboxPool, *args: object, **kwargs: object) -> None:
        created.append(self)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SandboxPool, "__init__", recording_init)
    config = train_config(tmp_path / "train.toml", long_model, tmp_path / "runs")
    metrics = tmp_path / "runs" / "fleet" / "metrics.jsonl"
    killed: list[tuple[Server, int]] = []

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().count("\n") >= 1:
                killed.append(kill_busiest(fleet))
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    result = CliRunner().invoke(app, ["train", "--config", str(config)])
    watcher.join(5)
    assert result.exit_code == 0, result.output
    assert killed, "the run ended before an instance could be killed"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["rollouts"] == 4 and row["score_errors"] == 0, row  # a full batch, nothing lost
    assert created == []  # remote: no sandbox worker was started in this process
    (_, victim_url), held = killed[0]
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tether.agents"]
    lost = [e for e in events if e["event"] == "session_lost"]
    # The victim held sessions of step 2's episodes; each that was still in use was resumed elsewhere
    # (one closing at the instant of the kill has nothing left to lose).
    assert held > 0 and len(lost) <= held, (held, lost)
    assert {e["instance"] for e in lost} <= {victim_url}, lost


SHELL_STEPS = 6


def agent_script(path: Path) -> Path:
    """Shell calls that take a moment each (so a kill lands mid-task), each appending its marker."""
    lines = [
        {
            "content": f"step {n}",
            "tool_calls": [
                {"name": "shell", "arguments": {"command": f"sleep 0.5; echo effect-{n} >> effects.log"}}
            ],
        }
        for n in range(SHELL_STEPS)
    ]
    lines.append({"content": "done", "tool_calls": [{"name": "finish", "arguments": {"summary": "ok"}}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_an_agent_task_resumes_in_a_new_session_when_the_instance_holding_its_session_is_killed(
    fleet: list[Server], tmp_path: Path
) -> None:
    home = tmp_path / "agents"
    spec = TaskSpec(
        goal="append effects",
        files={"seed.txt": "x"},
        limits=Limits(max_steps=SHELL_STEPS + 3),
        context=ContextSpec(recall_k=0),
        sandbox=SandboxSpec(timeout_s=20),
    )

    async def submit() -> str:
        stack = AgentStack(AgentsConfig.embedded(home))
        try:
            return await stack.submit(spec)
        finally:
            await stack.close()

    task_id = asyncio.run(submit())
    log = tmp_path / "worker.log"
    env = {**os.environ, "TETHER_SANDBOX__FLEET": fleet_env(fleet), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "tether.cli.worker", "--home", str(home), "--lease-s", "5"]
    command += ["--model", f"scripted:{agent_script(tmp_path / 'script.jsonl')}", "--exit-when-idle"]
    with open(log, "wb") as output:
        worker = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    stack = AgentStack(AgentsConfig.embedded(home))
    try:
        deadline = time.monotonic() + 60
        while not any(s.status is StepStatus.COMMITTED for s in stack.journal.steps(task_id)):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        victim, held = kill_busiest(fleet, within_s=0)
        assert held == 1
        assert open_sessions(victim[1]) == 0
        assert worker.wait(timeout=90) == 0, log.read_text()
        task = stack.journal.get_task(task_id)
        steps = stack.journal.steps(task_id)
        effects = asyncio.run(_final_effects(stack, steps[-1].snapshot_key))
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        asyncio.run(stack.close())
    text = log.read_text()
    assert task.status is TaskStatus.SUCCEEDED, (task.error, text)
    lost = [json.loads(line) for line in text.splitlines() if '"event": "session_lost"' in line]
    assert len(lost) == 1 and lost[0]["instance"] == victim[1], text
    assert lost[0]["session"].startswith(f"{victim[1].removeprefix('http://')}~s")  # the id names it
    assert task.lease_epoch == 2 and steps[0].epoch == 1 and steps[-1].epoch == 2  # resumed, journaled
    assert [s.step_no for s in steps] == list(range(SHELL_STEPS + 1))
    assert all(s.status is StepStatus.COMMITTED for s in steps)
    assert effects == "".join(f"effect-{n}\n" for n in range(SHELL_STEPS))  # each exactly once


async def _final_effects(stack: AgentStack, key: str | None) -> str:
    from tests.agents.chaos import snapshot_files

    return snapshot_files(stack.artifacts, key)["effects.log"].decode()
