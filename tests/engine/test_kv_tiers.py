"""KV tiers on a tiny random model: blocks evicted from the device come back from host memory or from
the disk store (across engines, as after a restart) with the same greedy output, swapped-out KV comes
back bit-identical, and bad or foreign disk blocks are misses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tether.engine import EngineConfig
from tether.engine.block_manager import BlockManager
from tether.engine.config import PreemptionMode
from tether.engine.kv_tiers import KVTiers
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import ModelRunner
from tether.engine.sampling import SamplingParams
from tether.engine.scheduler import SchedulerOutput, SwapIn, SwapOut
from tether.engine.sequence import Sequence
from tether.engine.swap_cost import RateMeter
from tether.errors import ConfigError
from tether.kernels.kv_cache import KVCache
from tether.models import load
from tether.testing import make_tiny_model

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPT_A = [(7 * i + 3) % 90 + 5 for i in range(41)]  # 10 full blocks before the last token's
OTHERS = [[(11 * i + 5 * k) % 90 + 5 for i in range(41)] for k in range(1, 4)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", seed=0)


def make_engine(path: Path, num_blocks: int = 16, slow_prefill: bool = True, **options: Any) -> LLMEngine:
    """A device cache of `num_blocks` (one 48-token sequence at a time keeps evicting the last one's)."""
    model, _, _ = load(path)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        **options,
    )
    engine = LLMEngine(runner, config)
    if engine.tiers is not None and slow_prefill:
        # The tiny model prefills in microseconds: pretend it is slow so that restoring always pays.
        engine.tiers.prefill_rate = RateMeter.fixed(10.0)
    return engine


def greedy(engine: LLMEngine, prompt: list[int]) -> list[int]:
    return engine.generate([prompt], GREEDY)[0].completions[0].token_ids


def test_host_tier_serves_blocks_evicted_from_the_device_with_the_same_output(tiny_path: Path) -> None:
    expected = greedy(make_engine(tiny_path, num_blocks=64), PROMPT_A)
    engine = make_engine(tiny_path, kv_host_tier_mib=1)
    assert greedy(engine, PROMPT_A) == expected
    for prompt in OTHERS:  # each fills the device cache: A's blocks are evicted to the host tier
        greedy(engine, prompt)
    assert engine.block_manager.find_cached_prefix(engine_seq(engine, PROMPT_A)) == []
    output = engine.generate([PROMPT_A], GREEDY)[0]
    assert output.completions[0].token_ids == expected
    stats = engine.tier_stats()
    assert stats.host_hit_tokens == 40 and output.num_cached_tokens == 40
    assert stats.host_bytes_in == 10 * engine.tiers.block_bytes  # type: ignore[union-attr]
    assert stats.host_bytes_out > 0 and stats.disk_hit_tokens == 0


def test_without_tiers_the_evicted_prefix_is_computed_again(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    greedy(engine, PROMPT_A)
    for prompt in OTHERS:
        greedy(engine, prompt)
    assert engine.generate([PROMPT_A], GREEDY)[0].num_cached_tokens == 0
    assert engine.tiers is None and engine.tier_stats().host_hit_tokens == 0


def test_restoring_is_skipped_when_the_cost_model_says_recomputing_is_cheaper(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, kv_host_tier_mib=1)
    assert engine.tiers is not None
    engine.tiers.prefill_rate = RateMeter.fixed(1e12)
    greedy(engine, PROMPT_A)
    for prompt in OTHERS:
        greedy(engine, prompt)
    assert engine.generate([PROMPT_A], GREEDY)[0].num_cached_tokens == 0
    stats = engine.tier_stats()
    assert stats.host_hit_tokens == 0 and stats.recomputed_tokens >= 40


def test_disk_tier_serves_a_known_prefix_to_a_new_engine(tiny_path: Path, tmp_path: Path) -> None:
    expected = greedy(make_engine(tiny_path, num_blocks=64), PROMPT_A)
    first = make_engine(tiny_path, kv_disk_tier_dir=str(tmp_path))
    assert greedy(first, PROMPT_A) == expected
    assert first.tier_stats().disk_bytes_out > 0  # written through as the blocks were computed
    del first
    restarted = make_engine(tiny_path, kv_disk_tier_dir=str(tmp_path))
    output = restarted.generate([PROMPT_A], GREEDY)[0]
    assert output.completions[0].token_ids == expected
    assert output.num_cached_tokens == 40 and restarted.tier_stats().disk_hit_tokens == 40


def test_blocks_missing_from_the_host_tier_come_from_the_disk_tier(tiny_path: Path, tmp_path: Path) -> None:
    expected = greedy(make_engine(tiny_path, num_blocks=64), PROMPT_A)
    engine = make_engine(tiny_path, kv_host_tier_mib=1, kv_disk_tier_dir=str(tmp_path))
    assert engine.tiers is not None and engine.tiers.host is not None
    greedy(engine, PROMPT_A)
    for prompt in OTHERS:
        greedy(engine, prompt)
    engine.tiers.host.clear()  # as if A's blocks had been pushed out of the host tier long ago
    assert greedy(engine, PROMPT_A) == expected
    stats = engine.tier_stats()
    assert stats.disk_hit_tokens == 40 and stats.host_hit_tokens == 0


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign_tokens"])
def test_a_damaged_disk_block_is_a_miss_not_wrong_kv(tiny_path: Path, tmp_path: Path, damage: str) -> None:
    expected = greedy(make_engine(tiny_path, num_blocks=64), PROMPT_A)
    first = make_engine(tiny_path, kv_disk_tier_dir=str(tmp_path))
    greedy(first, PROMPT_A)
    assert first.tiers is not None and first.tiers.disk is not None
    folder = first.tiers.disk.directory
    seq = engine_seq(first, PROMPT_A)
    keys = first.block_manager.uncached_block_keys(seq, 0)
    path = folder / f"{keys[3][0].hex()}.kv"  # the fourth block: three are still found before it
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])
    else:  # another block's file under this block's name
        path.write_bytes((folder / f"{keys[4][0].hex()}.kv").read_bytes())
    restarted = make_engine(tiny_path, kv_disk_tier_dir=str(tmp_path))
    output = restarted.generate([PROMPT_A], GREEDY)[0]
    assert output.completions[0].token_ids == expected
    assert output.num_cached_tokens == 3 * BLOCK and restarted.tier_stats().disk_hit_tokens == 3 * BLOCK
    assert path.exists()  # the bad file was deleted, then the recomputed block written again


@pytest.mark.parametrize("change", ["weights", "dtype"])
def test_a_different_model_never_finds_the_blocks(
    tiny_path: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, change: str
) -> None:
    greedy(make_engine(tiny_path, kv_disk_tier_dir=str(tmp_path)), PROMPT_A)
    if change == "weights":
        other = make_engine(
            make_tiny_model(tmp_path_factory.mktemp("other"), "qwen3", seed=1), kv_disk_tier_dir=str(tmp_path)
        )
    else:
        model, _, _ = load(tiny_path, dtype=torch.bfloat16)
        runner = ModelRunner(model, num_blocks=16, block_size=BLOCK)
        other = LLMEngine(
            runner,
            EngineConfig(
                num_blocks=16,
                block_size=BLOCK,
                max_num_batched_tokens=64,
                max_model_len=64,
                kv_disk_tier_dir=str(tmp_path),
            ),
        )
    assert other.generate([PROMPT_A], GREEDY)[0].num_cached_tokens == 0
    assert other.tier_stats().disk_hit_tokens == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # one folder per model fingerprint


def test_disk_tier_stays_within_its_budget_least_recently_used_first(tiny_path: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_path, kv_disk_tier_dir=str(tmp_path), kv_disk_tier_mib=1)
    assert engine.tiers is not None and engine.tiers.disk is not None
    disk = engine.tiers.disk
    payload = torch.zeros(disk.block_shape, dtype=disk.dtype)
    for i in range(400):  # 400 blocks of ~4 KiB do not fit in 1 MiB
        disk.write(i.to_bytes(16, "little"), (i, i, i, i), payload)
    assert disk.used_bytes <= 2**20
    assert (0).to_bytes(16, "little") not in disk and (399).to_bytes(16, "little") in disk
    assert sum(p.stat().st_size for p in disk.directory.iterdir()) == disk.used_bytes


def test_swap_then_restore_returns_bit_identical_kv(tiny_path: Path) -> None:
    model, _, _ = load(tiny_path)
    config = EngineConfig(
        num_blocks=16,
        block_size=BLOCK,
        max_num_batched_tokens=64,
        max_model_len=64,
        kv_host_tier_mib=1,
        preemption_mode="swap",
    )
    cache = KVCache.allocate(model.config, 16, BLOCK)
    generator = torch.Generator().manual_seed(0)
    for tensor in (*cache.keys, *cache.values):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    tiers = KVTiers(config, cache, BlockManager.from_config(config), model.config)
    before = cache.gather_blocks([3, 7, 1])
    assert tiers.choose_preemption(seq_id=5, num_blocks=3, num_tokens=10) is PreemptionMode.SWAP
    tiers.apply(SchedulerOutput([], [5], [], swap_out=[SwapOut(5, [3, 7, 1], 10)]))
    for tensor in (*cache.keys, *cache.values):
        tensor.zero_()  # the freed blocks are written by other sequences
    tiers.apply(SchedulerOutput([], [], [], swap_in=[SwapIn(5, [9, 0, 12])]))
    after = cache.gather_blocks([9, 0, 12])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert tiers.host is not None and tiers.host.num_used == 0  # the slots are free again


def test_auto_preemption_swaps_when_moving_is_cheaper_and_recomputes_when_not(tiny_path: Path) -> None:
    engine = make_engine(tiny_path, kv_host_tier_mib=1, preemption_mode="auto")
    tiers = engine.tiers
    assert tiers is not None
    tiers.prefill_rate, tiers.host_rate = RateMeter.fixed(10.0), RateMeter.fixed(1e9)
    assert tiers.choose_preemption(1, 4, 16) is PreemptionMode.SWAP
    tiers.prefill_rate, tiers.host_rate = RateMeter.fixed(1e9), RateMeter.fixed(10.0)
    assert tiers.choose_preemption(2, 4, 16) is PreemptionMode.RECOMPUTE
    tiers.prefill_rate, tiers.host_rate = RateMeter.fixed(10.0), RateMeter.fixed(1e9)
    assert tiers.choose_preemption(3, 10_000, 16) is PreemptionMode.RECOMPUTE  # no host room for it


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swapping_preemption_loses_no_request_and_keeps_the_output(tiny_path: Path, mode: str) -> None:
    prompts = [PROMPT_A[:13], *(p[:13] for p in OTHERS)]
    params = SamplingParams(max_tokens=24, temperature=0)
    reference = make_engine(tiny_path, num_blocks=64).generate(prompts, params)
    engine = make_engine(tiny_path, kv_host_tier_mib=1, preemption_mode=mode)
    outputs = engine.generate(prompts, params)
    assert [o.completions[0].token_ids for o in outputs] == [o.completions[0].token_ids for o in reference]
    stats = engine.tier_stats()
    assert stats.swap_preemptions > 0 and stats.host_bytes_in > 0
    assert engine.tiers is not None and engine.tiers.host is not None and engine.tiers.host.room > 0


def test_a_host_tier_too_small_for_one_block_is_refused(tiny_path: Path) -> None:
    model, _, _ = load(tiny_path)
    runner = ModelRunner(model, num_blocks=16, block_size=2048)  # 2 MiB blocks
    config = EngineConfig(
        num_blocks=16, block_size=2048, max_model_len=64, kv_host_tier_mib=1, attention_block_tokens=2048
    )  # attention tiles are whole blocks
    with pytest.raises(ConfigError, match="kv_host_tier_mib = 1 holds no KV block"):
        LLMEngine(runner, config)


def test_an_unusable_disk_dir_is_refused(tiny_path: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"kv_disk_tier_dir = .*cannot create it"):
        make_engine(tiny_path, kv_disk_tier_dir=str(blocker))


def engine_seq(engine: LLMEngine, prompt: list[int]) -> Sequence:
    """A probe with `prompt`'s tokens, to look its blocks up in the engine's caches."""
    return Sequence(10_000, "probe", prompt)


class _Shape:
    """A cache whose 16-token blocks are 128 KiB: a 1 MiB host tier holds 8 of them."""

    num_layers = 2
    num_kv_heads = 8
    head_dim = 64


def test_a_full_host_tier_moves_its_oldest_blocks_to_disk_and_all_come_back_intact(tmp_path: Path) -> None:
    config = EngineConfig(
        num_blocks=16,
        block_size=16,
        max_num_batched_tokens=64,
        max_model_len=256,
        kv_host_tier_mib=1,
        kv_disk_tier_dir=str(tmp_path),
    )
    cache = KVCache.allocate(_Shape(), 16, 16)
    generator = torch.Generator().manual_seed(0)
    for tensor in (*cache.keys, *cache.values):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    manager = BlockManager.from_config(config)
    tiers = KVTiers(config, cache, manager, _Shape(), "fingerprint")
    tiers.prefill_rate = RateMeter.fixed(1.0)
    assert tiers.host is not None and tiers.host.capacity_blocks == 8 and tiers.disk is not None
    seq = Sequence(0, "a", list(range(12 * 16 + 1)))
    keys = manager.uncached_block_keys(seq, 0)
    imported = manager.import_cached_blocks([], keys)  # as if the 12 blocks had been computed
    block_ids = [imported[i] for i in range(12)]
    original = cache.gather_blocks(block_ids)
    filler = Sequence(1, "b", list(range(1000, 1000 + 16 * 16)))
    manager.allocate(filler, 16 * 16)  # takes every block: the 12 are evicted
    tiers.apply_evictions()
    assert tiers.host.num_used == 8 and len(tiers.disk) == 4  # the host tier is full: 4 went to disk
    manager.free(filler)
    other = Sequence(2, "c", list(range(5000, 5000 + 4 * 16 + 1)))
    manager.import_cached_blocks([], manager.uncached_block_keys(other, 0))
    manager.allocate(filler, 16 * 16)  # evicts other's 4 blocks: the host's 4 oldest move to disk
    tiers.apply_evictions()
    assert tiers.host.num_used == 8 and len(tiers.disk) == 8
    manager.free(filler)
    for tensor in (*cache.keys, *cache.values):
        tensor.zero_()
    tiers.promote([seq])
    restored = manager.find_cached_prefix(seq)
    assert len(restored) == 12
    assert all(torch.equal(a, b) for a, b in zip(original, cache.gather_blocks(restored), strict=True))
    stats = tiers.stats(0, 0, 0, 0)
    assert (stats.host_hit_tokens, stats.disk_hit_tokens) == (4 * 16, 8 * 16)


class _SmallShape:
    num_layers = 2
    num_kv_heads = 1
    head_dim = 8


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_long_prefix_comes_back_in_one_batched_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str
) -> None:
    blocks = 1100  # a 17,600-token prefix of 16-token blocks
    config = EngineConfig(
        num_blocks=2 * blocks,
        block_size=16,
        max_num_batched_tokens=512,
        max_model_len=16 * blocks + 16,
        kv_host_tier_mib=8 if tier == "host" else 0,
        kv_disk_tier_dir=str(tmp_path) if tier == "disk" else None,
    )
    cache = KVCache.allocate(_SmallShape(), 2 * blocks, 16)
    manager = BlockManager.from_config(config)
    tiers = KVTiers(config, cache, manager, _SmallShape(), "fingerprint")
    tiers.prefill_rate = RateMeter.fixed(1.0)
    seq = Sequence(0, "long", list(range(16 * blocks + 1)))
    manager.allocate(seq, seq.num_tokens)  # computed as a prefill would
    seq.num_computed_tokens = seq.num_tokens
    for tensor in (*cache.keys, *cache.values):
        tensor.normal_()
    manager.cache_full_blocks(seq)
    original = cache.gather_blocks(seq.block_table[:blocks])
    tiers.persist_new_blocks()  # written through to the disk tier, if any
    manager.free(seq)
    seq.num_computed_tokens = 0
    filler = Sequence(1, "filler", list(range(10**6, 10**6 + 16 * 2 * blocks)))
    manager.allocate(filler, 16 * 2 * blocks)  # evicts the whole prefix
    tiers.apply_evictions()
    manager.free(filler)
    scatters: list[int] = []
    scatter = KVCache.scatter_blocks

    def counting(self: KVCache, block_ids: list[int], data: list[torch.Tensor]) -> None:
        scatters.append(len(block_ids))
        scatter(self, block_ids, data)

    monkeypatch.setattr(KVCache, "scatter_blocks", counting)
    tiers.promote([seq])
    assert scatters == [blocks]  # one index_copy_ per layer tensor for all the blocks
    restored = manager.find_cached_prefix(seq)
    assert all(torch.equal(a, b) for a, b in zip(original, cache.gather_blocks(restored), strict=True))


def test_a_failing_disk_write_costs_the_block_not_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tether.engine.kv_disk import DiskBlockStore

    disk = DiskBlockStore(tmp_path, "fingerprint", 2**20, (4, 4, 2, 32), torch.float32)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tether.engine.kv_disk.os.replace", full)
    assert disk.write(b"k" * 16, (1, 2, 3, 4), torch.zeros(4, 4, 2, 32)) == 0
    assert b"k" * 16 not in disk and disk.used_bytes == 0
    assert list(disk.directory.iterdir()) == []  # no temporary left behind
