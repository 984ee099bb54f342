"""`tether worker`: consume the agent task queue; run several (on one machine or many) to share the work.

Also runnable as `python -m tether.cli.worker` (the fault test starts and SIGKILLs workers this way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tether.cli.common import (
    CliState,
    DeviceOption,
    DTypeOption,
    KvCacheMibOption,
    MaxModelLenOption,
    RopeScalingOption,
    err_console,
    open_sandbox,
    state,
    user_errors,
)

if TYPE_CHECKING:
    from tether.agents.service import AgentsConfig
    from tether.agents.worker import WorkerConfig
    from tether.chat import ChatClient

HomeOption = Annotated[
    Path | None, typer.Option("--home", help="Embedded state directory (default: $TETHER_HOME/agents).")
]
StoreOption = Annotated[
    str | None, typer.Option("--store", help="Journal: sqlite:///PATH or postgresql://USER@HOST/DB.")
]
BusOption = Annotated[
    str | None, typer.Option("--bus", help="Queue: sqlite:///PATH, redis://HOST:PORT or nats://HOST:PORT.")
]
BusNameOption = Annotated[str, typer.Option("--bus-name", help="Queue/stream name.")]
TablePrefixOption = Annotated[str, typer.Option("--table-prefix", help="Prefix of the journal's tables.")]
ArtifactsOption = Annotated[
    str | None, typer.Option("--artifacts", help="Snapshot store: a directory or an fsspec URL (s3://...).")
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model", help="Engine model NAME (in process), a model name at --base-url, or scripted:FILE."
    ),
]
BaseUrlOption = Annotated[
    str | None,
    typer.Option("--base-url", help="Any OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1."),
]
VisibilityOption = Annotated[
    float, typer.Option("--visibility-timeout-s", min=0.1, help="Unacked tasks are redelivered after this.")
]
LeaseOption = Annotated[
    float, typer.Option("--lease-s", min=0.1, help="A silent worker's tasks are taken over after this.")
]


@dataclass(frozen=True, slots=True)
class Locations:
    home: Path | None
    store: str | None
    bus: str | None
    bus_name: str
    artifacts: str | None
    table_prefix: str = "agent_"

    def config(
        self, cli: CliState, visibility_timeout_s: float = 30.0, lease_s: float = 30.0
    ) -> AgentsConfig:
        from tether.agents.service import AgentsConfig

        home = self.home or cli.settings().home / "agents"
        embedded = AgentsConfig.embedded(home)
        return replace(
            embedded,
            store_url=self.store or embedded.store_url,
            bus_url=self.bus or embedded.bus_url,
            artifacts_url=self.artifacts or embedded.artifacts_url,
            bus_name=self.bus_name,
            table_prefix=self.table_prefix,
            visibility_timeout_s=visibility_timeout_s,
            lease_s=lease_s,
        )


def stop_on_interrupt(stop: asyncio.Event, notice: str) -> None:
    """The first SIGINT/SIGTERM sets `stop` (tasks stop at their next step boundary, resumable) and prints
    `notice`; a second cancels the running task (the caller's main coroutine) at once. Call from inside
    that coroutine."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None

    def interrupted() -> None:
        if stop.is_set():
            main.cancel()
        else:
            stop.set()
            err_console.print(notice, highlight=False, soft_wrap=True)

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupted)


async def run_worker(
    cli: CliState,
    config: AgentsConfig,
    model: ChatClient,
    worker_config: WorkerConfig,
    stop: asyncio.Event,
    exit_when_idle: bool = False,
    metrics_port: int | None = None,
) -> int:
    """Serve the queue with `model` (the caller opened it and closes it) until `stop` or idle."""
    from prometheus_client import start_http_server

    from tether.agents.memory import MiniLMEmbedder, minilm_installed
    from tether.agents.runner import RunnerConfig, TaskRunner
    from tether.agents.service import AgentStack
    from tether.agents.telemetry import Telemetry
    from tether.agents.worker import AgentWorker

    settings = cli.settings()
    telemetry = Telemetry()
    server = None
    if metrics_port is not None:
        server, _ = start_http_server(metrics_port, addr="127.0.0.1", registry=telemetry.registry)
    try:
        stack = AgentStack(config)
        # Each task holds one session: a local pool of max_in_flight slots, or the configured fleet.
        pool = open_sandbox(settings, slots=worker_config.max_in_flight)
        try:
            await pool.start()
            try:
                runner = TaskRunner(
                    stack.journal,
                    stack.artifacts,
                    pool,
                    model,
                    owner=f"worker-{uuid.uuid4().hex[:8]}",
                    config=RunnerConfig(lease_s=config.lease_s),
                    telemetry=telemetry,
                    embedder=MiniLMEmbedder if minilm_installed() else None,
                )
                worker = AgentWorker(stack.bus, runner, worker_config)
                telemetry.event("worker_ready", owner=runner.owner, max_in_flight=worker_config.max_in_flight)
                await worker.serve(stop, exit_when_idle=exit_when_idle)
                return worker.finished
            finally:
                await pool.close()
        finally:
            await stack.close()
    finally:
        if server is not None:
            server.shutdown()


def worker_command(
    ctx: typer.Context,
    home: HomeOption = None,
    store: StoreOption = None,
    bus: BusOption = None,
    bus_name: BusNameOption = "tether-tasks",
    table_prefix: TablePrefixOption = "agent_",
    artifacts: ArtifactsOption = None,
    model: ModelOption = None,
    base_url: BaseUrlOption = None,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "float32",
    kv_cache_mib: KvCacheMibOption = 256,
    max_model_len: MaxModelLenOption = None,
    rope_scaling: RopeScalingOption = None,
    max_in_flight: Annotated[int, typer.Option("--max-in-flight", min=1, help="Tasks run at once.")] = 2,
    visibility_timeout_s: VisibilityOption = 30.0,
    lease_s: LeaseOption = 30.0,
    exit_when_idle: Annotated[
        bool, typer.Option("--exit-when-idle", help="Stop once the queue is empty.")
    ] = False,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", min=1, max=65535, help="Serve Prometheus /metrics here.")
    ] = None,
) -> None:
    """Run agent tasks from the queue until stopped (Ctrl-C: after the current steps; SIGKILL is safe).

    A first SIGINT/SIGTERM lets each running task finish its step, a second stops at once; either way every
    task resumes from its journal."""
    from tether.agents.worker import WorkerConfig
    from tether.serving.engine_client import open_client

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli = state(ctx)
    with user_errors():
        config = Locations(home, store, bus, bus_name, artifacts, table_prefix).config(
            cli, visibility_timeout_s, lease_s
        )

        chat_model = open_client(
            model,
            base_url,
            cli.settings().cache_dir,
            device=device,
            dtype=dtype,
            kv_cache_mib=kv_cache_mib,
            max_model_len=max_model_len,
            rope_scaling=rope_scaling,
        )

        async def main() -> int:
            stop = asyncio.Event()
            stop_on_interrupt(
                stop, "stopping: running tasks stop after their current step (again to stop at once)"
            )
            try:
                return await run_worker(
                    cli,
                    config,
                    chat_model,
                    WorkerConfig(max_in_flight=max_in_flight),
                    stop,
                    exit_when_idle,
                    metrics_port,
                )
            finally:
                await chat_model.close()

        try:
            finished = asyncio.run(main())
        except asyncio.CancelledError:
            err_console.print("worker stopped at once; its tasks resume from their journals", highlight=False)
            raise typer.Exit(130) from None
    err_console.print(f"worker stopped after finishing {finished} task(s)", highlight=False)


if __name__ == "__main__":
    app = typer.Typer(add_completion=False)
    app.command()(worker_command)
    with contextlib.suppress(KeyboardInterrupt):
        app()
