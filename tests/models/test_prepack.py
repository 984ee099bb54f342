"""Projections through oneDNN with packed weights: values, row invariance, gradients, and when the packed
copy is rebuilt."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tether.engine.model_runner import ModelRunner, SequenceChunk, make_batch
from tether.kernels import cpu
from tether.kernels.cpu import CpuFeature
from tether.models import load, prepack
from tether.models.layers import BATCH_INVARIANT_ROWS, Linear, stacked_projections

pytestmark = pytest.mark.skipif(CpuFeature.ONEDNN not in cpu.detected(), reason="torch built without oneDNN")


def layer(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(in_features, out_features, bias=bias)


@pytest.mark.parametrize(("features", "bias"), [((64, 96), False), ((96, 40), True), ((7, 5), True)])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_packed_projection_equals_f_linear(features: tuple[int, int], bias: bool, rows: int) -> None:
    in_features, out_features = features
    linear = layer(in_features, out_features, bias)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        packed = linear(x)
        linear.prepacked = False
        plain = linear(x)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def test_packed_projection_keeps_leading_dimensions() -> None:
    linear = layer(32, 48, bias=True)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        assert linear(x).shape == (2, 5, 48)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_rows_from_two_up_do_not_depend_on_the_rest_of_the_call() -> None:
    weight = torch.randn(1536, 576) * 0.05  # SmolLM2's MLP shapes, where MKL's rows were batch dependent
    packed = prepack.pack(weight)
    x = torch.randn(300, 576)
    whole = prepack.linear(x, packed, None)
    for start, rows in [(0, 2), (0, 3), (5, 17), (40, 64), (1, 299)]:
        assert torch.equal(prepack.linear(x[start : start + rows], packed, None), whole[start : start + rows])


def test_batch_invariant_layer_pads_to_the_rows_its_kernel_needs() -> None:
    linear = layer(576, 1536, bias=False)
    linear.batch_invariant = True
    assert linear.min_rows == prepack.PACKED_INVARIANT_ROWS
    x = torch.randn(9, 576)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(9)])
        assert torch.equal(alone, linear(x))
    linear.prepacked = False
    assert linear.min_rows == BATCH_INVARIANT_ROWS
    linear.batch_invariant = False
    assert linear.min_rows == 1


def test_gradients_equal_f_linears() -> None:
    linear = layer(24, 16, bias=True)
    x = torch.randn(2, 6, 24, requires_grad=True)
    upstream = torch.randn(2, 6, 16)
    (linear(x) * upstream).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None and linear.bias.grad is not None
    grads = (x.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone())
    x.grad = None
    linear.zero_grad()
    linear.prepacked = False
    (linear(x) * upstream).sum().backward()
    for ours, reference in zip(grads, (x.grad, linear.weight.grad, linear.bias.grad), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_training_sees_weights_changed_by_a_fused_optimizer() -> None:
    """Fused AdamW writes parameters without moving their version: a training forward packs every call."""
    linear = layer(16, 8, bias=False)
    optimizer = torch.optim.AdamW(linear.parameters(), lr=0.1, fused=True)
    x = torch.randn(4, 16)
    linear(x).sum().backward()
    optimizer.step()
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight), rtol=1e-5, atol=1e-5)


def test_cached_packing_follows_in_place_writes_and_new_tensors() -> None:
    linear = layer(16, 8, bias=False)
    linear.packed_cache = prepack.PackedWeight()
    x = torch.randn(4, 16)
    with torch.inference_mode():
        before = linear(x)
    with torch.no_grad():
        linear.weight.copy_(linear.weight * 2)  # what ModelRunner.update_weights does
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), before * 2, rtol=1e-5, atol=1e-5)
    linear.weight = torch.nn.Parameter(torch.zeros(8, 16))
    with torch.inference_mode():
        assert torch.equal(linear(x), torch.zeros(4, 8))


def test_a_cached_layer_can_be_copied_and_pickled() -> None:
    linear = layer(16, 8, bias=True)
    linear.packed_cache = prepack.PackedWeight()
    x = torch.randn(3, 16)
    with torch.inference_mode():
        expected = linear(x)  # fills the cache with an opaque oneDNN tensor
    for clone in (copy.deepcopy(linear), pickle.loads(pickle.dumps(linear))):
        with torch.inference_mode():
            assert torch.equal(clone(x), expected)


def test_pack_rejects_what_onednn_cannot_pack() -> None:
    with pytest.raises(ValueError, match=r"cannot prepack a torch\.int8 weight"):
        prepack.pack(torch.zeros(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="expected a 2-d CPU tensor"):
        prepack.pack(torch.zeros(4))


def test_pack_refuses_bfloat16_on_a_cpu_without_onednns_bf16_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    # What `mkldnn_reorder_linear_weight` died of on an AVX2-only AMD EPYC; now refused before it is called.
    monkeypatch.setattr(cpu, "detected", lambda: frozenset({CpuFeature.ONEDNN, CpuFeature.AVX2_FMA}))
    weight = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert not prepack.supports(weight)
    with pytest.raises(ValueError, match=r"this CPU and torch build pack: float32$"):
        prepack.pack(weight)


ALL = frozenset(CpuFeature)
AVX2_ONLY = frozenset({CpuFeature.AVX2_FMA, CpuFeature.ONEDNN})  # an AMD EPYC without AVX-512


@pytest.mark.parametrize(
    ("features", "dtype", "kernel"),
    [
        (ALL, torch.float32, prepack.ProjectionKernel.ONEDNN_PACKED),
        (ALL, torch.bfloat16, prepack.ProjectionKernel.ONEDNN_PACKED),
        (AVX2_ONLY, torch.float32, prepack.ProjectionKernel.ONEDNN_PACKED),
        (AVX2_ONLY, torch.bfloat16, prepack.ProjectionKernel.TORCH_LINEAR),
        (frozenset(), torch.float32, prepack.ProjectionKernel.TORCH_LINEAR),
        (frozenset({CpuFeature.ONEDNN_BF16}), torch.bfloat16, prepack.ProjectionKernel.TORCH_LINEAR),
        (ALL, torch.float16, prepack.ProjectionKernel.TORCH_LINEAR),
        (ALL, torch.int8, prepack.ProjectionKernel.TORCH_LINEAR),
    ],
)
def test_projection_kernel_follows_the_cpu_features(
    features: frozenset[CpuFeature], dtype: torch.dtype, kernel: prepack.ProjectionKernel
) -> None:
    assert prepack.projection_kernel(features, dtype) is kernel


def test_model_switches_reach_every_projection(tiny_model: Callable[[str], Path]) -> None:
    model, _, config = load(tiny_model("llama"))
    projections = model.projections()
    assert len(projections) == 7 * config.num_layers + 1
    model.set_batch_invariant(True)
    assert model.min_rows == prepack.PACKED_INVARIANT_ROWS
    model.set_prepacked(False)
    assert model.min_rows == BATCH_INVARIANT_ROWS
    model.cache_packed_weights(True)
    assert all(isinstance(linear.packed_cache, prepack.PackedWeight) for linear in projections)
    model.cache_packed_weights(False)
    assert all(linear.packed_cache is None for linear in projections)


def test_engine_logits_follow_a_weight_update(tiny_model: Callable[[str], Path]) -> None:
    """The runner keeps packed weights; an update must reach them (against a plain F.linear model)."""
    model, _, _ = load(tiny_model("llama"))
    reference, _, _ = load(tiny_model("llama"))
    reference.set_prepacked(False)
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    plain = ModelRunner(reference, num_blocks=8, block_size=4)
    chunk = [SequenceChunk([1, 5, 9, 2], 0, [0])]
    runner.run(make_batch(chunk, 4, runner.device))  # packs every weight
    update = {name: torch.randn_like(tensor) for name, tensor in model.state_dict().items() if "proj" in name}
    runner.update_weights(update)
    plain.update_weights(update)
    ours = runner.run(make_batch(chunk, 4, runner.device))
    theirs = plain.run(make_batch(chunk, 4, plain.device))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_stacked_projections_change_no_bit(tiny_model: Callable[[str], Path], architecture: str) -> None:
    """An inference runner computes q/k/v and gate/up in one packed call each; the learner one per layer.
    Their rows must be equal bit for bit, or rollout and learner logprobs would drift apart."""
    model, _, _ = load(tiny_model(architecture))
    chunks = [SequenceChunk([3, 1, 4, 1, 5, 9, 2], 0, [0, 1]), SequenceChunk([2, 7], 0, [2])]
    runner = ModelRunner(model, num_blocks=4, block_size=4)  # caches on: stacked calls
    stacked = runner.run(make_batch(chunks, 4, runner.device))
    assert runner.model.model.layers[0].self_attn.qkv_cache is not None
    model.cache_packed_weights(False)  # one call per projection
    separate = runner.run(make_batch(chunks, 4, runner.device))
    assert torch.equal(stacked, separate)


def test_stacked_projections_fall_back_to_one_call_each() -> None:
    linears = [layer(8, 6, bias=True, seed=1), layer(8, 4, bias=True, seed=2)]
    x = torch.randn(3, 8)
    cache = prepack.PackedWeight()
    with torch.inference_mode():
        expected = [linear(x) for linear in linears]
        assert all(map(torch.equal, stacked_projections(x, linears, cache), expected))
        wrapped: list[torch.nn.Module] = [linears[0], torch.nn.Sequential(linears[1])]  # e.g. a LoRA wrapper
        assert all(map(torch.equal, stacked_projections(x, wrapped, cache), expected))
    x.requires_grad_(True)
    outputs = stacked_projections(x, linears, cache)  # training: one call each, differentiable
    assert all(out.grad_fn is not None for out in outputs)
