"""int8 weight-only quantization: exact per-channel scales, logits close to float, re-quantizing updates,
and a small perplexity cost on the real SmolLM2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tether.engine.bench import perplexity
from tether.engine.model_runner import ModelRunner, SequenceChunk
from tether.errors import ConfigError
from tether.models import CausalLM, QuantizationError, QuantizedLinear, load, update_quantized_weights
from tether.models.layers import stacked_projections
from tether.models.quantize import REFERENCE_TEXT, quantize_weight
from tether.testing import make_tiny_model

ARCHITECTURES = ["llama", "qwen2", "qwen3"]


def last_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    return runner.step([SequenceChunk(tokens, 0, list(range(8)))])[0]


def test_per_channel_scales_are_exact_for_a_crafted_weight() -> None:
    weight = torch.tensor([[1.27, -0.5, 0.0], [0.0, 0.0, 0.0], [-2.54, 1.0, 0.02]])
    q, scale = quantize_weight(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([0.01, 1.0, 0.02]))
    assert q.tolist() == [[127, -50, 0], [0, 0, 0], [-127, 50, 1]]


def test_the_packed_copy_follows_a_replaced_or_overwritten_weight() -> None:
    torch.manual_seed(1)
    layer = QuantizedLinear.from_linear(nn.Linear(24, 40, bias=True))
    x = torch.randn(3, 24)

    def expected() -> torch.Tensor:
        return x @ layer.dequantize().T + layer.bias  # type: ignore[operator]

    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected())
        assert layer.packed_copies == 1
        layer.set_weight(torch.randn(40, 24))  # a weight update: new tensors
        torch.testing.assert_close(layer(x), expected())
        layer.qweight.mul_(-1)  # an in-place write (load_state_dict): the version moves
        torch.testing.assert_close(layer(x), expected())


def test_stacked_int8_projections_equal_one_call_each_and_follow_updates() -> None:
    torch.manual_seed(2)
    layers = [QuantizedLinear.from_linear(nn.Linear(16, n, bias=False)) for n in (24, 8, 8)]
    x = torch.randn(5, 16)
    with torch.inference_mode():
        stacked = stacked_projections(x, layers, None)
        assert all(torch.equal(s, layer(x)) for s, layer in zip(stacked, layers, strict=True))
        layers[2].set_weight(torch.randn(8, 16))
        assert torch.equal(stacked_projections(x, layers, None)[2], layers[2](x))


def test_quantized_linear_matches_its_dequantized_float_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 16, bias=True)
    quantized = QuantizedLinear.from_linear(linear)
    x = torch.randn(5, 32)
    reference = x @ quantized.dequantize().T + linear.bias
    torch.testing.assert_close(quantized(x), reference, rtol=1e-5, atol=1e-5)
    assert (quantized.dequantize() - linear.weight).abs().max() <= quantized.scale.max() / 2 + 1e-7


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_int8_logits_are_close_to_float(architecture: str, tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model(architecture)
    float_model, _, config = load(folder)
    int8_model, _, _ = load(folder, quantization="int8")
    tokens = [(7 * i + 3) % config.vocab_size for i in range(20)]
    expected, got = last_logits(float_model, tokens), last_logits(int8_model, tokens)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert int(got.argmax()) == int(expected.argmax())
    blocks = [m for m in int8_model.model.layers.modules() if isinstance(m, nn.Linear | QuantizedLinear)]
    assert blocks and all(isinstance(m, QuantizedLinear) for m in blocks)
    assert isinstance(int8_model.lm_head, nn.Linear), "the output head stays in float"
    assert int8_model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("method", ["int4", "INT8", "", "fp8"])
def test_unknown_quantization_is_refused_naming_the_accepted_ones(
    method: str, tiny_model: Callable[[str], Path]
) -> None:
    with pytest.raises(ConfigError, match=r"quantization = .*expected one of 'int8'"):
        load(tiny_model("llama"), quantization=method)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_weight_update_requantizes_float_weights(
    architecture: str, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Updating a quantized model with another checkpoint's float weights equals loading that one in int8."""
    model, _, config = load(tiny_model(architecture), quantization="int8")
    other = make_tiny_model(tmp_path, architecture, seed=1)
    other_float, _, _ = load(other)
    other_int8, _, _ = load(other, quantization="int8")
    count = update_quantized_weights(model, other_float.state_dict())
    assert count == len(other_float.state_dict())
    tokens = [(5 * i + 1) % config.vocab_size for i in range(12)]
    torch.testing.assert_close(last_logits(model, tokens), last_logits(other_int8, tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "shape", "dtype", "message"),
    [
        ("model.layers.0.self_attn.q_proj.qweight", (64, 64), torch.float32, "unknown parameter"),
        ("model.layers.0.mlp.gate_proj.weight", (64, 128), torch.float32, "has shape"),
        ("model.layers.0.mlp.gate_proj.weight", (128, 64), torch.int8, "expected a float tensor"),
        ("model.norm.weight", (65,), torch.float32, "has shape"),
    ],
)
def test_weight_update_refuses_bad_tensors_before_changing_anything(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    message: str,
    tiny_model: Callable[[str], Path],
) -> None:
    model, _, _ = load(tiny_model("llama"), quantization="int8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = ("model.layers.1.mlp.up_proj.weight", torch.zeros(128, 64))
    with pytest.raises(QuantizationError, match=message):
        update_quantized_weights(model, [good, (name, torch.zeros(shape, dtype=dtype))])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_int8_perplexity_delta_is_small_on_smollm2(smollm2_folder: Path) -> None:
    float_model, tokenizer, _ = load(smollm2_folder)
    int8_model, _, _ = load(smollm2_folder, quantization="int8")
    tokens = [int(t) for t in tokenizer.encode(REFERENCE_TEXT, add_special_tokens=False)]
    float_ppl, int8_ppl = perplexity(float_model, tokens), perplexity(int8_model, tokens)
    assert 1 < float_ppl < 100, float_ppl
    assert abs(int8_ppl - float_ppl) < 0.05 * float_ppl, (float_ppl, int8_ppl)


def test_w8a8_layers_kernel_matches_its_torch_fallback_and_stacks_as_one_call_each() -> None:
    torch.manual_seed(3)
    layers = [QuantizedLinear.from_linear(nn.Linear(64, n, bias=True), dynamic=True) for n in (40, 8)]
    x = torch.randn(5, 64)
    with torch.inference_mode():
        kernel = [layer(x) for layer in layers]
        stacked = stacked_projections(x, layers, None)
    assert all(torch.equal(s, k) for s, k in zip(stacked, kernel, strict=True))
    fallback = [layer(x.requires_grad_()) for layer in layers]  # autograd: the torch reference
    for out, expected in zip(kernel, fallback, strict=True):
        torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-5)
    weight_only = x.detach() @ layers[0].dequantize().T + layers[0].bias
    assert not torch.allclose(kernel[0], weight_only, rtol=0, atol=1e-6)  # the rows were rounded too


def test_w8a8_perplexity_delta_is_small_on_smollm2(smollm2_folder: Path) -> None:
    float_model, tokenizer, _ = load(smollm2_folder)
    w8a8_model, _, _ = load(smollm2_folder, quantization="w8a8")
    assert all(m.dynamic for m in w8a8_model.modules() if isinstance(m, QuantizedLinear))
    tokens = [int(t) for t in tokenizer.encode(REFERENCE_TEXT, add_special_tokens=False)]
    float_ppl, w8a8_ppl = perplexity(float_model, tokens), perplexity(w8a8_model, tokens)
    assert abs(w8a8_ppl - float_ppl) < 0.05 * float_ppl, (float_ppl, w8a8_ppl)


def test_w8a8_quantizes_the_head_and_a_tied_heads_copy_follows_an_embedding_update(
    tiny_model: Callable[[str], Path],
) -> None:
    model, _, config = load(tiny_model("llama"), quantization="w8a8")
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.dynamic
    assert config.tie_word_embeddings
    embedding = torch.randn_like(model.model.embed_tokens.weight)
    before = model.lm_head.qweight.clone()
    update_quantized_weights(model, [("model.embed_tokens.weight", embedding)])
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    expected = QuantizedLinear(embedding.shape[1], embedding.shape[0])
    expected.set_weight(embedding)
    assert not torch.equal(model.lm_head.qweight, before)
    assert torch.equal(model.lm_head.qweight, expected.qweight)
    assert torch.equal(model.lm_head.scale, expected.scale)
