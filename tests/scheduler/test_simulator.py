"""The discrete-event simulator on scenarios whose completion times are worked out by hand."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from tests.scheduler.helpers import gpu_job, topology
from tether.errors import ConfigError
from tether.scheduler.policy import get_policy
from tether.scheduler.simulator import SimConfig, Simulation, simulate
from tether.scheduler.straggler import StragglerConfig
from tether.scheduler.trace import SyntheticTrace

NO_STRAGGLERS = SimConfig(straggler_replica_probability=0.0, restart_s=120.0)


class ScriptedRandom(random.Random):
    """Replica draws come from a script, so a test decides which replica straggles."""

    def __init__(self, draws: list[float]) -> None:
        super().__init__(0)
        self.draws = itertools.chain(draws, itertools.repeat(0.9))

    def random(self) -> float:
        return next(self.draws)


def test_a_lone_job_completes_in_its_duration() -> None:
    result = simulate(
        topology(nodes=1), get_policy("fifo"), [gpu_job("solo", 8, duration_s=600)], NO_STRAGGLERS
    )
    assert (result.avg_jct_s, result.avg_queue_delay_s, result.makespan_s) == (600.0, 0.0, 600.0)
    assert result.preemptions == 0 and result.cross_domain_job_share == 0.0


@pytest.mark.parametrize(("policy", "gang_jct_s"), [("fifo", 130.0), ("topology", 100.0)])
def test_a_split_gang_runs_slower_by_the_cross_island_factor(policy: str, gang_jct_s: float) -> None:
    jobs = [gpu_job("small", 4, duration_s=100), gpu_job("gang", 8, duration_s=100, submit_s=1)]
    sim = Simulation(topology(nodes=2), get_policy(policy), jobs, NO_STRAGGLERS)
    result = sim.run()
    gang = sim.jobs["gang"]
    assert gang.finish_s is not None and gang.finish_s - gang.spec.submit_s == pytest.approx(gang_jct_s)
    assert result.avg_cross_domain_slowdown_s == pytest.approx((gang_jct_s - 100.0) / 2, abs=0.1)


def test_a_preempted_job_resumes_from_its_last_checkpoint() -> None:
    jobs = [
        gpu_job("low", 8, duration_s=1000, checkpoint_interval_s=300, priority=0),
        gpu_job("urgent", 8, duration_s=100, submit_s=500, priority=2),
    ]
    sim = Simulation(topology(nodes=1), get_policy("priority"), jobs, NO_STRAGGLERS)
    result = sim.run()
    # "low" did 500 s, keeps 300 s (its checkpoint), waits for "urgent" (500-600), restarts for 120 s,
    # then runs its remaining 700 s: done at 1420.
    assert sim.jobs["low"].finish_s == pytest.approx(1420.0)
    assert sim.jobs["low"].attempts == 2
    assert sim.jobs["urgent"].finish_s == pytest.approx(600.0)
    assert result.preemptions == 1


@pytest.mark.parametrize(("mitigate", "finish_s"), [(True, 10_100.0), (False, 15_000.0)])
def test_a_straggler_is_detected_and_replaced(mitigate: bool, finish_s: float) -> None:
    config = SimConfig(
        straggler=StragglerConfig(threshold=1.3, window_steps=20),
        straggler_replica_probability=0.5,
        straggler_slowdown=1.5,
        mitigate_stragglers=mitigate,
        step_s=10.0,
        step_jitter=0.0,
        restart_s=0.0,
    )
    shape = topology(nodes=2, nodes_per_island=2, nodes_per_rack=2)
    sim = Simulation(shape, get_policy("topology"), [gpu_job("gang", 4, duration_s=10_000)], config)
    sim.rng = ScriptedRandom([0.0, 0.9, 0.9, 0.9])  # replica 0 of four straggles
    result = sim.run()
    # Slow at 1.5x for 20 steps of 15 s (300 s, 200 s of work), then full speed for the other 9,800 s.
    assert sim.jobs["gang"].finish_s == pytest.approx(finish_s)
    assert (result.stragglers_flagged, result.stragglers_replaced) == ((1, 1) if mitigate else (0, 0))


def test_a_job_that_fits_no_node_is_refused_before_simulating() -> None:
    hungry = gpu_job("hungry", 1, memory_mib=600 * 1024)
    with pytest.raises(ConfigError, match=r"job hungry: 1 replicas .* cannot fit even the empty cluster"):
        Simulation(topology(nodes=2, memory_gib=512), get_policy("fifo"), [hungry], NO_STRAGGLERS)
    with pytest.raises(ConfigError, match="at most 16 fit"):
        Simulation(topology(nodes=2), get_policy("fifo"), [gpu_job("huge", 17)], NO_STRAGGLERS)


def test_simulation_is_deterministic_and_accounts_for_every_job() -> None:
    jobs = SyntheticTrace(jobs=300, seed=3, cluster_accelerators=64).generate()
    shape = topology(nodes=8, nodes_per_rack=4)
    for name in ("fifo", "priority", "topology"):
        first = simulate(shape, get_policy(name), jobs, SimConfig(seed=1)).summary()
        second = simulate(shape, get_policy(name), jobs, SimConfig(seed=1)).summary()
        first.pop("wall_s"), second.pop("wall_s")
        assert first == second
        assert first["jobs"] == 300
        assert 0 < float(first["utilization"]) <= 1
        assert float(first["p95_jct_s"]) >= float(first["avg_queue_delay_s"])


@pytest.mark.parametrize(
    ("restart_s", "finish_s", "rescheduled"),
    [
        # No spare on a full one-node cluster: 800 s left at 2x costs 800 s, more than redoing 200 s.
        (0.0, 1400.0, 1),
        # With a 10,000 s restart, running slow is cheaper: kept, and not examined again.
        (10_000.0, 2000.0, 0),
    ],
)
def test_a_straggler_without_a_spare_is_rescheduled_only_when_worth_it(
    restart_s: float, finish_s: float, rescheduled: int
) -> None:
    config = SimConfig(straggler_replica_probability=0.5, step_s=10.0, step_jitter=0.0, restart_s=restart_s)
    sim = Simulation(topology(nodes=1), get_policy("fifo"), [gpu_job("gang", 8, duration_s=1000)], config)
    sim.rng = ScriptedRandom([0.0])
    result = sim.run()
    # Twenty 20 s steps (400 s wall, 200 s of work) before the detector has a full window.
    assert sim.jobs["gang"].finish_s == pytest.approx(finish_s)
    assert (result.stragglers_flagged, result.stragglers_rescheduled) == (1, rescheduled)


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(ConfigError, match="no jobs to simulate"):
        Simulation(topology(), get_policy("fifo"), [], NO_STRAGGLERS)


@pytest.mark.parametrize(("restart_s", "finish_s"), [(0.0, 150.0), (20.0, 170.0)])
def test_an_elastic_job_runs_at_half_speed_on_half_its_gang_then_grows(
    restart_s: float, finish_s: float
) -> None:
    jobs = [
        gpu_job("blocker", 4, duration_s=100),
        replace(gpu_job("elastic", 8, duration_s=100), min_replicas=4),
    ]
    config = SimConfig(straggler_replica_probability=0.0, restart_s=restart_s)
    sim = Simulation(topology(nodes=1), get_policy("fifo"), jobs, config)
    result = sim.run()
    # 4 of 8 replicas until t=100 (50 s of work), then all 8 after a re-form pause for the other 50 s.
    assert sim.jobs["elastic"].finish_s == pytest.approx(finish_s)
    assert result.resizes == 1
