"""A request past its limits (`Admitted`): what the gateway's handling and its stream relay settle when the
request ends, and whether it was reserved durably and settled already. Plain data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from tether.gateway.keys import ApiKey
from tether.gateway.limits import Counter
from tether.gateway.plan import RequestPlan


@dataclass(slots=True)
class Admitted:
    """A request past its limits: what to settle when it ends."""

    id: str
    key: ApiKey
    plan: RequestPlan
    counters: list[Counter]
    arrived_s: float
    settled: bool = False
    reserved_durably: bool = False
    first_token_s: float | None = None
    """A stream's time from arrival to its first chunk, once it came."""
