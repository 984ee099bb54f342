"""A command group whose subcommands are imported when they are used, not when `tether` starts.

`tether --help` and a shell completion of the first word read only the names and one-line summaries
of the table below the root; `tether sandbox run` imports `tether.cli.sandbox` and nothing else. The
group does not make a subcommand's own module cheap to import: that module keeps its heavy imports
inside the functions that need them.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

import typer
import typer.main
from typer import _click as click  # typer vendors click: these are the classes its commands are built on
from typer._click.shell_completion import CompletionItem
from typer.core import TyperGroup, TyperOption

LIST_NAME, LIST_ALIAS = "list", "ls"


@dataclass(frozen=True, slots=True)
class LazyCommand:
    """`target` names a `typer.Typer` or a command function as `module:attribute`; `summary` is the
    line `tether --help` shows for it (a test checks it against the command's own help)."""

    target: str
    summary: str

    def load(self, name: str) -> click.Command:
        module, attribute = self.target.split(":")
        obj = getattr(importlib.import_module(module), attribute)
        holder = typer.Typer(rich_markup_mode=None)
        if isinstance(obj, typer.Typer):
            holder.add_typer(obj, name=name)
        else:
            holder.command(name)(obj)
        return with_list_alias(typer.main.get_group(holder).commands[name])


def with_list_alias(command: click.Command) -> click.Command:
    """Every listing command is called `list` and answers to `ls` as well (hidden), in every group."""
    commands = getattr(command, "commands", None)
    if not isinstance(commands, dict):
        return command
    renamed: dict[str, click.Command] = {}
    for name, sub in commands.items():
        sub = with_list_alias(sub)
        if name == LIST_ALIAS and LIST_NAME not in commands:
            name = LIST_NAME
        renamed[name] = sub
    if LIST_NAME in renamed and LIST_ALIAS not in renamed:
        alias = copy.copy(renamed[LIST_NAME])
        alias.hidden = True
        renamed[LIST_ALIAS] = alias
    command.commands = renamed  # type: ignore[attr-defined]
    return command


class LazyCommands(MutableMapping[str, click.Command]):
    """The subcommands of a group: those built already, then the lazy ones, imported on first lookup."""

    def __init__(self, built: Mapping[str, click.Command], lazy: Mapping[str, LazyCommand]) -> None:
        self._built = dict(built)
        self._lazy = dict(lazy)

    def summaries(self, prefix: str = "") -> list[tuple[str, str]]:
        """(name, one line) of every visible subcommand starting with `prefix`, importing none."""
        rows = []
        for name in self:
            if not name.startswith(prefix):
                continue
            if name in self._lazy:
                rows.append((name, self._lazy[name].summary))
            elif not self._built[name].hidden:
                rows.append((name, self._built[name].get_short_help_str()))
        return rows

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._built:
            self._built[name] = self._lazy[name].load(name)
        return self._built[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        self._built.pop(name, None)
        self._lazy.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        yield from self._lazy
        yield from (name for name in self._built if name not in self._lazy)

    def __len__(self) -> int:
        return len(self._lazy.keys() | self._built.keys())


class _AbsentOption(TyperOption):
    """An option left out passes None on as it is: typer would coerce that None with a pydantic
    validator, and importing pydantic alone costs a shell completion, which parses the options of the
    groups on the command line (`--help` and the completion flags among them), its whole budget."""

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        if value is not None or self.required:
            return super().process_value(ctx, value)
        return None if self.callback is None else self.callback(ctx, self, None)


class LazyGroup(TyperGroup):
    """Subclass it with `lazy` set to the table of subcommands; pass it as `typer.Typer(cls=...)`."""

    lazy: ClassVar[Mapping[str, LazyCommand]] = {}

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = LazyCommands(self.commands, self.lazy)

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)  # the help option is made here, per context
        for param in params:
            if type(param) is TyperOption:
                param.__class__ = _AbsentOption
        return params

    def _summaries(self, prefix: str = "") -> list[tuple[str, str]]:
        assert isinstance(self.commands, LazyCommands)
        return self.commands.summaries(prefix)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = self._summaries()
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        items = [CompletionItem(name, help=summary) for name, summary in self._summaries(incomplete)]
        return items + click.Command.shell_complete(self, ctx, incomplete)
