"""The fleet's dispatch core, pure: least-loaded by reported slots plus this client's own in-flight
count, back-off on 503, down instances skipped, FULL when every instance is at capacity."""

from __future__ import annotations

from tether.sandbox.balancer import Balancer, Load, Verdict


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def picked(balancer: Balancer, tried: set[str] | None = None) -> str:
    choice = balancer.choose(tried or set())
    assert choice.verdict is Verdict.PICKED and choice.instance is not None, choice
    return choice.instance.url


def test_equally_loaded_instances_take_turns() -> None:
    balancer = Balancer(["a", "b", "c"], cooldown_s=10, clock=FakeClock())
    assert [picked(balancer) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_the_instance_with_the_smallest_share_of_its_slots_in_use_is_picked() -> None:
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=FakeClock())
    a, b = balancer.instances
    balancer.report(a, Load(slots=8, busy=2, queue_depth=0))  # a quarter in use
    balancer.report(b, Load(slots=2, busy=1, queue_depth=0))  # half in use
    assert {picked(balancer) for _ in range(3)} == {"a"}
    balancer.report(a, Load(slots=8, busy=6, queue_depth=1))  # 7/8: queued runs count too
    assert picked(balancer) == "b"


def test_own_runs_count_exactly_between_two_load_reports() -> None:
    balancer = Balancer(["a"], cooldown_s=10, clock=FakeClock())
    (a,) = balancer.instances
    balancer.begin(a)
    balancer.report(a, Load(slots=4, busy=3, queue_depth=0))  # ours (1) and 2 of other clients
    assert a.estimate() == 3
    balancer.begin(a)
    assert a.estimate() == 4 and not a.has_room()
    balancer.end(a)
    balancer.end(a)
    assert a.estimate() == 2  # the other clients' two, until the next report says otherwise


def test_a_full_fleet_is_a_wait_not_a_failure_and_a_freed_slot_ends_it() -> None:
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=FakeClock())
    a, b = balancer.instances
    balancer.report(a, Load(slots=1, busy=0, queue_depth=0))
    balancer.report(b, Load(slots=1, busy=0, queue_depth=0))
    balancer.begin(a)
    balancer.begin(b)
    choice = balancer.choose(set())
    assert choice.verdict is Verdict.FULL and choice.wait_s is None
    balancer.end(b)
    assert picked(balancer) == "b"


def test_a_503_backs_the_instance_off_for_its_retry_after_without_marking_it_down() -> None:
    clock = FakeClock()
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=clock)
    a, b = balancer.instances
    balancer.refused(a, retry_after_s=2)
    assert [picked(balancer) for _ in range(3)] == ["b", "b", "b"]
    balancer.refused(b, retry_after_s=5)
    choice = balancer.choose(set())
    assert choice.verdict is Verdict.FULL and choice.wait_s == 2
    assert a.failures == b.failures == 0 and balancer.up(a) and balancer.up(b)
    clock.now += 2
    assert picked(balancer) == "a"


def test_a_failed_instance_is_skipped_until_its_cooldown_or_a_load_report_shows_it_up() -> None:
    clock = FakeClock()
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=clock)
    a, _ = balancer.instances
    balancer.failed(a)
    assert [picked(balancer) for _ in range(3)] == ["b", "b", "b"]
    clock.now += 10
    assert {picked(balancer) for _ in range(2)} == {"a", "b"}
    balancer.failed(a)
    balancer.report(a, Load(slots=2, busy=0, queue_depth=0))
    assert balancer.up(a) and a.failures == 2


def test_when_every_instance_is_down_the_soonest_recovering_is_tried_then_none() -> None:
    clock = FakeClock()
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=clock)
    a, b = balancer.instances
    balancer.failed(b)
    clock.now += 1
    balancer.failed(a)
    assert picked(balancer) == "b"
    assert picked(balancer, {"b"}) == "a"
    assert balancer.choose({"a", "b"}).verdict is Verdict.EXHAUSTED


def test_membership_changes_keep_what_is_known_of_the_instances_that_stay() -> None:
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=FakeClock())
    a, b = balancer.instances
    balancer.begin(a)
    balancer.begin(b)
    balancer.set_members(["c", "a"])
    assert [i.url for i in balancer.instances] == ["c", "a"]
    assert balancer.find("a") is a and a.in_flight == 1 and balancer.find("b") is None
    balancer.end(b)  # a session that outlived its instance's membership still ends cleanly
    balancer.set_members([])
    assert balancer.choose(set()).verdict is Verdict.EXHAUSTED
