"""Failures that are not rewards: how a rollout's infrastructure failure is named, retried and bounded.

A scoring that raises `InfraError` (the sandbox failed the run, a judge gave no verdict, a reward was
NaN, None or out of range), raises anything else (`scorer_error`) or outlasts its deadline
(`scorer_timeout`) is no verdict on the model's answer: the rollout is tried again up to
`[rollout] infra_retries` times (`retry_scoring` for a single-turn answer; episodes and agent tasks are
re-run by their drivers with the same seeds), and if it still fails it carries the reason in
`Rollout.infra_failure` and stays out of the advantages. The model's own failures (its program timed out,
crashed, ran out of memory) are scored as they always were. A step with too many failures left stops the
run (`check_failure_rate`) rather than train on the biased rest. No I/O here: the callers run the work.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tether.envs.scoring import Score
from tether.errors import InfraError, InfraReason, TetherError
from tether.rl.sections import RolloutSection

if TYPE_CHECKING:
    from tether.rl.rollout import Rollout


class InfraFailureRateError(TetherError):
    """A step's share of infra-failed rollouts is above `[rollout] max_infra_failure_rate`."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a failed rollout is tried again, and how long one scoring may take."""

    infra_retries: int = 2
    score_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        assert self.infra_retries >= 0 and self.score_timeout_s > 0

    @classmethod
    def of(cls, section: RolloutSection) -> RetryPolicy:
        return cls(section.infra_retries, section.score_timeout_s)


def infra_reason(error: BaseException) -> InfraReason:
    """The reason a failed scoring gets: an `InfraError`'s own, else a broken scorer."""
    return error.reason if isinstance(error, InfraError) else InfraReason.SCORER_ERROR


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


async def within_deadline(work: Awaitable[Score], timeout_s: float) -> Score:
    """`work`'s score, or `InfraError(scorer_timeout)` once it has taken longer than `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            return await work
    except TimeoutError:
        raise InfraError(
            InfraReason.SCORER_TIMEOUT,
            f"scoring took longer than rollout.score_timeout_s = {timeout_s:g} s",
        ) from None


def valid_score(score: Score) -> Score:
    """`score` if its total is a reward in [0, 1]; `InfraError(invalid_reward)` otherwise (NaN is never
    learned from as 0)."""
    total = score.total
    if not isinstance(total, int | float) or not 0.0 <= total <= 1.0:  # rejects None and NaN too
        raise InfraError(InfraReason.INVALID_REWARD, f"the score's total {total!r} is outside [0, 1]")
    return score


@dataclass(slots=True)
class Attempts:
    """What tries of one rollout came to: its score, or the reason and message of the last failure."""

    score: Score | None = None
    failure: InfraReason | None = None
    error: str | None = None
    retry_reasons: list[str] = field(default_factory=list)  # the failure that caused each retry

    def apply(self, rollout: Rollout) -> None:
        """Record the outcome on `rollout` (its reward only when it was scored)."""
        # after any retries of its source (a re-issued request) come those of scoring
        rollout.retry_reasons = [*rollout.retry_reasons, *self.retry_reasons]
        rollout.infra_failure = None if self.failure is None else self.failure.value
        rollout.error = self.error
        if self.score is not None:
            rollout.reward = self.score.total
            rollout.components = dict(self.score.components)
            rollout.passed = self.score.passed
            rollout.qc_violation = self.score.qc_violation


async def retry_scoring(attempt: Callable[[], Awaitable[Score]], policy: RetryPolicy) -> Attempts:
    """Score with `attempt` (a fresh scoring each call) until one succeeds or the retries are spent."""
    attempts = Attempts()
    for tried in range(policy.infra_retries + 1):
        if tried:
            assert attempts.failure is not None
            attempts.retry_reasons.append(attempts.failure.value)
        try:
            attempts.score = valid_score(await within_deadline(attempt(), policy.score_timeout_s))
        except Exception as error:  # any failure of the scorer is no verdict on the answer
            attempts.failure, attempts.error = infra_reason(error), describe(error)
            continue
        attempts.failure = attempts.error = None
        return attempts
    return attempts


def check_failure_rate(rollouts: Sequence[Rollout], max_rate: float) -> None:
    """Raise `InfraFailureRateError` when the share of infra-failed rollouts is above `max_rate`."""
    failed = [r for r in rollouts if r.infra_failure is not None]
    if not rollouts or len(failed) / len(rollouts) <= max_rate:
        return
    counts = Counter(r.infra_failure for r in failed)
    reasons = ", ".join(f"{reason} {count}" for reason, count in counts.most_common())
    raise InfraFailureRateError(
        f"{len(failed)} of {len(rollouts)} rollouts ({len(failed) / len(rollouts):.0%}) failed for "
        f"infrastructure reasons after their retries ({reasons}), above rollout.max_infra_failure_rate "
        f"= {max_rate:g}: the run stops rather than learn from the rest. First failure ({failed[0].env} "
        f"seed {failed[0].seed}): {failed[0].error}. Fix the failing component or raise the setting"
    )
