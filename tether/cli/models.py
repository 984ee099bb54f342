"""`tether models ...`: pull a registered model into the local cache and list what is cached."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import CacheDirOption, cache_root, err_console, print_json, user_errors
from tether.models.cache import list_cached, pull
from tether.models.registry import KNOWN_MODELS

app = typer.Typer(help="Models: pull registered models into the cache, list them.", no_args_is_help=True)
console = Console()


@app.command("pull")
def pull_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(sorted(KNOWN_MODELS))}.")],
    cache_dir: CacheDirOption = None,
) -> None:
    """Install and convert a registered model once; print the folder it lives in."""
    root = cache_root(ctx, cache_dir)
    from tether.models.threads import configure_threads  # torch: loaded only to convert

    configure_threads()
    started = time.monotonic()
    with user_errors(), err_console.status(f"pulling {name}") as status:
        folder = pull(name, root, progress=lambda message: status.update(f"{name}: {message}"))
    err_console.print(f"{name} ready in {time.monotonic() - started:.1f} s", highlight=False)
    console.print(str(folder), highlight=False, soft_wrap=True)


@app.command("list")
def list_command(
    ctx: typer.Context,
    cache_dir: CacheDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON array instead of a table.")] = False,
) -> None:
    """Models in the cache, with their source and size."""
    cached = list_cached(cache_root(ctx, cache_dir))
    if as_json:
        rows: list[dict[str, Any]] = [
            {"name": m.name, "path": str(m.path), "size_bytes": m.size_bytes, **m.manifest} for m in cached
        ]
        print_json(rows)
        return
    table = Table(title="cached models")
    table.add_column("name", no_wrap=True)
    for column in ("architecture", "source", "size"):
        table.add_column(column)
    table.add_column("path", overflow="fold")
    for m in cached:
        source = m.manifest.get("source", {})
        table.add_row(
            m.name,
            str(m.manifest.get("architecture", "?")),
            f"{source.get('package', '?')} {source.get('version', '')}".strip(),
            f"{m.size_bytes / 2**20:.0f} MiB",
            str(m.path),
        )
    console.print(table)
