"""Gemma 3 (text) on the llama layers, with what differs:

- four RMSNorms per layer (before and after attention, before and after the MLP), each
  scaling by (1 + w) in float32 before rounding to the model's dtype;
- RMSNorms over each head of q and of k, before rotary (Gemma's (1 + w) norm);
- GeGLU: GELU (tanh approximation) of the gate times up;
- embeddings scaled by sqrt(hidden_size) (the factor rounded to the model's dtype);
- sliding-window layers (five of every six) with their own rotary base, full layers with
  another; q.k scaled by query_pre_attn_scalar ** -0.5; an optional tanh cap on the logits.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.fused_ops import LayerOps
from pagedllm.layers.lora import LayerLora, LoraStep
from pagedllm.layers.output_buffers import OutputBuffers
from pagedllm.layers.quantized import QuantizedWeight
from pagedllm.layers.rotary import Rotary, RotaryStep
from pagedllm.layers.tensor_parallel import TensorParallel
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import AttentionFn, DecoderLayer, LlamaModel, QuantizedBuilder
from pagedllm.models.sharding import ShardLayout


class Gemma3DecoderLayer(DecoderLayer):
    """A llama layer's projections plus Gemma's extra norms; every norm weight is kept as
    (1 + w) in float32."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, shard: ShardLayout, tp: TensorParallel, window: int = 0
    ) -> None:
        super().__init__(config, dtype, shard, tp, window)
        hidden, d = config.hidden_size, config.head_dim
        f32 = torch.float32
        for name, size in (
            ("input_norm", hidden),
            ("post_norm", hidden),  # after attention
            ("pre_ffn_norm", hidden),
            ("post_ffn_norm", hidden),
            ("q_norm", d),
            ("k_norm", d),
        ):
            setattr(self, name, nn.Parameter(torch.empty(size, dtype=f32), requires_grad=False))
        scalar = config.query_pre_attn_scalar or d
        self.q_scale = (d / scalar) ** 0.5  # the kernels scale by d ** -0.5; Gemma by scalar ** -0.5

    def normalize_heads(self, qkv: torch.Tensor, ops: LayerOps) -> None:
        q_size, kv_size, _ = self.split
        ops.gemma_norm_heads(qkv, 0, q_size, self.q_norm, self.eps)
        ops.gemma_norm_heads(qkv, q_size, kv_size, self.k_norm, self.eps)

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryStep,
        attention: AttentionFn,
        ops: LayerOps,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        eps, norm = self.eps, ops.gemma_norm
        if delta is not None:
            residual.add_(delta)
        qkv = self.project("qkv_proj", norm(residual, self.input_norm, eps), lora)
        self.normalize_heads(qkv, ops)
        q = ops.rope_write_kv(qkv, rotary, kv_cache, meta.slot_mapping, self.num_heads)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        attn = self.tp.all_reduce(self.project("o_proj", attention(q, kv_cache, meta, self.window), lora))
        residual.add_(norm(attn, self.post_norm, eps))
        gate_up = self.project("gate_up_proj", norm(residual, self.pre_ffn_norm, eps), lora)
        mlp = self.tp.all_reduce(self.project("down_proj", ops.gelu_tanh_mul(gate_up), lora))
        return norm(mlp, self.post_ffn_norm, eps)


class Gemma3Model(LlamaModel):
    layer_class = Gemma3DecoderLayer

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, max_len: int, attention: AttentionFn, tp=None, ops=None
    ):
        super().__init__(config, dtype, max_len, attention, tp, ops)
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.local_rotary = Rotary(config.head_dim, config.rope_local_theta or config.rope_theta, max_len, dtype)
        self.layer_rotary = [self.local_rotary if layer.window else self.rotary for layer in self.layers]
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)

    def load_hf_weights(
        self,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        linear_backend: str = "torch",
        small_batch: bool = True,
        quantized: QuantizedBuilder | None = None,
    ) -> None:
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                for ours, theirs in (
                    ("pre_ffn_norm", "pre_feedforward_layernorm"),
                    ("post_ffn_norm", "post_feedforward_layernorm"),
                ):
                    getattr(layer, ours).copy_(self.take(weights, p + theirs + ".weight"))
        super().load_hf_weights(weights, linear_backend, small_batch, quantized)
        with torch.no_grad():  # every norm: (1 + w), in float32
            for layer in self.layers:
                for name in ("input_norm", "post_norm", "pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm"):
                    getattr(layer, name).add_(1.0)
            self.norm.add_(1.0)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],
        rope_lengths: torch.Tensor | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        residual = self.embed(input_ids) * self.embed_scale
        if self.fused_decode_applies(meta, residual.shape[0], lora):
            return self.fused_decode(residual, positions, kv_caches, meta, lora)
        residual.add_(self.run_layers(residual, positions, kv_caches, meta, rope_lengths, lora))
        return self.ops.gemma_norm(residual, self.norm, self.config.rms_norm_eps)

    layer_math = "gemma3"

    def decode_math(self) -> str | None:
        c = self.config  # q/k norms are Gemma 3's own: only biases and multipliers fall outside
        extras = c.attention_bias or c.residual_multiplier != 1.0 or c.attention_multiplier is not None
        return None if extras else self.layer_math

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, buffers: OutputBuffers | None = None, float32: bool = True
    ) -> torch.Tensor | None:
        cap = self.config.final_logit_softcapping
        logits = super().compute_logits(hidden, buffers, float32=float32 or bool(cap))  # capped in float32
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
