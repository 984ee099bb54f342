"""The informative batch of `tether rl bench`: which groups count as informative, the search for a mixed
prompt per group under its sample seed, and the environment that serves the chosen prompts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tether.envs.bench import IntegerArithmetic
from tether.envs.registry import mixture_from_weights
from tether.errors import ConfigError
from tether.rl.informative import (
    INFORMATIVE_ENV,
    Probe,
    choose_informative,
    informative_groups,
    informative_registry,
    mixed,
    sample_seeds,
)
from tether.rl.rollout import plan_prompts


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [([0.0, 0.0], False), ([1.0, 1.0, 1.0], False), ([0.0, 1.0], True), ([0.5, 0.5, 0.25], True)],
)
def test_a_group_is_informative_when_its_rewards_differ(rewards: list[float], expected: bool) -> None:
    assert mixed(rewards) is expected


def test_informative_groups_counts_the_mixed_groups_of_a_batch() -> None:
    assert informative_groups([0, 0, 0, 1, 1, 1, 1, 0], 2) == 2
    assert informative_groups([0, 0, 0, 0], 4) == 0


@pytest.mark.parametrize(("count", "size"), [(5, 2), (4, 0)])
def test_informative_groups_refuses_rewards_that_are_not_whole_groups(count: int, size: int) -> None:
    with pytest.raises(ValueError, match="whole groups"):
        informative_groups([0.0] * count, size)


def parity_probe(calls: list[int]) -> Probe:
    """Mixed rewards exactly when task + sample seed is divisible by 3; records each call's size."""

    def probe(groups: Sequence[tuple[int, int]]) -> list[list[float]]:
        calls.append(len(groups))
        return [[0.0, 1.0] if (task + sample) % 3 == 0 else [1.0, 1.0] for task, sample in groups]

    return probe


def test_every_slot_gets_a_distinct_prompt_that_is_mixed_under_its_own_sample_seed() -> None:
    calls: list[int] = []
    slots = [10, 11, 12, 13]
    chosen = choose_informative(slots, parity_probe(calls), iter(range(100)), max_probes=100)
    assert len(set(chosen)) == len(slots)
    assert all((task + sample) % 3 == 0 for task, sample in zip(chosen, slots, strict=True))
    assert calls[0] == 2 * len(slots)  # one batch per round: two candidates for every open slot
    assert sum(calls) <= 100


def test_the_last_open_slots_are_searched_at_the_first_rounds_batch_size() -> None:
    calls: list[int] = []

    def hard_last_slot(groups: Sequence[tuple[int, int]]) -> list[list[float]]:
        calls.append(len(groups))
        # every slot but sample seed 13 mixes at once; 13 mixes only on task seeds of 40 and more
        return [[0.0, 1.0] if sample != 13 or task >= 40 else [1.0, 1.0] for task, sample in groups]

    chosen = choose_informative([10, 11, 12, 13], hard_last_slot, iter(range(100)), max_probes=100)
    assert chosen[3] >= 40
    assert calls[0] == 8  # two candidates for each of the 4 open slots
    assert all(size == 8 for size in calls[1:])  # the one open slot gets the whole round: 8 candidates
    assert len(calls) <= 1 + (40 - 8) // 8 + 1


def test_the_search_gives_up_with_how_far_it_got() -> None:
    def never(groups: Sequence[tuple[int, int]]) -> list[list[float]]:
        return [[0.0, 0.0] for _ in groups]

    with pytest.raises(ConfigError, match=r"0 of 3 groups found mixed rewards in 12 probed prompts"):
        choose_informative([1, 2, 3], never, iter(range(1000)), max_probes=12)


def test_the_slots_are_the_sample_seeds_a_run_gives_its_groups() -> None:
    registry = informative_registry([5, 6, 7, 8, 9, 10])
    mixture = mixture_from_weights(registry, {INFORMATIVE_ENV: 1.0})
    cursors: dict[str, int] = {}
    planned = []
    for step in range(2):
        plans, cursors = plan_prompts(mixture, cursors, 3, 7, step)
        planned += plans
    assert [plan.sample_seed for plan in planned] == sample_seeds(7, 2, 3)
    assert [plan.seed for plan in planned] == list(range(6))  # task i of the run: chosen seed i


def test_the_informative_environment_serves_the_chosen_problems_in_order() -> None:
    env = informative_registry([42, 7]).get(INFORMATIVE_ENV)
    assert env.task(0).reference == IntegerArithmetic().problem(42).answer
    assert env.task(1).reference == IntegerArithmetic().problem(7).answer
    with pytest.raises(ConfigError, match="informative task 2: only 2 prompts were chosen"):
        env.task(2)
