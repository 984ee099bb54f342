"""The plan of one run step, as the zygote hands it to the fork server (a memfd read by the child).

The format is `_enter.c`'s: NUL-terminated fields, parsed in C after the fork, so the fork server never
holds a run's data and the child runs no Python before it is isolated.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ChildPlan:
    run_dir: str  # the run's tmpfs under STAGING, holding work/, tmp/, shm/ and meta/
    workdir: str
    argv: list[str]
    inline_python: str | None
    env: dict[str, str]
    uid: int
    gid: int
    cgroup_fds: list[int]
    stdout_fd: int
    stderr_fd: int
    status_fd: int
    cpu_time_limit_s: int
    open_files_max: int
    file_size_max_bytes: int
    # (source, target) binds made after the workdir, /tmp and /dev/shm, in order: the run's /mnt and
    # program directory from its run directory, then the read-only paths those mounts cover (aliases).
    shadows: list[tuple[str, str]] = field(default_factory=list)


def encode_plan(plan: ChildPlan) -> tuple[bytes, list[int]]:
    """The plan in `_enter.c`'s format (NUL-terminated fields), and the descriptors that travel beside it."""
    fields = [
        plan.run_dir,
        plan.workdir,
        str(plan.uid),
        str(plan.gid),
        str(plan.cpu_time_limit_s),
        str(plan.open_files_max),
        str(plan.file_size_max_bytes),
        "python" if plan.inline_python is not None else "exec",
        str(len(plan.argv)),
        *plan.argv,
        str(len(plan.env)),
        *(f"{key}={value}" for key, value in plan.env.items()),
        str(2 * len(plan.shadows)),
        *(path for pair in plan.shadows for path in pair),
    ]
    if plan.inline_python is not None:
        fields.append(plan.inline_python)
    if any("\0" in item for item in fields):
        raise ValueError("a run's arguments, environment and paths cannot contain NUL characters")
    data = b"".join(item.encode() + b"\0" for item in fields)
    return data, [plan.stdout_fd, plan.stderr_fd, plan.status_fd, *plan.cgroup_fds]
