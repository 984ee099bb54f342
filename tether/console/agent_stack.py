"""The console's one `AgentStack` (journal, queue, artifacts), opened on first need and closed with the
app. Reading never creates a journal, as with `tether agent ls`: until a journal exists (or a task is
submitted here) the pages say where they looked instead of leaving an empty store behind."""

from __future__ import annotations

import threading

from tether.agents.families import FAMILIES
from tether.agents.roles import PRESET_ROLES
from tether.agents.service import AgentsConfig, AgentStack
from tether.console.errors import not_configured
from tether.store.database import journal_exists, sqlite_path
from tether.store.journal import Journal


class ConsoleAgents:
    role_names = tuple(PRESET_ROLES)
    family_names = tuple(FAMILIES)

    def __init__(self, config: AgentsConfig | None, poll_s: float = 0.5) -> None:
        self.config = config
        self.poll_s = poll_s
        self._stack: AgentStack | None = None
        self._opening = threading.Lock()  # reads run in the thread pool: open the stack once

    def _config(self) -> AgentsConfig:
        if self.config is None:
            raise not_configured("the agent journal", "--home or --store")
        return self.config

    def reading(self) -> Journal | None:
        """The journal to read, or None where none was ever created."""
        if self._stack is None and not journal_exists(self._config().store_url):
            return None
        return self.writing().journal

    def writing(self) -> AgentStack:
        """The stack, opened (and its journal created) if it is not yet: an action is about to write."""
        with self._opening:
            if self._stack is None:
                self._stack = AgentStack(self._config())
            return self._stack

    def missing(self) -> str | None:
        """Where the journal would be, when there is none yet."""
        if self.config is None or self._stack is not None or journal_exists(self.config.store_url):
            return None
        return f"no journal at {sqlite_path(self.config.store_url)} yet (no task was submitted there)"

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.close()
            self._stack = None
