"""Which models run their decode-only steps in one C++ call, and that call assembled from them.

A model declares the math of its layers (`LlamaModel.decode_math()`: "llama", "gemma3", or None
where its layers do something the one-call step does not: biases, a subclass's own layer,
multipliers).  Here, in the execution layer, that declaration and the kernels chosen for this
rank decide whether the step is built (pagedllm/layers/fused_decode.py runs it); the model only
calls the step it is given (`model.fused_decode`) for the steps it applies to.
"""

from __future__ import annotations

import dataclasses

from pagedllm.layers.attention import cpp_attention
from pagedllm.layers.cpu_kernels import CpuKernels
from pagedllm.layers.fused_decode import FusedDecode, FusedLayer, fusable, fused_decode_enabled
from pagedllm.layers.fused_ops import CppOps, LayerOps
from pagedllm.layers.rotary import Rotary
from pagedllm.models.llama import AttentionFn, DecoderLayer, LlamaModel

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def select_fused_decode(model: LlamaModel, ops: LayerOps, attention: AttentionFn) -> FusedDecode | None:
    """The one-call decode step where this rank runs the C++ kernels for both attention and the
    elementwise ops (and PAGEDLLM_FUSED_DECODE is not 0) and the model's layers fit it."""
    if not (fused_decode_enabled() and isinstance(ops, CppOps) and attention is cpp_attention):
        return None
    return build_fused_decode(model, ops.kernels)


def build_fused_decode(model: LlamaModel, kernels: CpuKernels) -> FusedDecode | None:
    """The model's decode-only step in one call to `kernels`, or None where that call cannot run
    its layers exactly as the loop does: math it does not have, tensor parallelism, rotary that
    depends on the sequence length, or a projection neither packed for the small-batch kernels
    nor quantized in at most its number of parts."""
    math = model.decode_math()
    if math is None or model.tp.size != 1 or any(r.length_dependent for r in model.layer_rotary):
        return None
    if not all(fusable(layer.linears[name]) for layer in model.layers for name in PROJECTIONS):
        return None
    layers = [fused_layer(layer, rotary, math) for layer, rotary in zip(model.layers, model.layer_rotary)]
    first = model.layers[0]
    # Gemma 3 scales q by its query_pre_attn_scalar (every layer's q_scale); llama's is 1.
    q_scale = first.q_scale if math == "gemma3" else 1.0
    return FusedDecode(
        kernels, layers, model.norm, dtype=model.embed_tokens.dtype, heads=first.num_heads,
        kv_heads=first.num_kv_heads, head_dim=first.head_dim, eps=model.config.rms_norm_eps, q_scale=q_scale,
    )  # fmt: skip


def fused_layer(layer: DecoderLayer, rotary: Rotary, math: str) -> FusedLayer:
    linears = layer.linears
    plain = FusedLayer(
        layer.input_norm, linears["qkv_proj"], linears["o_proj"], layer.post_norm, linears["gate_up_proj"],
        linears["down_proj"], layer.window, rotary.rotary_dim, rotary.cos32, rotary.sin32,
    )  # fmt: skip
    if math == "llama":
        return plain
    # Gemma 3: a norm before and after the MLP, and RMSNorm over each head of q and k.
    return dataclasses.replace(
        plain, pre_ffn_norm=layer.pre_ffn_norm, post_ffn_norm=layer.post_ffn_norm, q_norm=layer.q_norm,
        k_norm=layer.k_norm,
    )  # fmt: skip
