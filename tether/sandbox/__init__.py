"""Isolated, high-concurrency execution of untrusted code: namespaces, cgroups, seccomp, warm pools,
in this process (`SandboxPool`) or on a fleet of `tether sandbox serve` instances (`SandboxFleet`), both
behind one interface (`Sandbox`, `Session`) chosen by `open_sandbox`.

The public names are loaded on first use: the sandbox worker imports modules of this package inside
its namespaces and must not pay for (or carry into every forked run) the host-side dependencies.
"""

from __future__ import annotations

import importlib

# Not `typing.TYPE_CHECKING`: every sandbox worker imports this package, and `typing` is the largest
# part of its start-up imports; mypy treats any name TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from tether.sandbox.factory import open_sandbox
    from tether.sandbox.fleet import FleetBusy, FleetConfig, FleetUnavailable, SandboxFleet
    from tether.sandbox.interface import Sandbox, Session, SessionLost
    from tether.sandbox.pool import NoFreeSlot, SandboxPool, SandboxUnavailable
    from tether.sandbox.pool_config import PoolConfig
    from tether.sandbox.result import QcStatus, RunResult, RunStatus
    from tether.sandbox.spec import SandboxSpec, load_spec

_EXPORTS = {
    "open_sandbox": "tether.sandbox.factory",
    "FleetBusy": "tether.sandbox.fleet",
    "FleetConfig": "tether.sandbox.fleet",
    "FleetUnavailable": "tether.sandbox.fleet",
    "SandboxFleet": "tether.sandbox.fleet",
    "Sandbox": "tether.sandbox.interface",
    "Session": "tether.sandbox.interface",
    "SessionLost": "tether.sandbox.interface",
    "NoFreeSlot": "tether.sandbox.pool",
    "PoolConfig": "tether.sandbox.pool_config",
    "SandboxPool": "tether.sandbox.pool",
    "SandboxUnavailable": "tether.sandbox.pool",
    "QcStatus": "tether.sandbox.result",
    "RunResult": "tether.sandbox.result",
    "RunStatus": "tether.sandbox.result",
    "SandboxSpec": "tether.sandbox.spec",
    "load_spec": "tether.sandbox.spec",
}

__all__ = [
    "FleetBusy",
    "FleetConfig",
    "FleetUnavailable",
    "NoFreeSlot",
    "PoolConfig",
    "QcStatus",
    "RunResult",
    "RunStatus",
    "Sandbox",
    "SandboxFleet",
    "SandboxPool",
    "SandboxSpec",
    "SandboxUnavailable",
    "Session",
    "SessionLost",
    "load_spec",
    "open_sandbox",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tether.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
