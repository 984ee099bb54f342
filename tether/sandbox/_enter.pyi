def enter(plan_fd: int, fds: tuple[int, ...], seccomp_bpf: bytes, /) -> tuple[str, list[str]]:
    """Isolate this freshly forked process as a run; execs (never returns) or returns (script, env)."""
