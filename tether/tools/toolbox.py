"""`Toolbox`: the tools one episode or one agent role may call, by name, and the one place a model's call is
checked before it runs (a block the parser could not read, an unknown tool, arguments that do not fit
the schema).

Checking is separate from running so that a durable runner can journal that a call is about to run
between the two; an environment simply does both (`call`). The toolbox never raises for the model's
mistakes: each becomes an error `ToolResult` the model reads on its next turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tether.chat import JsonDict, ToolCall, ToolResult, ToolSpec
from tether.chat.tool_format import MALFORMED_TOOL, malformed_result
from tether.tools.tool import Tool, ToolError, refusal
from tether.tools.workspace import Workspace


class Toolbox:
    def __init__(self, tools: Iterable[Tool]) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"tool names must be unique; {tool.name!r} is given twice")
            self._tools[tool.name] = tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(tool.spec for tool in self._tools.values())

    def only(self, names: Iterable[str]) -> Toolbox:
        """The tools among `names` that this toolbox has, in the order given."""
        return Toolbox(self._tools[name] for name in names if name in self._tools)

    def check(self, call: ToolCall) -> tuple[Tool, JsonDict]:
        """The tool a call names and its checked arguments; ToolError (for the model) when either is wrong,
        or when the call is a block the tool-call parser could not read (`MALFORMED_TOOL`)."""
        if call.name == MALFORMED_TOOL:
            raise ToolError(malformed_result(call).content)
        tool = self._tools.get(call.name)
        if tool is None:
            available = ", ".join(self._tools) or "none"
            raise ToolError(f"unknown tool {call.name!r}; available: {available}")
        return tool, tool.parse_arguments(call)

    async def call(self, workspace: Workspace, call: ToolCall, key: str = "") -> tuple[ToolResult, bool]:
        """Check and run one call; returns its result and whether it ended the episode."""
        try:
            tool, arguments = self.check(call)
        except ToolError as error:
            return refusal(call, str(error)), False
        result = await tool.run(workspace, call, arguments, key or call.id)
        return result, tool.ends and not result.error
