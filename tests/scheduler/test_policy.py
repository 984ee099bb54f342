"""Each policy on small hand-checked queues: what starts, what waits, what gets preempted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.scheduler.helpers import gpu_job, state, submit, topology
from tether.errors import ConfigError
from tether.scheduler.cluster import Placement
from tether.scheduler.job import JobSpec, JobState
from tether.scheduler.policy import POLICIES, get_policy, parse_policies
from tether.scheduler.state import Preempt, Resize, SchedulingState, Start


def _run(s: SchedulingState, job_id: str, *slots: tuple[int, int], now: float = 0.0) -> None:
    """Start a queued job at a given placement, as if an earlier pass had chosen it."""
    job = next(j for j in s.queue.in_submit_order(100) if j.job_id == job_id)
    s.start(job, Placement(job.spec.demand, slots), now)
    s.take_decisions()


def _started(s: SchedulingState) -> list[str]:
    return [d.job_id for d in s.take_decisions() if isinstance(d, Start)]


def _blocked_head_scenario() -> SchedulingState:
    s = state(topology(nodes=1))
    submit(s, gpu_job("running", 6, duration_s=100))
    _run(s, "running", (0, 6))
    submit(
        s,
        gpu_job("big", 8, submit_s=1),
        gpu_job("short", 1, duration_s=50, submit_s=2),
        gpu_job("long", 1, duration_s=500, submit_s=3),
    )
    return s


def test_fifo_head_of_line_blocks_everyone_behind_it() -> None:
    s = _blocked_head_scenario()
    get_policy("fifo").schedule(s, now=10)
    assert _started(s) == []
    assert len(s.queue) == 3


def test_backfill_starts_only_jobs_that_cannot_delay_the_head() -> None:
    s = _blocked_head_scenario()
    get_policy("fifo-backfill").schedule(s, now=10)
    # "big" is reserved for t=100 when "running" ends; "short" ends at 60, "long" would end at 510.
    assert _started(s) == ["short"]


def test_backfill_may_use_accelerators_the_head_leaves_spare() -> None:
    s = state(topology(nodes=1))
    submit(s, gpu_job("running", 6, duration_s=100))
    _run(s, "running", (0, 6))
    submit(s, gpu_job("head", 4, submit_s=1), gpu_job("long", 1, duration_s=500, submit_s=2))
    get_policy("fifo-backfill").schedule(s, now=10)
    # At t=100 eight are free, the head takes four: one long job fits in what is left.
    assert _started(s) == ["long"]


def test_fifo_starts_in_arrival_order_when_everything_fits() -> None:
    s = state(topology(nodes=2))
    submit(s, gpu_job("a", 4, submit_s=0), gpu_job("b", 8, submit_s=1), gpu_job("c", 4, submit_s=2))
    get_policy("fifo").schedule(s, now=0)
    assert _started(s) == ["a", "b", "c"]
    assert s.cluster.total_free == 0


def test_priority_preempts_a_lower_priority_job_and_requeues_it() -> None:
    s = state(topology(nodes=1))
    (low,) = submit(s, gpu_job("low", 8, priority=0))
    _run(s, "low", (0, 8))
    submit(s, gpu_job("urgent", 4, priority=2, submit_s=5))
    get_policy("priority").schedule(s, now=5)
    decisions = s.take_decisions()
    assert [type(d) for d in decisions] == [Preempt, Start]
    assert decisions[0].job_id == "low" and decisions[1].job_id == "urgent"
    assert low.state is JobState.QUEUED and "low" in s.queue


def test_priority_never_preempts_a_non_preemptible_job() -> None:
    s = state(topology(nodes=1))
    submit(s, gpu_job("pinned", 8, priority=0, preemptible=False))
    _run(s, "pinned", (0, 8))
    submit(s, gpu_job("urgent", 4, priority=2))
    get_policy("priority").schedule(s, now=5)
    assert s.take_decisions() == []


def test_priority_preempts_only_jobs_on_the_nodes_it_needs() -> None:
    s = state(topology(nodes=2))
    submit(s, gpu_job("old", 8), gpu_job("new", 8))
    _run(s, "old", (0, 8), now=0)
    _run(s, "new", (1, 8), now=50)
    submit(s, gpu_job("urgent", 8, priority=1))
    get_policy("priority").schedule(s, now=60)
    preempted = [d.job_id for d in s.take_decisions() if isinstance(d, Preempt)]
    assert preempted == ["new"]  # the youngest victim loses the least work
    assert "old" in s.running


def test_strict_priority_serves_higher_levels_first() -> None:
    s = state(topology(nodes=1))
    submit(s, gpu_job("low", 8, priority=0, submit_s=0), gpu_job("high", 8, priority=1, submit_s=1))
    get_policy("priority").schedule(s, now=1)
    assert _started(s) == ["high"]


def test_fair_share_serves_the_least_served_tenant_first() -> None:
    s = state(topology(nodes=2))
    submit(s, gpu_job("a1", 12, tenant="a"))
    _run(s, "a1", (0, 8), (1, 4))
    submit(s, gpu_job("a2", 4, tenant="a", submit_s=1), gpu_job("b1", 4, tenant="b", submit_s=2))
    get_policy("fair-share").schedule(s, now=3)
    assert _started(s) == ["b1"]
    fifo = state(topology(nodes=2))
    submit(fifo, gpu_job("a1", 12, tenant="a"))
    _run(fifo, "a1", (0, 8), (1, 4))
    submit(fifo, gpu_job("a2", 4, tenant="a", submit_s=1), gpu_job("b1", 4, tenant="b", submit_s=2))
    get_policy("fifo").schedule(fifo, now=3)
    assert _started(fifo) == ["a2"]


def test_topology_policy_never_splits_a_gang_that_fits_one_island() -> None:
    for name, expected in (("fifo", ((0, 4), (1, 4))), ("topology", ((1, 8),))):
        s = state(topology(nodes=2))
        submit(s, gpu_job("small", 4))
        _run(s, "small", (0, 4))
        submit(s, gpu_job("gang", 8, submit_s=1))
        get_policy(name).schedule(s, now=1)
        (start,) = s.take_decisions()
        assert isinstance(start, Start) and start.placement.slots == expected, name


def test_every_registered_policy_drains_a_feasible_queue() -> None:
    for policy in POLICIES.values():
        s = state(topology(nodes=2))
        submit(s, *(gpu_job(f"j{i}", 1 + i % 8, submit_s=i) for i in range(6)))
        now = 0.0
        while len(s.queue):
            policy.schedule(s, now)
            s.take_decisions()
            finished = min(s.running.values(), key=lambda a: a.expected_end_s)
            now = finished.expected_end_s
            s.finish(finished.job.job_id, now)
        assert s.cluster.total_free + sum(a.placement.accelerators for a in s.running.values()) == 16


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'lifo'; known policies: fifo, fifo-backfill"):
        get_policy("lifo")


def test_policy_lists_are_parsed_in_order_without_duplicates() -> None:
    assert [p.name for p in parse_policies("topology, fifo,topology")] == ["topology", "fifo"]
    with pytest.raises(ConfigError, match="name at least one"):
        parse_policies(" , ")


def _elastic(job_id: str, replicas: int, min_replicas: int, **kwargs: float) -> JobSpec:
    return replace(gpu_job(job_id, replicas, **kwargs), min_replicas=min_replicas)  # type: ignore[arg-type]


def test_an_elastic_job_starts_short_and_grows_when_nobody_waits() -> None:
    s = state(topology(nodes=1))
    submit(s, gpu_job("blocker", 5, duration_s=100))
    _run(s, "blocker", (0, 5))
    submit(s, _elastic("elastic", 8, 2, submit_s=1), gpu_job("rigid", 4, submit_s=2))
    get_policy("fifo").schedule(s, now=1)
    (start,) = s.take_decisions()
    assert isinstance(start, Start) and start.placement.replicas == 3  # all that fits, above its minimum
    assert "rigid" in s.queue  # a rigid gang never starts short
    s.finish("blocker", now=100)
    get_policy("fifo").schedule(s, now=100)
    # "rigid" takes four of the five freed; with the queue empty "elastic" grows by the last one.
    assert [type(d) for d in s.take_decisions()] == [Start, Resize]
    assert s.running["elastic"].placement.replicas == 4
    assert s.cluster.total_free == 0 and "elastic" in s.growable


def test_an_elastic_job_below_its_minimum_waits() -> None:
    s = state(topology(nodes=1))
    submit(s, gpu_job("blocker", 7))
    _run(s, "blocker", (0, 7))
    submit(s, _elastic("elastic", 8, 2))
    get_policy("fifo").schedule(s, now=1)
    assert s.take_decisions() == []


def test_min_replicas_must_be_within_the_gang() -> None:
    with pytest.raises(ValueError, match=r"min_replicas = 9, must be in \[1, replicas = 8\]"):
        _elastic("bad", 8, 9)
