"""Which sandbox instance takes the next run or session: least-loaded dispatch over a fleet. Pure.

No I/O and no clock of its own (`clock` is passed in). Each instance's load is estimated as what it
last reported on `GET /v1/load` (slots held and runs queued, by every client) minus what this client
had in flight at that moment, plus what this client has in flight now: a report seconds old still
counts this client's own runs exactly. The pick is the instance with the smallest estimated share of
its slots in use (an instance that never reported counts its in-flight runs only); ties rotate.

An instance is out of the rotation while it is *down* (a connection failure, timeout or 5xx: for
`cooldown_s`, or until a load report shows it answering) or *backing off* (it answered 503 + Retry-After:
full, not broken). When every instance that is up is full or backing off the verdict is FULL: the
caller waits for capacity instead of piling runs onto a server's queue. When every instance is down,
the one recovering first is tried anyway, so a fleet that is coming back is found at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class Load:
    """An instance's `GET /v1/load`: slots, slots held (runs and sessions), runs waiting, idle workers."""

    slots: int
    busy: int
    queue_depth: int
    open_sessions: int = 0
    warm: int = 0
    max_queued: int | None = None


@dataclass(slots=True, eq=False)  # compared by identity: each is one live instance's state
class Instance:
    url: str
    in_flight: int = 0  # this client's runs and open sessions on it now
    load: Load | None = None
    in_flight_at_report: int = 0
    down_until: float = 0.0
    busy_until: float = 0.0
    failures: int = 0

    def estimate(self) -> int:
        """Slots in use and runs queued on the instance, by every client, as best known now."""
        if self.load is None:
            return self.in_flight
        others = max(self.load.busy + self.load.queue_depth - self.in_flight_at_report, 0)
        return others + self.in_flight

    def has_room(self) -> bool:
        return self.load is None or self.estimate() < self.load.slots

    def share(self) -> float:
        return float(self.in_flight) if self.load is None else self.estimate() / self.load.slots


class Verdict(StrEnum):
    PICKED = "picked"
    FULL = "full"  # every instance that is up is at capacity or backing off: wait, then choose again
    EXHAUSTED = "exhausted"  # every instance was tried for this request


@dataclass(frozen=True, slots=True)
class Choice:
    verdict: Verdict
    instance: Instance | None = None
    wait_s: float | None = None  # FULL: the soonest a backing-off instance takes work again, if any


class Balancer:
    def __init__(self, urls: Sequence[str], cooldown_s: float, clock: Callable[[], float]) -> None:
        self.instances = [Instance(url) for url in dict.fromkeys(urls)]
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._next = 0

    def find(self, url: str) -> Instance | None:
        return next((i for i in self.instances if i.url == url), None)

    def set_members(self, urls: Iterable[str]) -> None:
        """The fleet as discovery sees it now: new instances join, missing ones leave the rotation
        (a session already open on one keeps its `Instance` and ends there)."""
        wanted = list(dict.fromkeys(urls))
        known = {i.url: i for i in self.instances}
        self.instances = [known.get(url) or Instance(url) for url in wanted]
        self._next %= max(len(self.instances), 1)

    def up(self, instance: Instance) -> bool:
        return instance.down_until <= self._clock()

    def choose(self, tried: set[str]) -> Choice:
        untried = [i for i in self.instances if i.url not in tried]
        if not untried:
            return Choice(Verdict.EXHAUSTED)
        now = self._clock()
        up = [i for i in untried if i.down_until <= now]
        if not up:
            return Choice(Verdict.PICKED, self._rotate([min(untried, key=lambda i: i.down_until)]))
        open_ = [i for i in up if i.busy_until <= now and i.has_room()]
        if not open_:
            backing_off = [i.busy_until - now for i in up if i.busy_until > now]
            return Choice(Verdict.FULL, wait_s=min(backing_off) if backing_off else None)
        least = min(i.share() for i in open_)
        return Choice(Verdict.PICKED, self._rotate([i for i in open_ if i.share() == least]))

    def _rotate(self, candidates: list[Instance]) -> Instance:
        """The first candidate at or after the rotation point, which then moves past it."""
        count = len(self.instances)
        for offset in range(count):
            index = (self._next + offset) % count
            if self.instances[index] in candidates:
                self._next = index + 1
                return self.instances[index]
        raise AssertionError("unreachable: every candidate is an instance of the fleet")

    # ---- what happened ---------------------------------------------------------------------------------

    def begin(self, instance: Instance) -> None:
        instance.in_flight += 1

    def end(self, instance: Instance) -> None:
        assert instance.in_flight > 0, f"{instance.url}: more ends than begins"
        instance.in_flight -= 1

    def succeeded(self, instance: Instance) -> None:
        instance.down_until = 0.0

    def failed(self, instance: Instance) -> None:
        instance.failures += 1
        instance.down_until = self._clock() + self.cooldown_s

    def refused(self, instance: Instance, retry_after_s: float) -> None:
        """503 + Retry-After: the instance is full, not broken."""
        instance.busy_until = self._clock() + retry_after_s

    def report(self, instance: Instance, load: Load) -> None:
        instance.load = load
        instance.in_flight_at_report = instance.in_flight
        instance.down_until = 0.0
