"""What every command shares: the loaded settings, error reporting and JSON output.

Every command module imports this one, so it imports nothing beyond typer and rich at the top: the
settings, the errors and the sandbox are imported by the functions that use them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress

    from tether.config import TetherSettings
    from tether.envs.context import SandboxProvider
    from tether.sandbox.fleet import FleetConfig
    from tether.sandbox.interface import Sandbox
    from tether.sandbox.pool_config import PoolConfig

err_console = Console(stderr=True)


@dataclass(slots=True)
class CliState:
    config_file: Path | None = None
    warned: set[str] = field(default_factory=set)

    def settings(self, flags: dict[str, Any] | None = None) -> TetherSettings:
        from tether.config import load_settings

        return load_settings(self.config_file, flags=flags, warn=self._warn)

    def _warn(self, message: str) -> None:
        if message not in self.warned:  # settings are loaded more than once by some commands
            self.warned.add(message)
            err_console.print(f"[bold yellow]warning:[/] {message}", highlight=False, markup=True)


def state(ctx: typer.Context) -> CliState:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, CliState) else CliState()


def fail(message: str, code: int = 2) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


CacheDirOption = Annotated[
    Path | None, typer.Option("--cache-dir", help="Model cache root (default: settings' cache_dir).")
]


# tether's own engine (serve, eval, the agents'): spelt as `[model] device` / `dtype` of `tether train`,
# checked by `tether.models.precision` in the command, before any model loads.
DeviceOption = Annotated[
    str, typer.Option("--device", help="Where the engine runs: auto (CUDA where present), cpu, cuda, cuda:N.")
]
DTypeOption = Annotated[
    str, typer.Option("--dtype", help="The engine's weights and KV cache: float32, bfloat16 or float16.")
]
KvCacheMibOption = Annotated[
    int, typer.Option("--kv-cache-mib", help="Memory for the KV cache, in MiB.", min=1)
]
MaxModelLenOption = Annotated[
    int | None,
    typer.Option(
        "--max-model-len",
        min=1,
        help="Longest sequence (prompt and output) the engine holds, in tokens, checked against the "
        "model's context (with --rope-scaling) and --kv-cache-mib. Default: the least of the model's "
        "context, 4096 and what the KV cache holds.",
    ),
]
RopeScalingOption = Annotated[
    str | None,
    typer.Option(
        "--rope-scaling",
        help="Run the model with this rope scaling instead of its config's, to extend its context: "
        "TYPE:FACTOR (yarn:4, linear:2, dynamic:2) or a JSON object as in a config.json.",
    ),
]


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn errors a user can cause into one clear message and a non-zero exit."""
    from tether.errors import TetherError
    from tether.sandbox.pool import SandboxUnavailable

    try:
        yield
    except (TetherError, SandboxUnavailable, FileNotFoundError) as error:
        fail(str(error))


@contextmanager
def phases(echo: bool = False) -> Iterator[Callable[[str], None]]:
    """A stderr spinner naming the phase a long command is in, with the time since it started; yields
    the function that moves it to the next phase (`echo` also prints each phase as a line of history)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console
    )
    with progress:
        task = progress.add_task("starting", total=None)

        def report(message: str) -> None:
            if echo:
                progress.console.print(message, highlight=False)
            progress.update(task, description=message)

        yield report


def counted_progress() -> Progress:
    """A transient stderr progress bar for a known number of items (runs, episodes)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


@contextmanager
def counted_lines(description: str, total: int) -> Iterator[Callable[[str], None]]:
    """Progress over `total` items, advanced as each one finishes: on a terminal `counted_progress`'s
    bar, otherwise one plain stderr line per item (`description done/total: detail`), which a log
    shows as it happens. Yields the function that reports an item done, with its detail."""
    if err_console.is_terminal:
        with counted_progress() as progress:
            task = progress.add_task(description, total=total)
            yield lambda _detail: progress.advance(task)
        return
    done = 0

    def line(detail: str) -> None:
        nonlocal done
        done += 1
        err_console.print(f"{description} {done}/{total}: {detail}", highlight=False, soft_wrap=True)

    yield line


def cache_root(ctx: typer.Context, override: Path | None) -> Path:
    """The model cache root: `--cache-dir` when given, else the settings' cache_dir."""
    with user_errors():
        return override or state(ctx).settings().cache_dir


def print_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload, indent=None, default=str) + "\n")


def pool_config(settings: TetherSettings, slots: int | None = None, insecure: bool = False) -> PoolConfig:
    from tether.sandbox.pool_config import PoolConfig

    sandbox = settings.sandbox
    return PoolConfig(
        slots=slots or sandbox.slots,
        host_uid_base=sandbox.host_uid_base,
        insecure=insecure or sandbox.insecure,
        session_idle_timeout_s=sandbox.session_idle_timeout_s,
    )


def fleet_config(settings: TetherSettings) -> FleetConfig | None:
    """The fleet `[sandbox] fleet` or `discovery` names; None when runs stay in this process."""
    sandbox = settings.sandbox
    if not sandbox.remote:
        return None
    # Only here: the fleet client's imports (httpx) cost a local run's command a tenth of a second.
    from tether.sandbox.fleet import FleetConfig

    return FleetConfig(endpoints=tuple(sandbox.fleet), discovery=sandbox.discovery)


def open_sandbox(settings: TetherSettings, slots: int | None = None) -> Sandbox:
    """The configured sandbox, unstarted: the fleet, or a local pool of `slots` (default: settings')."""
    from tether.sandbox.factory import open_sandbox as open_configured

    return open_configured(settings.sandbox.spec, pool_config(settings, slots=slots), fleet_config(settings))


def sandbox_provider(settings: TetherSettings, slots: int | None = None) -> SandboxProvider:
    """Scoring's lazily started sandbox, as `[sandbox]` configures it (see `open_sandbox`)."""
    from tether.envs.context import SandboxProvider

    fleet = fleet_config(settings)
    return SandboxProvider(settings.sandbox.spec, pool_config(settings, slots=slots), fleet=fleet)
