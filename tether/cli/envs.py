"""`tether envs ...`: list the registered environments, show sample tasks, score one answer."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.chat import Messages
from tether.cli.common import print_json, sandbox_provider, state, user_errors
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import Environment, run_episode, scripted_policy
from tether.envs.errors import EnvError
from tether.envs.registry import EnvRegistry, default_registry
from tether.envs.score_bench import bench_command
from tether.envs.scoring import Score
from tether.envs.tasks import Task

app = typer.Typer(help="Verifiable environments: list, inspect, score.", no_args_is_help=True)
console = Console()
app.command("bench")(bench_command)  # scoring throughput of code answers (tether/envs/score_bench.py)
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", help="A train config: also its run's environments ([envs.verifiers] as vf/NAME, agent/*)."
    ),
]


def _registry(config: Path | None = None) -> EnvRegistry:
    if config is None:
        return default_registry()
    from tether.rl.builders import training_registry  # the run's registry, exactly as training builds it
    from tether.rl.config import load_config

    return training_registry(load_config(config))


@app.command("list")
def list_command(
    pattern: Annotated[
        str | None, typer.Argument(help="Only names matching this glob (e.g. 'rg/*').")
    ] = None,
    as_json: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Every registered environment: name, family, turns and reward components."""
    with user_errors():
        registry = _registry(config)
        infos = [registry.info(name) for name in registry.names(pattern)]
        if pattern is not None and not infos:
            close = registry.close_names(pattern)
            hint = (
                f"did you mean {', '.join(close)}?"
                if close
                else f"families: {', '.join(registry.families())}"
            )
            raise EnvError(f"pattern {pattern!r} matches no environment; {hint}")
    families = sorted({info.family for info in infos})
    if as_json:
        print_json(
            {"count": len(infos), "families": len(families), "envs": [info.to_dict() for info in infos]}
        )
        return
    table = Table(title="environments")
    for column in ("name", "family", "turns", "rewards", "tools"):
        table.add_column(column)
    for info in infos:
        table.add_row(
            info.name, info.family, str(info.max_turns), ", ".join(info.rewards), ", ".join(info.tools)
        )
    console.print(table)
    console.print(f"{len(infos)} environments in {len(families)} families: {', '.join(families)}")


@app.command("show")
def show_command(
    name: Annotated[str, typer.Argument(help="Environment name, e.g. rg/basic_arithmetic.")],
    count: Annotated[int, typer.Option("-n", min=1, max=1000, help="How many tasks.")] = 3,
    seed: Annotated[
        int, typer.Option("--seed", min=0, help="Seed of the first task; the next ones follow.")
    ] = 0,
    as_json: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Sample tasks: the rendered prompt and the reference answer of seeds S, S+1, ..."""
    with user_errors():
        env = _registry(config).get(name)
        tasks = [env.task(seed + offset) for offset in range(count)]
        shown = [{**task.to_dict(), "reference_replies": env.reference(task)} for task in tasks]
    if as_json:
        print_json({"env": name, "tasks": shown})
        return
    for task in tasks:
        console.rule(f"{name} seed {task.seed}")
        for message in task.messages:
            console.print(f"[bold]{message['role']}[/]", highlight=False)
            console.print(message.get("content") or "", markup=False, highlight=False)
        if task.tools:
            console.print(f"[bold]tools[/]: {', '.join(tool['function']['name'] for tool in task.tools)}")
        console.print("[bold]reference[/]", highlight=False)
        console.print(task.reference, markup=False, highlight=False)


def read_replies(raw: str) -> Messages:
    """An answer file: plain completion text, or a JSON list of assistant messages (multi-turn)."""
    stripped = raw.strip()
    if stripped.startswith("["):
        try:
            replies = json.loads(stripped)
        except json.JSONDecodeError:
            replies = None
        if isinstance(replies, list) and replies and all(isinstance(m, dict) for m in replies):
            return [{"role": "assistant", **reply} for reply in replies]
    return [{"role": "assistant", "content": raw}]


async def _score(env: Environment, task: Task, replies: Messages, provider: SandboxProvider) -> Score:
    async with provider:
        result = await run_episode(env, task, scripted_policy(replies), ScoringContext(provider))
    return result.score


@app.command("score")
def score_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Environment name.")],
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the task.")] = 0,
    answer_file: Annotated[
        Path,
        typer.Option(
            "--answer-file",
            help="The completion text, '-' for standard input, or a JSON list of assistant messages.",
        ),
    ] = Path("-"),
    as_json: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Score one answer to one seeded task; every reward component is shown."""
    with user_errors():
        env = _registry(config).get(name)
        task = env.task(seed)
        raw = sys.stdin.read() if str(answer_file) == "-" else answer_file.read_text()
        settings = state(ctx).settings()
        provider = sandbox_provider(settings, slots=1)
        score = asyncio.run(_score(env, task, read_replies(raw), provider))
    payload: dict[str, Any] = {"env": name, "seed": seed, **score.to_dict()}
    if as_json:
        print_json(payload)
        return
    table = Table(title=f"{name} seed {seed}")
    for column in ("component", "score", "weight"):
        table.add_column(column, justify="right" if column != "component" else "left")
    for component, value in score.components.items():
        table.add_row(component, f"{value:.3f}", f"{score.weights[component]:g}")
    table.add_row("[bold]total[/]", f"[bold]{score.total:.3f}[/]", "")
    console.print(table)
    console.print(f"passed: {score.passed}   answer: {score.answer!r}", highlight=False)
    if score.qc_violation:
        console.print(f"[red]qc violation:[/] {score.qc_violation}")
