"""Async mode: batches generated with weights a bounded number of versions old, and exact resume."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from tether.rl.pipeline import WeightStore, generation_version

from .test_trainer import make_trainer, tiny_config

# Wall-clock figures differ between any two runs; so do the prefix cache's hits (an engine's cache is not
# checkpointed, and each Ray worker has its own), and with them the split of prompt tokens and the cost.
VOLATILE = ("time/", "tokens_per_s", "sandbox/cpu_s", "tokens/prompt_", "cost/", "run/threads")


@pytest.mark.parametrize(("step", "lag", "version"), [(0, 2, 0), (1, 2, 0), (2, 2, 0), (5, 2, 3), (5, 0, 5)])
def test_generation_version_lags_by_max_staleness(step: int, lag: int, version: int) -> None:
    assert generation_version(step, lag) == version


def test_weight_store_waits_for_a_version_and_gives_up_on_stop() -> None:
    store = WeightStore()
    stop = threading.Event()
    weights = {"w": torch.ones(2)}
    threading.Timer(0.1, store.put, args=(3, weights)).start()
    got = store.wait(3, stop)
    assert got is not None and torch.equal(got["w"], torch.ones(2))
    weights["w"].add_(1)  # the store holds a copy: later in-place updates do not leak into it
    assert torch.equal(store.wait(3, stop)["w"], torch.ones(2))  # type: ignore[index]
    stop.set()
    assert store.wait(4, stop) is None
    store.put(4, weights)
    store.drop_below(4)
    assert list(store.versions(below=10)) == [4]


def test_async_run_bounds_staleness_and_resumes_exactly(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_model("qwen3")
    overrides: dict[str, Mapping[str, object]] = {
        "run": {"steps": 3, "checkpoint_every": 5, "mode": "async", "max_staleness": 2}
    }
    straight = make_trainer(tiny_config(model, tmp_path / "a", **overrides))
    expected = straight.run()
    straight.close()
    assert [m["staleness_max"] for m in expected] == [0, 1, 2]  # batch s used version max(0, s - 2)
    assert [m["policy_version"] for m in expected] == [1, 2, 3]
    assert expected[2]["learner/ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # off-policy: ratios corrected

    killed = make_trainer(tiny_config(model, tmp_path / "b", **overrides))

    def kill_after_two(metrics: dict[str, float]) -> None:
        if metrics["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    assert [m["step"] for m in killed.run(on_step=kill_after_two)] == [1, 2]
    killed.close()
    resumed = make_trainer(tiny_config(model, tmp_path / "b", **overrides), resume=True)
    rest = resumed.run()  # batch 3 needs version 0's weights: restored from the checkpoint's snapshots
    resumed.close()
    assert [m["step"] for m in rest] == [3]
    got = {k: v for k, v in rest[0].items() if not k.startswith(VOLATILE)}
    want = {k: v for k, v in expected[2].items() if not k.startswith(VOLATILE)}
    assert got == pytest.approx(want, abs=1e-6)
