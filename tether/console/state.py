"""`Console`: what every page's router is built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.templating import Jinja2Templates

from tether.console.config import ConsoleConfig


@dataclass
class Console:
    """The settings, the templates, and the closers of the stores the pages opened (run, last opened first,
    when the app stops; a closer may be a coroutine function)."""

    config: ConsoleConfig
    jinja: Jinja2Templates
    closers: list[Callable[[], object]] = field(default_factory=list)

    def on_close(self, closer: Callable[[], object]) -> None:
        self.closers.append(closer)
