"""Every `reasoning-gym` generator as `rg/<name>`, scored by the dataset's own `score_answer`.

Task seed `s` is item `s % BLOCK` of the dataset built with seed `s - s % BLOCK`, so that the
datasets whose construction loads data files (arc_agi, codeio, ...) are built once per thousand seeds
and item `s` still draws from `Random(s)`. Entries are cached per environment: a few generators take
about a second per item (knight_swap, sokoban, futoshiki), and scoring regenerates the entry from the
seed rather than trusting metadata that went through JSON.

Where the dataset ships no usable reference (`answer` is None), the reference is its metadata's
example answer or the output of a small solver here; `EXCLUDED` lists what is left out and why. A few
checkers `eval` the answer in this process: `ANSWER_GUARDS` admits only literals or plain arithmetic
to them (`safe_expr.py`), and `VERIFIER_OVERRIDES` replaces a checker that accepts any text.
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from typing import Any

import reasoning_gym  # type: ignore[import-untyped,unused-ignore]
from reasoning_gym.factory import DATASETS  # type: ignore[import-untyped,unused-ignore]

from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry
from tether.envs.rubric import format_followed, hedged, length_within
from tether.envs.safe_expr import is_arithmetic, is_literal
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Problem, Task

RG_VERSION = importlib.metadata.version("reasoning-gym")
BLOCK = 1000
EXCLUDED = {
    "composite": "a mixture of the other datasets that needs a config; use a tether mixture of rg/* instead",
}
SYSTEM = (
    "You are solving a reasoning puzzle. Follow the format the question asks for inside the answer. "
    + ANSWER_TAG.instructions
)

Entry = dict[str, Any]


def _jsonable(value: Any) -> Any:
    """Metadata as plain JSON for logging (tuples become lists, odd keys and objects become strings)."""
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_jsonable(item) for item in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    return repr(value)


# --- references the datasets do not ship --------------------------------------------------------------


def _rush_hour_solution(entry: Entry) -> str:
    """Breadth-first search over the 6x6 board, moves in the dataset's `A+1` notation."""
    board = entry["metadata"]["board_config"]
    size = 6
    cells: dict[str, list[int]] = {}
    walls = set()
    for index, label in enumerate(board):
        if label == "x":
            walls.add(index)
        elif label != "o":
            cells.setdefault(label, []).append(index)
    labels = sorted(cells)
    strides = [cells[label][1] - cells[label][0] for label in labels]
    lengths = [len(cells[label]) for label in labels]
    start = tuple(cells[label][0] for label in labels)
    target = 2 * size + size - 2  # the red car (first label) at the right end of row 2

    def occupied(state: tuple[int, ...]) -> set[int]:
        taken = set(walls)
        for position, stride, length in zip(state, strides, lengths, strict=True):
            taken.update(position + stride * k for k in range(length))
        return taken

    def slides(state: tuple[int, ...]) -> list[tuple[int, int, tuple[int, ...]]]:
        taken = occupied(state)
        moves = []
        for piece, (position, stride, length) in enumerate(zip(state, strides, lengths, strict=True)):
            # The band a piece slides in: its row when horizontal, the whole board when vertical.
            low, high = (position - position % size, position - position % size + size - 1)
            if stride != 1:
                low, high = 0, size * size - 1
            for direction in (-1, 1):
                head = position
                while True:
                    head += direction * stride
                    tail = head + (length - 1) * stride
                    entering = head if direction < 0 else tail
                    if head < low or tail > high or entering in taken:
                        break
                    moved = list(state)
                    moved[piece] = head
                    moves.append((piece, (head - position) // stride, tuple(moved)))
        return moves

    parents: dict[tuple[int, ...], tuple[tuple[int, ...], int, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state[0] == target:
            path = []
            while (link := parents[state]) is not None:
                state, piece, steps = link
                path.append(f"{chr(ord('A') + piece)}{'+' if steps > 0 else '-'}{abs(steps)}")
            return " ".join(reversed(path))
        for piece, steps, moved in slides(state):
            if moved not in parents:
                parents[moved] = (state, piece, steps)
                queue.append(moved)
    raise EnvError(f"rush_hour board {board!r} has no solution")


def _boxnet_solution(entry: Entry) -> str:
    """Walk each box to its target one square per step, then match it: one action per step."""
    grid: dict[str, list[str]] = entry["metadata"]["initial_state"]
    where: dict[str, tuple[float, float]] = {}
    for key, items in grid.items():
        x, y = (float(part) for part in key.split("_"))
        for item in items:
            where[item] = (x, y)
    plan: list[dict[str, str]] = []
    for box in sorted(item for item in where if item.startswith("box_")):
        x, y = where[box]
        tx, ty = where["target_" + box[4:]]
        while (x, y) != (tx, ty):
            nx, ny = (x + (1 if tx > x else -1), y) if x != tx else (x, y + (1 if ty > y else -1))
            plan.append({f"Agent[{x}, {y}]": f"move({box}, square[{nx}, {ny}])"})
            x, y = nx, ny
        plan.append({f"Agent[{x}, {y}]": f"move({box}, target_{box[4:]})"})
    return json.dumps(plan)


def _from_metadata(key: str) -> Callable[[Entry], str]:
    def reference(entry: Entry) -> str:
        value = entry["metadata"][key]
        return value if isinstance(value, str) else json.dumps(value)

    return reference


REFERENCE_SOLVERS: dict[str, Callable[[Entry], str]] = {
    "boxnet": _boxnet_solution,
    "graph_color": _from_metadata("possible_answer"),
    "propositional_logic": _from_metadata("example_answer"),
    "rubiks_cube": _from_metadata("example_correct_answer"),
    "rush_hour": _rush_hour_solution,
}


def _halting_verifier(answer: str, entry: Entry) -> float:
    # The dataset's own check is `bool(answer) == bool(entry["answer"])` on strings, so every non-empty
    # answer scores 1.0 (bool("False") is True); compare the stated truth value instead.
    return 1.0 if answer.strip().lower() == str(entry["answer"]).strip().lower() else 0.0


# Datasets whose own `score_answer` accepts wrong answers; each replacement says why.
VERIFIER_OVERRIDES: dict[str, Callable[[str, Entry], float]] = {
    "game_of_life_halting": _halting_verifier,
}


def _exact_or_literal(answer: str, entry: Entry) -> bool:
    # These checkers `eval` any answer that is not exactly right; only a plain literal may get there.
    accepted = {str(entry["answer"]), *entry["metadata"].get("valid_answers", [])}
    return answer in accepted or answer.strip() in accepted or is_literal(answer)


def _arithmetic(answer: str, entry: Entry) -> bool:
    return is_arithmetic(answer)  # these checkers hand the answer to sympy.parse_expr, which evals it


# Datasets whose checker evaluates the answer as Python in this process: the guard must admit it first.
ANSWER_GUARDS: dict[str, Callable[[str, Entry], bool]] = {
    "binary_matrix": _exact_or_literal,
    "n_queens": _exact_or_literal,
    "spiral_matrix": _exact_or_literal,
    "string_insertion": _exact_or_literal,
    "countdown": _arithmetic,
    "puzzle24": _arithmetic,
    "polynomial_multiplication": _arithmetic,
    "simple_integration": _arithmetic,
    "intermediate_integration": _arithmetic,
}


def _closed_form(entry: Entry) -> bool:
    # When sympy cannot integrate, the dataset's answer is `Integral(...) + C`, and restating the
    # question then scores 1.0; such items are drawn again (and `Integral` is refused in answers).
    return "Integral" not in str(entry["answer"])


# Items a dataset generates that make no task worth training on.
TASK_FILTERS: dict[str, Callable[[Entry], bool]] = {
    "intermediate_integration": _closed_form,
    "simple_integration": _closed_form,
}
MAX_REDRAWS = 32
REDRAW_STRIDE = 1_000_003
# Some generators seed numpy with `seed + index`, which must stay below 2**32: larger task seeds wrap.
SEED_SPACE = 2**32 - BLOCK


def dataset_names() -> list[str]:
    """The generators registered as environments: every dataset but the excluded ones."""
    return sorted(name for name in DATASETS if name not in EXCLUDED)


class RgSource:
    """Seeded entries of one reasoning-gym dataset, with datasets and entries cached.

    Safe to call from worker threads (`asyncio.to_thread(env.task, seed)` keeps a slow generator off
    the event loop): one lock guards the caches and the generators, which are not thread-safe.
    """

    def __init__(self, dataset: str, cache_entries: int = 512) -> None:
        if dataset not in DATASETS:
            raise EnvError(f"reasoning-gym {RG_VERSION} has no dataset {dataset!r}")
        self.dataset = dataset
        self._datasets: OrderedDict[int, Any] = OrderedDict()
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.RLock()

    def _block(self, base: int) -> Any:
        if base not in self._datasets:
            self._datasets[base] = reasoning_gym.create_dataset(self.dataset, seed=base, size=BLOCK)
            if len(self._datasets) > 4:
                self._datasets.popitem(last=False)
        self._datasets.move_to_end(base)
        return self._datasets[base]

    def entry(self, seed: int) -> Entry:
        with self._lock:
            return self._entry(seed)

    def _entry(self, seed: int) -> Entry:
        if seed in self._entries:
            self._entries.move_to_end(seed)
            return self._entries[seed]
        accept = TASK_FILTERS.get(self.dataset)
        for attempt in range(MAX_REDRAWS):
            # A rejected item is replaced by one further along, the same for every caller of this seed.
            position = (seed + attempt * REDRAW_STRIDE) % SEED_SPACE
            entry: Entry = self._block(position - position % BLOCK)[position % BLOCK]
            if accept is None or accept(entry):
                break
        else:
            raise EnvError(f"rg/{self.dataset}: no acceptable task near seed {seed} in {MAX_REDRAWS} draws")
        self._entries[seed] = entry
        if len(self._entries) > self._cache_entries:
            self._entries.popitem(last=False)
        return entry

    def reference(self, entry: Entry) -> str:
        solver = REFERENCE_SOLVERS.get(self.dataset)
        if solver is not None:
            return solver(entry)
        if entry["answer"] is None:
            raise EnvError(f"rg/{self.dataset} ships no reference answer and tether has no solver for it")
        return str(entry["answer"])

    def problem(self, seed: int) -> Problem:
        entry = self.entry(seed)
        data = {"dataset": self.dataset, "rg_version": RG_VERSION, "metadata": _jsonable(entry["metadata"])}
        return Problem(prompt=str(entry["question"]), answer=self.reference(entry), data=data)

    def verify(self, answer: str, seed: int) -> float:
        """The dataset's own score of `answer`, or 0 when its checker fails on malformed input."""
        entry = self.entry(seed)
        guard = ANSWER_GUARDS.get(self.dataset)
        if guard is not None and not guard(answer, entry):
            return 0.0
        override = VERIFIER_OVERRIDES.get(self.dataset)
        if override is not None:
            score = override(answer, entry)
        else:
            with self._lock:
                # Every block shares the config that score_answer reads; the latest one is at hand.
                dataset = next(reversed(self._datasets.values()))
                try:
                    score = float(dataset.score_answer(answer, entry))
                except Exception:  # the checkers parse model output and some raise on garbage: a 0
                    return 0.0
        return min(max(score, 0.0), 1.0) if score == score else 0.0


def rg_environment(dataset: str) -> Environment:
    source = RgSource(dataset)

    def verifier(inp: RewardInput) -> float:
        return 0.0 if inp.parsed.answer is None else source.verify(inp.parsed.answer, inp.task.seed)

    def correctness(inp: RewardInput) -> float:
        # The datasets give partial credit (0.01 for a well-formed wrong answer, ...); it is recorded in
        # `verifier` but only an exact solution counts as correct.
        return 1.0 if verifier(inp) >= 1.0 else 0.0

    def adversarial(task: Task) -> list[str]:
        return [hedged(ANSWER_TAG, task.reference), task.reference]

    return Environment(
        name=f"rg/{dataset}",
        source=source,
        renderer=ChatRenderer(SYSTEM),
        parser=ANSWER_TAG,
        rubric=Rubric(
            (
                Reward("correctness", correctness, 0.8, gate=True),
                Reward("format", format_followed, 0.1),
                Reward("length", length_within(8000), 0.1),
                Reward("verifier", verifier, 0.0),
            )
        ),
        description=f"reasoning-gym {RG_VERSION} dataset {dataset!r}, scored by its own verifier",
        adversarial=adversarial,
    )


def register(registry: EnvRegistry) -> None:
    for dataset in dataset_names():
        registry.register(f"rg/{dataset}", partial(rg_environment, dataset), source=__name__)
