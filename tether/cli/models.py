"""`tether models ...`: pull a registered model into the local cache, list what is cached, and name the
kernels this CPU runs them with."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import CacheDirOption, cache_root, err_console, print_json, user_errors
from tether.models.cache import list_cached, pull
from tether.models.registry import KNOWN_MODELS

app = typer.Typer(
    help="Models: pull registered models into the cache, list them, check this CPU's kernels.",
    no_args_is_help=True,
)
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


@app.command("doctor")
def doctor_command(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of tables.")] = False,
) -> None:
    """The kernel each dtype's projections and decode attention take on this CPU, and the CPU features
    (present or missing) that decide it; a missing one means a slower fallback, never a failure."""
    import torch

    from tether.kernels.attention import attention_kernel
    from tether.kernels.cpu import USES, cpu_model, detected
    from tether.kernels.int8_gemm import int8_kernel
    from tether.kernels.w8a8_gemm import w8a8_kernel
    from tether.models.prepack import projection_kernel

    features = detected()
    head_dim = 64  # every registered model's; a head_dim that is not a multiple of 8 takes the portable path
    kernels = {
        str(dtype).removeprefix("torch."): (
            projection_kernel(features, dtype).value,
            attention_kernel(features, dtype, head_dim).value,
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
    # int8 weights (`quantization = "int8"`) compute in float32: float32's attention, the int8 kernel's path
    kernels["int8"] = (f"int8 weight kernel, {int8_kernel(features).name}", kernels["float32"][1])
    kernels["w8a8"] = (f"dynamic int8 kernel, {w8a8_kernel(features).name}", kernels["float32"][1])
    if as_json:
        print_json(
            {
                "cpu": cpu_model(),
                "features": {feature.value: feature in features for feature in USES},
                "kernels": {
                    dtype: {"projections": projections, "decode_attention": attention}
                    for dtype, (projections, attention) in kernels.items()
                },
            }
        )
        return
    table = Table(title=f"CPU features ({cpu_model()})")
    for column in ("feature", "present", "used for"):
        table.add_column(column)
    for feature, use in USES.items():
        table.add_row(feature.value, "yes" if feature in features else "no", use)
    console.print(table)
    paths = Table(title="kernel paths on this CPU")
    for column in ("dtype", "projections", f"decode attention (head_dim {head_dim})"):
        paths.add_column(column, no_wrap=True)
    for dtype, (projections, attention) in kernels.items():
        paths.add_row(dtype, projections, attention)
    console.print(paths)
