"""`open_sandbox`: the configured `Sandbox`, a local pool or a fleet client, unstarted.

The one place the choice is made, so callers (scoring, tools, agent workers) never see which: a
`FleetConfig` means the fleet, and then no worker starts in this process (it needs no privileges).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tether.sandbox.fleet import FleetConfig
    from tether.sandbox.interface import Sandbox
    from tether.sandbox.launch import Launch
    from tether.sandbox.pool_config import PoolConfig
    from tether.sandbox.spec import SandboxSpec


def open_sandbox(
    spec: SandboxSpec | None = None,
    pool: PoolConfig | None = None,
    fleet: FleetConfig | None = None,
    launches: Sequence[Launch] = (),
) -> Sandbox:
    """A `SandboxFleet` when `fleet` is given, else a `SandboxPool` with `pool` (and the worker processes
    `launches` started for it ahead); start it (or enter it)."""
    if fleet is not None:
        from tether.sandbox.fleet import SandboxFleet

        return SandboxFleet(spec, fleet)
    from tether.sandbox.pool import SandboxPool

    return SandboxPool(spec, pool, launches=launches)
