"""Building blocks shared by every supported decoder: RMSNorm, rotary position embedding, SwiGLU MLP.

Numerics follow the Hugging Face reference (norms and rotary angles in float32) so that logits match it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tether.models import prepack
from tether.models.config import RopeScaling, RopeType
from tether.models.quantized_linear import QuantizedLinear, stacked_int8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _exponents(head_dim: int) -> torch.Tensor:
    # On the CPU even while the model is built on the meta device (`RotaryEmbedding`).
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim


def _default_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(head_dim))


def _linear_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    return _default_frequencies(head_dim, theta, scaling) / scaling.factor


def _dynamic_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """NTK-aware base for a sequence of `factor` x the original length (`RopeScaling`: fixed, as a KV
    cache needs), in float32 as transformers computes it in its forward."""
    original = scaling.original_length
    longest = torch.tensor(int(original * scaling.factor), device="cpu")
    stretch = (scaling.factor * longest / original) - (scaling.factor - 1)
    base = theta * stretch ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** _exponents(head_dim))


def _yarn_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Interpolated (divided by `factor`) for dimensions that turn fewer than `beta_slow` times over the
    original length, kept for those that turn more than `beta_fast` times, ramped linearly between."""

    def correction_dim(rotations: float) -> float:
        turns = scaling.original_length / (rotations * 2 * math.pi)
        return (head_dim * math.log(turns)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)
    positional = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolated, interpolated = 1.0 / positional, 1.0 / (scaling.factor * positional)
    kept = 1 - ramp
    return interpolated * (1 - kept) + extrapolated * kept


def _llama3_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = _default_frequencies(head_dim, theta, scaling)
    old_len = scaling.original_length
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


# One function per rope type, each transformers 5.24's `_compute_*_parameters` step for step (the same
# float32 operations in the same order, so the angles match it to the bit where it can).
ROPE_FREQUENCIES: dict[RopeType, Callable[[int, float, RopeScaling], torch.Tensor]] = {
    RopeType.DEFAULT: _default_frequencies,
    RopeType.LINEAR: _linear_frequencies,
    RopeType.DYNAMIC: _dynamic_frequencies,
    RopeType.YARN: _yarn_frequencies,
    RopeType.LLAMA3: _llama3_frequencies,
}


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of `scaling` (resolved: `ModelConfig` does it)."""
    assert isinstance(scaling.rope_type, RopeType)
    return ROPE_FREQUENCIES[scaling.rope_type](head_dim, theta, scaling)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their absolute positions (the non-interleaved `rotate_half` layout)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        # Computed lazily per device: no buffer, so the model can be built on the meta device and loaded.
        self._inv_freq_cpu = inverse_frequencies(head_dim, theta, scaling)
        self._by_device: dict[torch.device, torch.Tensor] = {}
        self.attention_scaling = scaling.attention_scaling
        """cos and sin are multiplied by it (yarn's attention factor; 1 otherwise)."""

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._by_device.setdefault(positions.device, self._inv_freq_cpu.to(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos, sin: [T, head_dim]."""
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


# MKL picks its kernel by the number of rows: on CPU a row's float32 result was measured to differ in the
# last bits between fewer than 16 rows and 16 or more, and to be the same for any count from 16 up. oneDNN's
# packed kernel (`prepack`) needs only 2.
BATCH_INVARIANT_ROWS = 16


class Linear(nn.Linear):
    """`nn.Linear` that runs through oneDNN with a prepacked weight where it can (`prepack`: 2-2.5x MKL's
    speed on AVX-512 CPUs), and that can make its per-row result independent of the rows computed with it:
    with `batch_invariant`, a call of fewer rows than its kernel needs for that (`min_rows`) is padded, so
    a rollout engine's decode steps equal the learner's forward over whole sequences bit for bit.

    An inference owner (the engine's `ModelRunner`) gives the layer a `packed_cache`, which keeps the
    packed copy between calls; without one, every call packs afresh (training: the weights move at every
    step). `prepacked = False` keeps to `F.linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.batch_invariant = False
        self.prepacked = True
        self.packed_cache: prepack.PackedWeight | None = None

    def runs_packed(self, x: torch.Tensor | None = None) -> bool:
        return self.prepacked and prepack.supports(self.weight, x)

    def rows_needed(self, packed: bool) -> int:
        """Rows a call computes at least: 1, or what batch invariance needs from the kernel it runs on."""
        if not self.batch_invariant or self.weight.device.type != "cpu":
            return 1
        return prepack.PACKED_INVARIANT_ROWS if packed else BATCH_INVARIANT_ROWS

    @property
    def min_rows(self) -> int:
        return self.rows_needed(self.runs_packed())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = x.numel() > 0 and self.runs_packed(x)
        padded = _pad_rows(x, self.rows_needed(packed))
        if not packed:
            out = F.linear(padded, self.weight, self.bias)
        elif torch.is_grad_enabled() or self.packed_cache is None:
            out = prepack.trainable_linear(padded, self.weight, self.bias)
        else:
            out = prepack.linear(padded, self.packed_cache.get(self.weight), self.bias)
        return _unpad_rows(out, x, padded)


def _pad_rows(x: torch.Tensor, needed: int) -> torch.Tensor:
    """x as [rows, features] with zero rows added up to `needed`; x itself when it has enough (or none)."""
    rows = x.numel() // x.shape[-1]
    if not 0 < rows < needed:
        return x
    return F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, needed - rows))


def _unpad_rows(out: torch.Tensor, x: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    """The rows of `out` that `x` had, in x's leading shape (undoes `_pad_rows`)."""
    return out if padded is x else out[: x.numel() // x.shape[-1]].reshape(*x.shape[:-1], -1)


def stacked_projections(
    x: torch.Tensor, projections: Sequence[nn.Module], cache: prepack.PackedWeight | None
) -> list[torch.Tensor]:
    """Each projection of `x`, computed in one packed call over their stacked weights where that applies
    (inference with a cache, every projection a packed `Linear`; same bits as one call each, see
    `prepack`; or inference with every projection an int8 `QuantizedLinear`, whose kernel keeps its own
    packed copy), else one call each."""
    quantized = [p for p in projections if isinstance(p, QuantizedLinear)]
    if len(quantized) == len(projections) and not torch.is_grad_enabled():
        stacked = stacked_int8(x, quantized)
        if stacked is not None:
            return stacked
    linears = [p for p in projections if isinstance(p, Linear)]
    if (
        cache is None
        or torch.is_grad_enabled()
        or x.numel() == 0
        or len(linears) != len(projections)
        or not all(linear.runs_packed(x) for linear in linears)
    ):
        return [projection(x) for projection in projections]
    padded = _pad_rows(x, max(linear.rows_needed(packed=True) for linear in linears))
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    out = prepack.linear(padded, cache.get(*(linear.weight for linear in linears)), bias)
    out = _unpad_rows(out, x, padded)
    return list(torch.split(out, [linear.out_features for linear in linears], dim=-1))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_cache: prepack.PackedWeight | None = None
        """Gate and up stacked and packed, for inference (`CausalLM.cache_packed_weights`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = stacked_projections(x, (self.gate_proj, self.up_proj), self.gate_up_cache)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out
