"""Built-in role personas (planner, coder, reviewer) as data, and how a `--roles` list selects them.

The orchestration lives in the journal, not in code: a role passes the task on by calling `handoff`,
the runner checks the target against the role's `hands_off_to` and gives the next step to that role,
and only the roles allowed `finish` can end the task. Budgets (`Limits`) apply to the whole team.
"""

from __future__ import annotations

from tether.agents.task import RoleSpec
from tether.errors import ConfigError, did_you_mean

PRESET_ROLES: dict[str, RoleSpec] = {
    role.name: role
    for role in (
        RoleSpec(
            name="planner",
            system_prompt=(
                "You are the planner. Read the goal and the files, then write a short numbered plan for the "
                "coder and hand off to the coder with the plan as the message. Do not write code yourself."
            ),
            tools=("shell", "read_file", "handoff"),
            hands_off_to=("coder",),
        ),
        RoleSpec(
            name="coder",
            system_prompt=(
                "You are the coder. Implement the plan in the working directory with the tools, run what you "
                "wrote, and hand off to the reviewer when it works."
            ),
            tools=("shell", "python", "write_file", "read_file", "handoff"),
            hands_off_to=("reviewer",),
        ),
        RoleSpec(
            name="reviewer",
            system_prompt=(
                "You are the reviewer. Check the coder's work by reading and running it. If it is right, "
                "call finish; otherwise hand off to the coder with what must change."
            ),
            tools=("shell", "read_file", "handoff", "finish"),
            hands_off_to=("coder",),
        ),
    )
}


def select_roles(names: str) -> tuple[RoleSpec, ...]:
    """`planner,coder,reviewer` -> those presets, hand-offs limited to the roles chosen; first one starts."""
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in PRESET_ROLES]
    if not chosen or unknown:
        hint = did_you_mean(unknown[0], PRESET_ROLES) if unknown else ""
        raise ConfigError(
            f"--roles {names!r}: unknown role(s) {unknown}{hint}; known roles: {', '.join(PRESET_ROLES)}"
        )
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"--roles {names!r}: a role is named twice")
    roles = []
    for name in chosen:
        preset = PRESET_ROLES[name]
        targets = tuple(target for target in preset.hands_off_to if target in chosen)
        tools = preset.tools
        if not targets or len(chosen) == 1:
            # The last role of a chain must be able to end the task.
            tools = tuple(tool for tool in tools if tool != "handoff") + ("finish",) * ("finish" not in tools)
        roles.append(preset.model_copy(update={"hands_off_to": targets, "tools": tools}))
    return tuple(roles)
