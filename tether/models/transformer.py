"""Our decoder-only transformer for the Llama (and Mistral), Qwen2 and Qwen3 families, over a paged KV cache.

One implementation serves them all: they differ only in the traits of `ModelConfig` (q/k/v biases for
Qwen2, per-head q/k RMSNorm for Qwen3) and in each layer's sliding window (`ModelConfig.layer_windows`).
Parameter names equal Hugging Face's, so checkpoints load as-is. The model knows nothing about scheduling
or sampling: it maps a flat batch of tokens to logits.
"""

from __future__ import annotations

import torch
from torch import nn

from tether.kernels.attention import AttentionMetadata, paged_attention
from tether.kernels.kv_cache import KVCache
from tether.models import prepack
from tether.models.config import ModelConfig
from tether.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, stacked_projections


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        traits = config.traits
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.window = config.layer_windows[layer]
        """Sliding window in tokens (Mistral/Qwen2 style), or None for full causal attention."""
        self.q_proj = Linear(config.hidden_size, config.num_heads * config.head_dim, bias=traits.qkv_bias)
        kv_dim = config.num_kv_heads * config.head_dim
        self.k_proj = Linear(config.hidden_size, kv_dim, bias=traits.qkv_bias)
        self.v_proj = Linear(config.hidden_size, kv_dim, bias=traits.qkv_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if traits.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if traits.qk_norm else None
        self.qkv_cache: prepack.PackedWeight | None = None
        """q, k and v stacked and packed, for inference (`CausalLM.cache_packed_weights`)."""

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = stacked_projections(x, (self.q_proj, self.k_proj, self.v_proj), self.qkv_cache)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin)
        out = paged_attention(
            q, k, v, kv_cache.keys[self.layer], kv_cache.values[self.layer], metadata, self.scale, self.window
        )
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, -1))
        return projected


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, metadata, kv_cache)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(x))
        return x + mlp_out


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos_sin, metadata, kv_cache)
        out: torch.Tensor = self.norm(x)
        return out


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def projections(self) -> list[Linear]:
        return [module for module in self.modules() if isinstance(module, Linear)]

    @property
    def min_rows(self) -> int:
        """Rows every projection computes at least (`set_batch_invariant`)."""
        return max((linear.min_rows for linear in self.projections()), default=1)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make every projection's per-row result independent of the batch (`layers.Linear`): what an RL
        rollout engine needs so that the learner recomputes its logprobs exactly."""
        for linear in self.projections():
            linear.batch_invariant = enabled

    def set_prepacked(self, enabled: bool) -> None:
        """Run projections through oneDNN with packed weights where supported (the default), or plain
        `F.linear`. A learner must use the same setting as the engine whose logprobs it recomputes."""
        for linear in self.projections():
            linear.prepacked = enabled

    def cache_packed_weights(self, enabled: bool) -> None:
        """Keep each projection's packed weight between calls (inference): rebuilt when a weight is
        replaced or written in place through torch's counted writes (`copy_`), which is how the engine
        updates weights. Off, every call packs afresh, as training needs."""
        for linear in self.projections():
            linear.packed_cache = prepack.PackedWeight() if enabled else None
        for module in self.modules():
            if isinstance(module, Attention):
                module.qkv_cache = prepack.PackedWeight() if enabled else None
            elif isinstance(module, GatedMLP):
                module.gate_up_cache = prepack.PackedWeight() if enabled else None

    def tie_weights(self) -> None:
        """Re-share the output projection with the embedding (needed after loading with `assign=True`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] (all tokens when None) for a flat batch of new tokens."""
        hidden = self.model(input_ids, positions, metadata, kv_cache)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
