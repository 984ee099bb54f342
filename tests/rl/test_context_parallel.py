"""Context parallelism: ring attention over 2 and 4 gloo ranks equals one-rank attention (outputs and
q/k/v gradients), the tiny model's logprobs and parameter gradients equal the dense forward's, a learner
step over context-parallel ranks equals the single learner's, and bad layouts are refused."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import start_processes

from tether.errors import ConfigError
from tether.models import load
from tether.models.dense import DenseBatch
from tether.models.dense import token_logprobs as dense_logprobs
from tether.models.memory_plan import Strategy
from tether.rl.cluster_sections import LearnerSection
from tether.rl.config import parse_config
from tether.rl.context_parallel import TILE_TOKENS, ContextLayout, RingGroup, ring_attention, token_logprobs
from tether.rl.parity import compare_with_single
from tether.rl.sections import OptimSection
from tether.web import free_port

from .test_fsdp import _run
from .test_resume import _stable
from .test_trainer import tiny_config

_TIMEOUT_S = 60.0  # a rank left waiting by a failed one gives up instead of hanging the suite


def _join(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=_TIMEOUT_S),
    )


def _run_ranks(rank: Callable[..., None], world_size: int, *args: object) -> None:
    """`rank(r, world_size, port, *args)` in `world_size` processes; a failure in any fails the test and
    ends the others. Forked, not spawned: a child starts with this process's imports (a spawned one
    re-imports torch and tether, seconds each on a shared machine)."""
    start_processes(  # type: ignore[no-untyped-call]
        rank, args=(world_size, free_port(), *args), nprocs=world_size, start_method="fork"
    )


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DenseBatch, scale: float
) -> torch.Tensor:
    """One-rank attention of the flat tokens of `batch` with the full [T, T] mask of its documents."""
    rows, width = batch.input_ids.shape
    mask = torch.eye(rows * width, dtype=torch.bool)  # padding sees itself only
    for d in batch.documents:
        base = d.row * width
        for i in range(d.length):
            query = base + d.start + i
            mask[query, base + d.context_start : base + d.context_start + d.context_length] = True
            mask[query, base + d.start : query + 1] = True
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def _cases() -> list[tuple[str, DenseBatch]]:
    return [
        ("causal, odd length", DenseBatch.padded([list(range(37))])),
        ("shorter than two chunks a rank", DenseBatch.padded([list(range(5))])),
        ("packed documents, odd lengths", DenseBatch.packed([[1] * 7, [2] * 3, [3] * 11, [4] * 2], 13)),
        ("padded rows", DenseBatch.padded([[1] * 9, [2] * 4, [3] * 6])),
        ("shared prompts", DenseBatch.shared_prefix([([1] * 6, [[2] * 3, [3] * 5]), ([4] * 3, [[5] * 7])])),
    ]


def _check_ring(ring: RingGroup) -> None:
    """Every case's ring attention on `ring` against one-rank attention of the whole sequence, in whole
    chunks and in 3-token tiles (tile boundaries inside chunks and documents)."""
    for (name, batch), tile_tokens in itertools.product(_cases(), (TILE_TOKENS, 3)):
        tokens = batch.input_ids.numel()
        generator = torch.Generator().manual_seed(tokens)
        q, k, v = (torch.randn(tokens, heads, 8, generator=generator) for heads in (4, 2, 2))
        weights = torch.randn(tokens, 4, 8, generator=generator)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = _reference(full[0], full[1], full[2], batch, 0.35)
        torch.autograd.backward((expected * weights).sum())
        layout = ContextLayout.of(batch, ring.size, tile_tokens)
        mine = layout.indices(ring.rank)
        held = torch.where(mine < tokens, mine, 0)
        real = (mine < tokens) & (batch.segments.reshape(-1)[held] > 0)  # a row's padding: unseen
        local = [t[held].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(local[0], local[1], local[2], layout, ring, 0.35)
        torch.autograd.backward((out[real] * weights[mine[real]]).sum())
        where = f"{name}, rank {ring.rank} of {ring.size}, {tile_tokens}-token tiles"
        torch.testing.assert_close(out[real], expected[mine[real]], atol=1e-5, rtol=1e-5, msg=where)
        for got, want, which in zip(local, full, "qkv", strict=True):
            assert got.grad is not None and want.grad is not None
            torch.testing.assert_close(
                got.grad[real], want.grad[mine[real]], atol=1e-5, rtol=1e-5, msg=f"{where}: d{which}"
            )


def _ring_rank(rank: int, world_size: int, port: int) -> None:
    _join(rank, world_size, port)
    try:
        with pytest.raises(ConfigError, match="context_parallel = 3 does not divide the 4 learner ranks"):
            RingGroup.open(3, _TIMEOUT_S)  # refused before any collective: every rank refuses alike
        _check_ring(RingGroup.open(4, _TIMEOUT_S))
        pair = RingGroup.open(2, _TIMEOUT_S)  # ranks 0-1 and 2-3: two rings side by side
        assert pair.members == ((0, 1) if rank < 2 else (2, 3))
        _check_ring(pair)
    finally:
        dist.destroy_process_group()


def test_ring_attention_over_4_and_over_2_ranks_equals_one_rank_attention_with_gradients() -> None:
    # Causal and document masks, shared prompts, padding, odd lengths, grouped-query heads; fp32. One
    # set of 4 processes: a ring of 4, then two rings of 2 (the layout of data x context parallel).
    _run_ranks(_ring_rank, 4)


def _model_rank(rank: int, world_size: int, port: int, model_path: str) -> None:
    _join(rank, world_size, port)
    try:
        ring = RingGroup.open(world_size, _TIMEOUT_S)
        batch = DenseBatch.shared_prefix(
            [([5, 9, 13, 2, 7], [[3, 8, 1], [4, 4, 6, 11, 2]]), ([1, 2, 3], [[9, 9, 9, 9]])]
        )
        targets = [(5, 8), (5, 10), (3, 7)]
        model = load(model_path)[0].train().requires_grad_(True)
        single = load(model_path)[0].train().requires_grad_(True)
        got = token_logprobs(model, batch, targets, 0.7, ring)
        want = dense_logprobs(single, batch, targets, 0.7)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        # A loss every rank computes alike from the logprobs; each rank's gradient is its tokens' part.
        scale = torch.linspace(-1, 1, sum(len(t) for t in got))
        torch.autograd.backward((torch.cat(got) * scale).sum())
        torch.autograd.backward((torch.cat(want) * scale).sum())
        for (name, param), reference in zip(model.named_parameters(), single.parameters(), strict=True):
            assert param.grad is not None and reference.grad is not None, name
            summed = param.grad.clone()
            dist.all_reduce(summed, group=ring.group)
            torch.testing.assert_close(summed, reference.grad, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_tiny_model_logprobs_and_gradients_over_two_ranks_equal_the_dense_forward(
    tiny_model: Callable[[str], Path], architecture: str
) -> None:
    _run_ranks(_model_rank, 2, str(tiny_model(architecture)))


def _saved_for_backward(run: Callable[[], list[torch.Tensor]]) -> int:
    """Bytes of the tensors autograd saves for backward while `run` computes (then its backward runs)."""
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs = run()
    torch.autograd.backward(torch.cat(logprobs).sum())
    return saved[0]


def _long_sequence() -> tuple[DenseBatch, list[tuple[int, int]]]:
    tokens = torch.randint(0, 200, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    return DenseBatch.padded([tokens]), [(1, len(tokens))]


def _memory_rank(rank: int, world_size: int, port: int, model_path: str, single_bytes: int) -> None:
    _join(rank, world_size, port)
    try:
        ring = RingGroup.open(world_size, _TIMEOUT_S)
        model = load(model_path)[0].train().requires_grad_(True)
        batch, targets = _long_sequence()
        mine = _saved_for_backward(lambda: token_logprobs(model, batch, targets, 1.0, ring))
        assert mine <= 0.55 * single_bytes, (mine, single_bytes)
    finally:
        dist.destroy_process_group()


def test_each_of_two_ranks_saves_about_half_of_what_one_rank_saves_for_backward(
    tiny_model: Callable[[str], Path],
) -> None:
    # One 1,024-token sequence: the ring saves q, k, v, output and log-sum-exp of a rank's own tokens,
    # never scores (measured at 8,192 tokens: 117.1 MiB on one rank, 60.9 a rank over 2, 30.6 over 4).
    model_path = str(tiny_model("llama"))
    model = load(model_path)[0].train().requires_grad_(True)
    batch, targets = _long_sequence()
    single = _saved_for_backward(lambda: dense_logprobs(model, batch, targets, 1.0))
    _run_ranks(_memory_rank, 2, model_path, single)


def test_learner_steps_over_context_parallel_ranks_equal_the_single_learner(
    tiny_model: Callable[[str], Path],
) -> None:
    # Two ranks holding halves of every micro-batch's row (FSDP shards over both), two steps.
    learner = LearnerSection(strategy=Strategy.FSDP, world_size=2, context_parallel=2)
    result = compare_with_single(
        tiny_model("llama"),
        steps=2,
        optim=OptimSection(lr=1e-4, micro_batch=2),
        prompts=3,
        learner=learner,
        start_method="fork",
    )
    print(result)
    assert result["fsdp2_max_loss_diff_vs_single"] < 1e-5
    assert result["fsdp2_max_stat_diff_vs_single"] < 1e-4  # grad_norm among them: the gradients agree
    assert result["fsdp2_max_abs_diff_vs_single"] < 1e-5


def test_data_and_context_parallel_ranks_together_equal_the_single_learner(
    tiny_model: Callable[[str], Path],
) -> None:
    # Two data groups of two context ranks, three prompt groups: one data group runs out first and keeps
    # stepping the collectives with an empty micro-batch, over its ring too.
    learner = LearnerSection(strategy=Strategy.FSDP, world_size=4, context_parallel=2)
    result = compare_with_single(
        tiny_model("llama"),
        steps=2,
        world_size=4,
        optim=OptimSection(lr=1e-4, micro_batch=2),
        prompts=3,
        learner=learner,
        start_method="fork",
    )
    print(result)
    assert result["fsdp2_max_loss_diff_vs_single"] < 1e-5
    assert result["fsdp2_max_stat_diff_vs_single"] < 1e-4
    assert result["fsdp2_max_abs_diff_vs_single"] < 1e-5


@pytest.mark.parametrize(
    ("learner", "message"),
    [
        (
            {"strategy": "fsdp", "world_size": 4, "context_parallel": 3},
            "context_parallel = 3 does not divide",
        ),
        ({"context_parallel": 2}, "context_parallel = 2 with learner.strategy = 'single'"),
        ({"strategy": "fsdp", "world_size": 2, "context_parallel": 0}, "learner.context_parallel"),
    ],
)
def test_bad_context_parallel_layouts_are_named(learner: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"envs": {"weights": {"test/vowels": 1.0}}, "learner": learner})


def test_context_parallel_on_ray_learner_actors_is_refused() -> None:
    learner = {"strategy": "fsdp", "world_size": 2, "context_parallel": 2}
    with pytest.raises(ConfigError, match=r"context_parallel = 2 with run\.backend = 'ray'"):
        parse_config(
            {
                "envs": {"weights": {"test/vowels": 1.0}},
                "learner": learner,
                "run": {"backend": "ray"},
                "rollout": {"backend": "ray"},
            }
        )


def test_a_forward_shorter_than_the_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match="a 3-token forward cannot be split over context_parallel = 4"):
        ContextLayout.of(DenseBatch.padded([[1, 2, 3]]), 4)


def test_the_zigzag_layout_gives_each_rank_a_chunk_from_each_end() -> None:
    layout = ContextLayout.of(DenseBatch.padded([list(range(13))]), 2)  # 13 tokens -> 4 chunks of 4
    assert layout.chunk == 4
    assert layout.indices(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.indices(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # Padding tokens see only themselves; the real ones never see them.
    seen = layout.visible(torch.arange(16), torch.arange(16))
    assert seen[13].tolist() == [j == 13 for j in range(16)]
    assert not seen[:13, 13:].any()


@pytest.mark.slow
def test_a_training_run_with_context_parallel_ranks_matches_the_single_learner(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    # The whole path: `tether train`'s config, rank 1 started by the trainer, KL to the frozen reference
    # (its logprobs also computed over the ring).
    sections: dict[str, Mapping[str, object]] = {
        "optim": {"lr": 1e-5, "micro_batch": 3},
        "run": {"steps": 2},
        "algorithm": {"kl_coef": 0.1},
    }
    model = tiny_model("llama")
    _, expected = _run(tiny_config(model, tmp_path / "single", **sections))
    context = {"strategy": "fsdp", "world_size": 2, "context_parallel": 2}
    _, got = _run(tiny_config(model, tmp_path / "ring", learner=context, **sections))
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for a, b in zip(got, expected, strict=True):
        assert _stable(a) == pytest.approx(_stable(b), abs=1e-5)
