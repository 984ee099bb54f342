"""The routing core without sockets: consistent hashing with bounded load, its fallbacks, health state."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from tether.gateway.config import Routing
from tether.gateway.routing import Health, RoutedBy, Router

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def keys(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(count)]


def owner(router: Router, key: bytes) -> int:
    choice = router.choose(key)
    assert choice is not None
    return choice.replica.index


def test_a_key_goes_to_the_same_replica_in_any_router_built_from_the_same_urls() -> None:
    first, second = Router(URLS), Router(list(URLS))
    for key in keys(200):
        assert owner(first, key) == owner(second, key)
        assert first.choose(key) == first.choose(key)


def test_keys_spread_over_the_replicas() -> None:
    router = Router(URLS, virtual_nodes=64)
    shares = Counter(owner(router, key) for key in keys(3000))
    assert set(shares) == {0, 1, 2}
    for count in shares.values():
        assert 0.2 < count / 3000 < 0.47, shares


@pytest.mark.parametrize("load_factor", [1.0, 1.25, 2.0])
def test_no_replica_runs_more_than_c_times_the_average_even_for_one_hot_key(load_factor: float) -> None:
    router = Router(URLS, load_factor=load_factor)
    hot = keys(1)[0]
    for arrived in range(1, 301):
        choice = router.choose(hot)
        assert choice is not None
        router.started(choice.replica)
        loads = [r.in_flight for r in router.replicas]
        assert max(loads) <= math.ceil(load_factor * arrived / len(URLS) - 1e-9), (arrived, loads)


def test_a_full_owner_spills_to_the_same_next_replica_every_time() -> None:
    router = Router(URLS, load_factor=1.0)
    key = keys(1)[0]
    home = router.replicas[owner(router, key)]
    router.started(home)  # one running on the owner: with c = 1 it is full until the others catch up
    spills = set()
    for _ in range(5):
        choice = router.choose(key)
        assert choice is not None and choice.routed_by is RoutedBy.SPILL
        spills.add(choice.replica.index)
    assert len(spills) == 1 and home.index not in spills


def test_a_key_returns_to_its_owner_once_the_load_is_gone() -> None:
    router = Router(URLS, load_factor=1.0)
    key = keys(1)[0]
    first = router.choose(key)
    assert first is not None and first.routed_by is RoutedBy.PREFIX
    router.started(first.replica)
    assert router.choose(key) != first
    router.finished(first.replica)
    assert router.choose(key) == first


def test_taking_a_replica_out_moves_only_its_own_keys() -> None:
    router = Router(URLS)
    sample = keys(500)
    before = {key: owner(router, key) for key in sample}
    gone = router.replicas[1]
    for _ in range(router.unhealthy_after):
        router.failed(gone)
    assert gone.health is Health.DOWN
    after = {key: owner(router, key) for key in sample}
    assert all(after[key] != 1 for key in sample)
    assert all(after[key] == before[key] for key in sample if before[key] != 1)
    assert router.succeeded(gone)
    assert {key: owner(router, key) for key in sample} == before


def test_failures_take_a_replica_out_only_after_unhealthy_after_in_a_row() -> None:
    router = Router(URLS, unhealthy_after=3)
    replica = router.replicas[0]
    assert not router.failed(replica) and not router.failed(replica)
    assert not router.succeeded(replica)  # a success in between resets the count
    assert not router.failed(replica) and not router.failed(replica)
    assert replica.health is Health.UP
    assert router.failed(replica)
    assert replica.health is Health.DOWN
    assert not router.failed(replica)  # already out: no second transition
    assert router.succeeded(replica) and replica.health is Health.UP


def test_a_request_without_a_key_goes_to_the_least_loaded_replica() -> None:
    router = Router(URLS)
    router.started(router.replicas[0])
    router.started(router.replicas[0])
    router.started(router.replicas[2])
    choice = router.choose(None)
    assert choice is not None
    assert choice == router.choose(None)
    assert (choice.replica.index, choice.routed_by) == (1, RoutedBy.LEAST_LOADED)


def test_an_idle_pool_spreads_keyless_requests() -> None:
    router = Router(URLS)
    chosen = set()
    for _ in range(6):
        choice = router.choose(None)
        assert choice is not None
        chosen.add(choice.replica.index)
    assert chosen == {0, 1, 2}


def test_round_robin_takes_the_healthy_replicas_in_turn() -> None:
    router = Router(URLS, Routing.ROUND_ROBIN)
    router.replicas[1].health = Health.DOWN
    order = []
    for key in keys(4):
        choice = router.choose(key)
        assert choice is not None and choice.routed_by is RoutedBy.ROUND_ROBIN
        order.append(choice.replica.index)
    assert order == [0, 2, 0, 2]


def test_least_loaded_policy_ignores_keys() -> None:
    router = Router(URLS, Routing.LEAST_LOADED)
    router.started(router.replicas[0])
    router.started(router.replicas[1])
    for key in keys(5):
        choice = router.choose(key)
        assert choice is not None
        assert (choice.replica.index, choice.routed_by) == (2, RoutedBy.LEAST_LOADED)


def test_a_retry_never_goes_to_a_tried_replica_and_ends_when_all_were_tried() -> None:
    router = Router(URLS)
    key = keys(1)[0]
    tried: set[int] = set()
    for attempt in range(len(URLS)):
        choice = router.choose(key, frozenset(tried))
        assert choice is not None and choice.replica.index not in tried
        assert choice.routed_by is (RoutedBy.FAILOVER if attempt else RoutedBy.PREFIX)
        tried.add(choice.replica.index)
    assert router.choose(key, frozenset(tried)) is None


def test_with_every_replica_down_the_request_is_still_tried() -> None:
    router = Router(URLS, unhealthy_after=1)
    for replica in router.replicas:
        router.failed(replica)
    choice = router.choose(keys(1)[0])
    assert choice is not None and choice.routed_by is RoutedBy.LEAST_LOADED
