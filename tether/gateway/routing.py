"""Which replica of a pool serves a request: a pure core over plain state (health, requests in flight),
with no I/O and no clock; `replicas.py` sends, checks health and feeds the results back here.

`Routing.PREFIX` is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018): each
replica owns `virtual_nodes` points of a 64-bit ring, and a request's prefix key goes to the first replica
clockwise from it that is healthy and runs fewer than ceil(c * (requests in flight + 1) / healthy
replicas). A key keeps its owner while replicas come and go (only the keys of a replica that left move),
so the owner's KV cache holds the key's prefix; a key whose owner is full spills to the next replica on
the ring, the same one each time, so a hot prefix's overflow also lands on a warm cache. A request
without a key goes to the least-loaded replica. No replica ever runs more than the bound.

A retry (`tried` not empty) goes by the same rule among the replicas not yet tried. When no replica is
healthy the request is still tried on the least-loaded one: a health check may be wrong, a refusal is not.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum

from tether.gateway.config import Routing


class Health(Enum):
    UP = "up"
    DOWN = "down"


class RoutedBy(StrEnum):
    """Why a request went where it went (a metric label)."""

    PREFIX = "prefix"
    """Its key's owner on the ring."""
    SPILL = "spill"
    """The next replica on the ring: the owner was full or down."""
    LEAST_LOADED = "least_loaded"
    """No key (or the policy), or no healthy replica left."""
    ROUND_ROBIN = "round_robin"
    FAILOVER = "failover"
    """A retry after the replica tried before failed."""


@dataclass(slots=True)
class Replica:
    index: int
    url: str
    in_flight: int = 0
    health: Health = Health.UP
    failures: int = 0
    """Consecutive failed checks or connections."""


@dataclass(frozen=True, slots=True)
class Choice:
    replica: Replica
    routed_by: RoutedBy


def ring_point(data: bytes) -> int:
    """A key's or a virtual node's place on the ring: its first 8 bytes of blake2b."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Router:
    """One pool's replicas and the policy choosing among them."""

    def __init__(
        self,
        urls: Sequence[str],
        policy: Routing = Routing.PREFIX,
        load_factor: float = 2.0,
        virtual_nodes: int = 64,
        unhealthy_after: int = 2,
    ) -> None:
        assert urls and load_factor >= 1 and virtual_nodes >= 1 and unhealthy_after >= 1
        assert len(set(urls)) == len(urls), "each replica once"
        self.replicas = [Replica(i, url) for i, url in enumerate(urls)]
        self.policy = policy
        self.load_factor = load_factor
        self.unhealthy_after = unhealthy_after
        points = sorted(
            (ring_point(f"{replica.url}#{v}".encode()), replica.index)
            for replica in self.replicas
            for v in range(virtual_nodes)
        )
        self._points = [point for point, _ in points]
        self._owners = [index for _, index in points]
        self._turn = 0

    # choosing

    def choose(self, key: bytes | None, tried: frozenset[int] = frozenset()) -> Choice | None:
        """The replica for a request with prefix `key` (None: no key), never one in `tried`; None when
        every replica was tried."""
        candidates = [r for r in self.replicas if r.index not in tried]
        if not candidates:
            return None
        healthy = [r for r in candidates if r.health is Health.UP]
        if not healthy:
            return Choice(self._least_loaded(candidates), RoutedBy.LEAST_LOADED)
        choice = self._by_policy(key, healthy)
        return Choice(choice.replica, RoutedBy.FAILOVER) if tried else choice

    def bound(self) -> int:
        """The most requests a replica may run when one more arrives: ceil(c * average load)."""
        up = [r for r in self.replicas if r.health is Health.UP] or self.replicas
        load = sum(r.in_flight for r in up) + 1
        # the epsilon keeps c * average from rounding up past a whole number (1.25 * 4 / 5 = 1.0000000002)
        return max(1, math.ceil(self.load_factor * load / len(up) - 1e-9))

    def _by_policy(self, key: bytes | None, healthy: list[Replica]) -> Choice:
        if self.policy is Routing.ROUND_ROBIN:
            replica = healthy[self._turn % len(healthy)]
            self._turn += 1
            return Choice(replica, RoutedBy.ROUND_ROBIN)
        if self.policy is Routing.PREFIX and key is not None:
            walked = self._walk(key, {r.index for r in healthy}, self.bound())
            if walked is not None:
                return walked
        return Choice(self._least_loaded(healthy), RoutedBy.LEAST_LOADED)

    def _walk(self, key: bytes, allowed: set[int], bound: int) -> Choice | None:
        """The first replica clockwise from `key` among `allowed` running fewer than `bound` requests."""
        start = bisect.bisect_left(self._points, ring_point(key))
        seen: set[int] = set()
        owner = True  # the first replica met is the key's owner, whether it can take the request or not
        for step in range(len(self._points)):
            index = self._owners[(start + step) % len(self._points)]
            if index in seen:
                continue
            seen.add(index)
            replica = self.replicas[index]
            if index in allowed and replica.in_flight < bound:
                return Choice(replica, RoutedBy.PREFIX if owner else RoutedBy.SPILL)
            owner = False
            if len(seen) == len(self.replicas):
                break
        return None

    def _least_loaded(self, replicas: list[Replica]) -> Replica:
        """Fewest in flight; ties taken in turn, so that an idle pool still spreads its requests."""
        self._turn += 1
        offset = self._turn % len(replicas)
        rotated = replicas[offset:] + replicas[:offset]
        return min(rotated, key=lambda r: r.in_flight)

    # applying what happened

    def started(self, replica: Replica) -> None:
        replica.in_flight += 1

    def finished(self, replica: Replica) -> None:
        replica.in_flight -= 1
        assert replica.in_flight >= 0

    def failed(self, replica: Replica) -> bool:
        """A failed check or connection; True when it took the replica out."""
        replica.failures += 1
        if replica.health is Health.UP and replica.failures >= self.unhealthy_after:
            replica.health = Health.DOWN
            return True
        return False

    def succeeded(self, replica: Replica) -> bool:
        """A passed check or an answered request; True when it brought the replica back."""
        replica.failures = 0
        if replica.health is Health.DOWN:
            replica.health = Health.UP
            return True
        return False
