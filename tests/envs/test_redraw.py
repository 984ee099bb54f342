"""Re-drawing tasks that come out solved before any action (`draw_unsolved`): kept, re-drawn, refused."""

from __future__ import annotations

import pytest

from tether.envs.errors import EnvError
from tether.envs.tasks import MAX_REDRAWS, MAX_SEED, draw_unsolved, redraw_seed


def test_a_draw_that_needs_work_is_kept_as_it_is() -> None:
    assert draw_unsolved(lambda seed: seed, lambda drawn: False, 7, "toy/env") == 7


def test_a_solved_draw_is_redrawn_from_a_seed_derived_from_the_task_seed() -> None:
    drawn = draw_unsolved(lambda seed: seed, lambda drawn: drawn == 7, 7, "toy/env")
    assert drawn == redraw_seed(7, 1) != 7
    assert draw_unsolved(lambda seed: seed, lambda drawn: drawn == 7, 7, "toy/env") == drawn
    assert 0 <= drawn <= MAX_SEED


def test_redrawn_seeds_differ_between_attempts_and_stay_in_range() -> None:
    seeds = [redraw_seed(MAX_SEED, attempt) for attempt in range(MAX_REDRAWS)]
    assert len(set(seeds)) == MAX_REDRAWS
    assert all(0 <= seed <= MAX_SEED for seed in seeds)


def test_a_generator_that_only_draws_solved_tasks_is_a_clear_error() -> None:
    with pytest.raises(EnvError, match=rf"toy/env seed 3: {MAX_REDRAWS} draws in a row were solved"):
        draw_unsolved(lambda seed: seed, lambda drawn: True, 3, "toy/env")
