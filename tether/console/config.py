"""Where the console reads from: the locations the CLI's commands take, decided once by `tether console`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from tether.agents.service import AgentsConfig
from tether.gateway.config import GatewayConfig


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the console on this machine (`localhost` and 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    # Directories whose subdirectories are runs (`tether train`/`tether demo` output: metrics.jsonl, ...).
    runs: tuple[Path, ...] = (Path("runs"),)
    agents: AgentsConfig | None = None
    # The gateway's keys and ledger (its `ledger_url`); None: the usage and keys pages say it is not set.
    gateway: GatewayConfig | None = None
    jobs_db: Path | None = None
    # `tether sandbox serve` instances whose `/metrics` the sandboxes page reads.
    sandbox_urls: tuple[str, ...] = ()
    # OpenAI-compatible servers (tether serve, the gateway, vLLM, ...) the chat playground can talk to.
    model_urls: tuple[str, ...] = ()
    # An API key the playground sends to those servers (a gateway key), if they need one.
    model_api_key: str | None = None
    host: str = "127.0.0.1"
    # How often live views look for new records (run metrics, task steps).
    poll_s: float = 0.5
    # Sign-in: where admin tokens are checked; required when `host` is not loopback.
    require_admin: bool = field(default=False)

    def __post_init__(self) -> None:
        if not is_loopback(self.host) and not self.require_admin:
            object.__setattr__(self, "require_admin", True)
