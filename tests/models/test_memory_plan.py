"""Per-rank memory plans: FSDP divides the sharded state by the ranks, the compute dtype sizes the
working copies, activations come from the training forward run on meta tensors."""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

import pytest

from tether.errors import ConfigError
from tether.models.memory_plan import (
    CATEGORIES,
    MicroBatch,
    PlanSettings,
    Strategy,
    kv_bytes_per_token,
    plan_memory,
)
from tether.models.precision import DType
from tether.models.presets import preset

SMALL = MicroBatch(prompts=2, samples=4, prompt_tokens=32, completion_tokens=16)


def _plan(name: str = "smollm2-135m", **changes: Any) -> dict[str, int]:
    settings = PlanSettings(Strategy.SINGLE, 1, DType.FLOAT32, SMALL, kv_cache_tokens=1000)
    return plan_memory(name, preset(name), dataclasses.replace(settings, **changes)).bytes


def test_a_single_process_holds_16_bytes_a_parameter_and_the_engine_its_own_copy() -> None:
    plan = plan_memory(
        "llama-3-8b", preset("llama-3-8b"), PlanSettings(Strategy.SINGLE, 1, DType.FLOAT32, SMALL)
    )
    count = plan.parameter_count
    assert plan.bytes["parameters"] == plan.bytes["gradients"] == 4 * count
    assert plan.bytes["optimizer"] == 8 * count
    assert plan.bytes["working_weights"] == 0  # float32: computed with the master weights themselves
    assert plan.bytes["engine_weights"] == 4 * count
    assert tuple(plan.bytes) == CATEGORIES
    assert plan.total == sum(plan.bytes.values())


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fsdp_divides_parameters_gradients_and_optimizer_by_the_ranks(world_size: int) -> None:
    one = _plan(strategy=Strategy.FSDP, world_size=1)
    many = _plan(strategy=Strategy.FSDP, world_size=world_size)
    for category in ("parameters", "gradients", "optimizer"):
        assert many[category] == pytest.approx(one[category] / world_size, abs=1)
    for category in ("working_weights", "activations", "engine_weights", "kv_cache"):
        assert many[category] == one[category]  # gathered layers, data-parallel batches, the engine


def test_fsdp_gathers_the_root_and_two_layers_in_the_compute_dtype() -> None:
    config = preset("llama-3-8b")
    fsdp = plan_memory("llama-3-8b", config, PlanSettings(Strategy.FSDP, 8, DType.BFLOAT16, SMALL))
    embedding = config.vocab_size * config.hidden_size
    per_layer = (fsdp.parameter_count - 2 * embedding - config.hidden_size) // config.num_layers
    assert fsdp.bytes["working_weights"] == 2 * (2 * embedding + config.hidden_size + 2 * per_layer)


def test_bfloat16_halves_the_compute_copies_and_keeps_the_float32_master_state() -> None:
    fp32 = _plan(strategy=Strategy.FSDP, world_size=2)
    bf16 = _plan(strategy=Strategy.FSDP, world_size=2, dtype=DType.BFLOAT16)
    for category in ("working_weights", "engine_weights", "kv_cache"):
        assert bf16[category] * 2 == fp32[category]
    for category in ("parameters", "gradients", "optimizer"):
        assert bf16[category] == fp32[category]
    assert bf16["activations"] < 0.75 * fp32["activations"]  # norms and logprobs stay in float32


def test_a_single_process_in_bfloat16_holds_a_whole_bfloat16_copy() -> None:
    plan = plan_memory(
        "smollm2-135m", preset("smollm2-135m"), PlanSettings(Strategy.SINGLE, 1, DType.BFLOAT16, SMALL)
    )
    assert plan.bytes["working_weights"] == 2 * plan.parameter_count


def test_activations_grow_with_the_micro_batch_and_checkpointing_keeps_a_layer_input_each() -> None:
    small = _plan("llama-3-8b")["activations"]
    double = _plan("llama-3-8b", micro_batch=dataclasses.replace(SMALL, prompts=4))["activations"]
    assert 1.9 * small < double < 2.1 * small
    checkpointed = _plan("llama-3-8b", activation_checkpointing=True)["activations"]
    assert checkpointed < small / 4


def test_the_kv_cache_holds_keys_and_values_of_every_layer_per_token() -> None:
    config = preset("qwen2.5-7b")
    assert kv_bytes_per_token(config, DType.BFLOAT16) == 2 * 28 * 4 * 128 * 2
    assert _plan("qwen2.5-7b", kv_cache_tokens=10)["kv_cache"] == 10 * kv_bytes_per_token(
        config, DType.FLOAT32
    )
    assert _plan(engine=False)["kv_cache"] == _plan(engine=False)["engine_weights"] == 0


def test_a_72b_plan_allocates_nothing_and_takes_seconds() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    plan = plan_memory(
        "qwen2.5-72b",
        preset("qwen2.5-72b"),
        PlanSettings(Strategy.FSDP, 8, DType.BFLOAT16, MicroBatch(2, 4, 200, 256), kv_cache_tokens=4096),
    )
    assert time.perf_counter() - started < 20
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 512 * 1024  # the model alone would be 145 GB in bfloat16
    assert plan.total > 100 * 1024**3


def test_the_micro_batch_is_formed_as_the_learner_forms_it() -> None:
    assert MicroBatch.of(8, 4, 100, 50) == MicroBatch(2, 4, 100, 50)
    assert MicroBatch.of(8, 16, 100, 50) == MicroBatch(1, 8, 100, 50)  # a large group is split
    assert MicroBatch(2, 4, 100, 50).tokens == 2 * (100 + 4 * 50)
    assert MicroBatch.of(8, 4, 100, 50, max_tokens=600) == MicroBatch(2, 4, 100, 50)
    assert MicroBatch.of(8, 4, 100, 50, max_tokens=599) == MicroBatch(1, 4, 100, 50)
    assert MicroBatch.of(8, 4, 100, 50, max_tokens=250) == MicroBatch(1, 3, 100, 50)  # the group split
    assert MicroBatch.of(8, 4, 100, 50, max_tokens=10) == MicroBatch(1, 1, 100, 50)  # one sample alone


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"world_size": 0}, "world_size = 0: expected at least 1"),
        ({"world_size": 2}, "strategy = 'single' runs one process, world_size = 2"),
        ({"kv_cache_tokens": -1}, "kv_cache_tokens = -1"),
    ],
)
def test_bad_settings_are_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _plan(**changes)


def test_an_empty_micro_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match="micro-batch completion_tokens = 0"):
        MicroBatch(1, 1, 8, 0)
