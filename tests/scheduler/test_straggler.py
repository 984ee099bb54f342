"""Straggler detection from step times, and its mitigation: a spare if there is one, else a reschedule."""

from __future__ import annotations

import pytest

from tests.scheduler.helpers import gpu_job, state, submit, topology
from tether.scheduler.cluster import Placement
from tether.scheduler.job import Job
from tether.scheduler.placement import TopologyAware
from tether.scheduler.state import Preempt, Replace, SchedulingState
from tether.scheduler.straggler import StragglerConfig, StragglerDetector, find_stragglers, mitigate


def test_a_replica_slower_than_the_threshold_is_flagged() -> None:
    times = {0: [1.0, 1.1, 0.9], 1: [1.0, 1.0, 1.0], 2: [1.6, 1.7, 1.6], 3: [1.05, 1.0, 0.95]}
    assert find_stragglers(times, threshold=1.5) == [2]
    assert find_stragglers(times, threshold=1.8) == []


def test_uniformly_slow_replicas_are_not_stragglers() -> None:
    assert find_stragglers({0: [3.0], 1: [3.1], 2: [2.9]}, threshold=1.2) == []


def test_a_lone_replica_has_no_peers_to_lag_behind() -> None:
    assert find_stragglers({0: [100.0]}, threshold=1.1) == []


def test_detector_waits_for_full_windows_and_slides() -> None:
    detector = StragglerDetector(StragglerConfig(threshold=1.5, window_steps=3))
    for step in range(3):
        detector.report("job", 0, 1.0)
        detector.report("job", 1, 1.0)
        detector.report("job", 2, 2.0 if step else 1.0)
        assert detector.stragglers("job") == ([2] if step == 2 else [])
    for _ in range(3):
        for replica in range(3):
            detector.report("job", replica, 1.0)
    assert detector.stragglers("job") == []
    detector.forget("job")
    assert detector.stragglers("job") == []


@pytest.mark.parametrize(
    ("kwargs", "expected"), [({"threshold": 1.0}, "threshold"), ({"window_steps": 0}, "window_steps")]
)
def test_bad_straggler_settings_are_refused(kwargs: dict[str, float], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        StragglerConfig(**kwargs)  # type: ignore[arg-type]


def test_a_bad_step_time_report_is_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        StragglerDetector().report("job", 0, -1.0)


def _running_gang(nodes: int) -> tuple[SchedulingState, Job]:
    s = state(topology(nodes=nodes, nodes_per_island=nodes, nodes_per_rack=nodes))
    (job,) = submit(s, gpu_job("gang", 4, duration_s=1000, checkpoint_interval_s=100))
    s.start(job, Placement(job.spec.demand, ((0, 4),)), 0.0)
    s.take_decisions()
    return s, job


def test_a_straggler_is_replaced_by_a_spare() -> None:
    s, _ = _running_gang(nodes=2)
    decision = mitigate(s, TopologyAware(), "gang", 0, 1, slowdown=1.5, uncheckpointed_s=50, restart_s=60)
    assert isinstance(decision, Replace)
    assert sorted(decision.placement.slots) == [(0, 3), (1, 1)]
    assert s.cluster.free_accelerators == [5, 7]


def test_without_a_spare_a_straggler_is_rescheduled_when_that_is_cheaper() -> None:
    s, job = _running_gang(nodes=1)
    job.done_s = 250
    # Filling the node leaves no spare; 750 s left at 1.5x costs 375 s, more than 50 + 60 s.
    decision = mitigate(s, TopologyAware(), "gang", 0, 1, slowdown=1.5, uncheckpointed_s=50, restart_s=60)
    assert isinstance(decision, Preempt) and "straggler" in decision.reason
    assert "gang" in s.queue


def test_a_straggler_near_the_end_is_left_to_finish() -> None:
    s, job = _running_gang(nodes=1)
    job.done_s = 990
    decision = mitigate(s, TopologyAware(), "gang", 0, 1, slowdown=1.5, uncheckpointed_s=90, restart_s=60)
    assert decision is None
    assert "gang" in s.running
