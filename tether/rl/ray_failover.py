"""Calls to the Ray backend's actors under a deadline, and the errors that name an actor that is gone.

Every call the driver makes to a rollout worker or the learner actor waits at most `[ray]
call_timeout_s`: an actor whose process died (`RayActorError`) or that does not answer in time is killed
and reported as an `ActorLostError` naming it (its role, pid and node), never waited on forever. What
happens next is the caller's: the rollout fleet replaces a lost worker (`ray_rollouts.py`), a lost learner
makes `RayTrainer` resume from its last checkpoint (`ray_backend.py`). Ray itself is passed in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from tether.errors import TetherError


class ActorLostError(TetherError):
    """A Ray actor of the run died or did not answer within its deadline (it has been killed)."""

    def __init__(self, message: str, hung: bool) -> None:
        super().__init__(message)
        self.hung = hung  # it stopped answering (else its process died)


class LearnerLostError(ActorLostError):
    """The learner actor is gone: the run resumes from its last checkpoint, up to
    `[ray] max_learner_restarts` times (`RayTrainer.run`)."""


@dataclass(frozen=True, slots=True)
class Whereabouts:
    """Where an actor runs: what an operator needs to find a stuck or dead one."""

    pid: int
    node: str

    @classmethod
    def here(cls, ray: ModuleType) -> Whereabouts:
        return cls(os.getpid(), str(ray.util.get_node_ip_address()))


@dataclass(frozen=True, slots=True)
class ActorName:
    """An actor as messages name it: `rollout worker 1 (pid 1234, node 10.0.0.2)`."""

    role: str
    where: Whereabouts | None = None

    def __str__(self) -> str:
        if self.where is None:
            return self.role
        return f"{self.role} (pid {self.where.pid}, node {self.where.node})"


def lost(
    ray: ModuleType, handle: Any, name: ActorName, method: str, timeout_s: float, error: Exception | None
) -> str:
    """Kill the actor (it may be stuck, not dead) and say what happened to `method`'s call; `error`
    None: it did not answer within `timeout_s`."""
    ray.kill(handle, no_restart=True)
    if error is None:
        return f"{name} did not answer {method} within {timeout_s:g} s (ray.call_timeout_s); it was killed"
    return f"{name} died during {method}: {type(error).__name__}: {_first_line(error)}"


def answer(
    ray: ModuleType,
    handle: Any,
    ref: Any,
    name: ActorName,
    method: str,
    timeout_s: float,
    lost_error: Callable[[str, bool], ActorLostError] = ActorLostError,
) -> Any:
    """The result of the call `ref` to `handle`, or `lost_error` (the actor killed) if the actor died or
    did not answer within `timeout_s`; the method's own exceptions pass through as they are."""
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        raise lost_error(lost(ray, handle, name, method, timeout_s, None), True)
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as error:
        raise lost_error(lost(ray, handle, name, method, timeout_s, error), False) from error


class Deadlines:
    """When each of several outstanding calls must have answered (monotonic seconds)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._due: dict[int, float] = {}

    def start(self, key: int) -> None:
        self._due[key] = self.clock() + self.timeout_s

    def done(self, key: int) -> None:
        del self._due[key]

    def wait_s(self) -> float:
        """How long until the soonest is due (0 when one is overdue)."""
        return max(0.0, min(self._due.values()) - self.clock())

    def overdue(self) -> list[int]:
        now = self.clock()
        return [key for key, due in self._due.items() if due <= now]


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
