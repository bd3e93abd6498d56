"""The llama family (RMSNorm, RoPE, grouped-query attention, SwiGLU) on the
flattened tokens of a step: `[num_tokens, hidden]`, no padding between requests.
Q/K/V and gate/up projections are fused into one matmul each.

The same layers run the architectures that differ from llama only in details
(`ModelConfig` says which): Mistral (a sliding window), Qwen2 (biases on q, k
and v), Qwen3 (an RMSNorm over each head of q and of k, before rotary), Phi-3
(q/k/v and gate/up stored fused already, LongRoPE, partial rotary), SmolLM3
(no rotary in every fourth layer) and Granite (multipliers on the embeddings,
the residual branches, q.k and the logits).  Every RoPE variant is a table
(pagedllm/layers/rotary.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.fused_ops import LayerOps, TorchOps, rms_norm
from pagedllm.layers.linear import Linear
from pagedllm.layers.lora import LayerLora, LoraStep
from pagedllm.layers.output_buffers import OutputBuffers
from pagedllm.layers.quantized import (
    PackedWeight,
    QuantizedLinear,
    QuantizedWeight,
    quantized_embedding,
)
from pagedllm.layers.rotary import Rotary, RotaryStep
from pagedllm.layers.tensor_parallel import TensorParallel
from pagedllm.models.config import ModelConfig
from pagedllm.models.sharding import ShardLayout

AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, int], torch.Tensor]  # ..., window


class DecodeStep(Protocol):
    """A decode-only step computed in one call (layers/fused_decode.py's FusedDecode): the final
    hidden states from the embedded tokens, for the steps it `applies` to."""

    def applies(self, meta: AttentionMetadata | list[AttentionMetadata], rows: int) -> bool: ...

    def __call__(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],
        lora: LoraStep | None = None,
    ) -> torch.Tensor: ...


def per_layer(meta: AttentionMetadata | list[AttentionMetadata], num_layers: int) -> list[AttentionMetadata]:
    """One step's attention metadata per layer: one for every layer, or each layer's group's."""
    return meta if isinstance(meta, list) else [meta] * num_layers


class QuantizedBuilder(Protocol):
    """How projections kept quantized are built (the execution layer chooses: layers/quantized.py's
    QuantizedSetup): a weight packed for the kernels, a projection of packed parts."""

    lm_head_max_rows: int

    def pack(self, weight: QuantizedWeight) -> PackedWeight: ...

    def linear(self, weights: list[QuantizedWeight | PackedWeight], max_rows: int | None = None) -> QuantizedLinear: ...


Fused = torch.Tensor | list[QuantizedWeight]


def fuse(parts: list[torch.Tensor | QuantizedWeight]) -> Fused:
    """Projections stacked by rows (q, k, v; gate, up).  Kept quantized when every part is: a
    list of parts, neighbours of the same layout stacked into one; else one float tensor."""
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts], dim=0)
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].layout == part.layout:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [QuantizedWeight.cat(run) if len(run) > 1 else run[0] for run in runs]


class DecoderLayer(nn.Module):
    """One layer, holding this rank's heads and MLP slice (all of them at tensor-parallel size 1)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, shard: ShardLayout, tp: TensorParallel, window: int = 0
    ) -> None:
        super().__init__()
        c = config
        self.tp = tp
        self.window = window  # sliding window of this layer (0: full attention)
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        q_size, kv_size = shard.num_heads * c.head_dim, shard.num_kv_heads * c.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_norm = nn.Parameter(torch.empty(c.hidden_size, dtype=dtype), requires_grad=False)
        self.qkv_proj = nn.Parameter(torch.empty(sum(self.split), c.hidden_size, dtype=dtype), requires_grad=False)
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, q_size, dtype=dtype), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(c.hidden_size, dtype=dtype), requires_grad=False)
        inter = shard.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, c.hidden_size, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(c.hidden_size, inter, dtype=dtype), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.empty(sum(self.split), dtype=dtype), requires_grad=False) if c.attention_bias else None
        )
        self.q_norm = nn.Parameter(torch.empty(c.head_dim, dtype=dtype), requires_grad=False) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(c.head_dim, dtype=dtype), requires_grad=False) if c.qk_norm else None
        self.linears: dict[str, Linear | QuantizedLinear] = {}
        self.quantized: dict[str, list[QuantizedWeight]] = {}  # projections kept quantized (weights=native)
        # Granite: q scaled so that the kernels' head_dim ** -0.5 makes attention_multiplier; each
        # branch's output times residual_multiplier before it joins the residual.
        self.q_scale = 1.0 if c.attention_multiplier is None else c.attention_multiplier * c.head_dim**0.5
        self.residual_multiplier = c.residual_multiplier

    # The projections this layer holds, each with its checkpoint names: (the name of the weight
    # stored fused, as Phi-3 stores it, or None; the names of its parts, stacked by rows).
    projection_sources = {
        "qkv_proj": ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        "o_proj": (None, ("self_attn.o_proj",)),
        "gate_up_proj": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        "down_proj": (None, ("mlp.down_proj",)),
    }

    def prepare_linears(self, backend: str, small_batch=None, quantized: QuantizedBuilder | None = None) -> None:
        """Build the projections from the loaded weights; the Linear's copies (oneDNN's packed one,
        and the small-batch kernels' where they run) replace the weight.  Projections kept
        quantized become QuantizedLinears (`quantized` says how)."""
        for name in self.projection_sources:
            param = getattr(self, name)
            if name in self.quantized:
                if quantized is None:
                    raise ValueError("quantized projections need the C++ kernels (weights='native')")
                self.linears[name] = quantized.linear(self.quantized.pop(name))
                continue
            self.linears[name] = Linear(param.data, backend, small_batch)
            if backend != "torch":  # the Linear holds what is read from now on
                param.data = torch.empty(0, dtype=param.dtype)

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
        """Adds the previous layer's output `delta` to the residual stream (in place) and returns
        this layer's output, to be added by the next layer (or the final norm).  `lora`: the
        step's adapters, added to the projections of the rows that name one."""
        h = ops.add_rms_norm(delta, residual, self.input_norm, self.eps)
        qkv = self.project("qkv_proj", h, lora)
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        if self.q_norm is not None:
            self.normalize_heads(qkv, ops)
        q = ops.rope_write_kv(qkv, rotary, kv_cache, meta.slot_mapping, self.num_heads)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        # Row-parallel projections: each rank adds its heads' (its MLP slice's) share.
        attn = self.tp.all_reduce(self.project("o_proj", attention(q, kv_cache, meta, self.window), lora))
        if self.residual_multiplier != 1.0:
            attn = attn * self.residual_multiplier

        h = ops.add_rms_norm(attn, residual, self.post_norm, self.eps)
        out = self.mlp(h, ops, lora)
        return out * self.residual_multiplier if self.residual_multiplier != 1.0 else out

    def project(self, name: str, x: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
        """Projection `name` of `x`, plus the step's adapters' updates where it has any."""
        y = self.linears[name](x)
        return y if lora is None else lora.add(name, x, y)

    def mlp(self, h: torch.Tensor, ops: LayerOps, lora: LayerLora | None = None) -> torch.Tensor:
        gate_up = self.project("gate_up_proj", h, lora)
        return self.tp.all_reduce(self.project("down_proj", ops.silu_mul(gate_up), lora))

    def load_extra_weights(self, weights: dict, prefix: str, quantized: QuantizedBuilder | None) -> None:
        """Weights a layer subclass holds beyond the llama layer's (none here)."""

    def normalize_heads(self, qkv: torch.Tensor, ops: LayerOps) -> None:
        """Qwen3's q/k norm, in place on the fused QKV rows: RMSNorm over each head's dims."""
        q_size, kv_size, _ = self.split
        d = self.head_dim
        q = qkv[:, :q_size].unflatten(-1, (-1, d))
        k = qkv[:, q_size : q_size + kv_size].unflatten(-1, (-1, d))
        q.copy_(rms_norm(q, self.q_norm, self.eps))
        k.copy_(rms_norm(k, self.k_norm, self.eps))


class LlamaModel(nn.Module):
    """The model, or with `tp` one rank's slice of it (see pagedllm/layers/tensor_parallel.py);
    load it with `load_hf_weights` after `shard_hf_weights`."""

    layer_class = DecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_len: int,
        attention: AttentionFn,
        tp: TensorParallel | None = None,
        ops: LayerOps | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention = attention
        self.ops = ops or TorchOps()
        self.tp = tp = tp or TensorParallel()
        self.shard = shard = ShardLayout.for_rank(config, tp)
        vocab_rows = shard.vocab_shard
        self.embed_tokens = nn.Parameter(torch.empty(vocab_rows, config.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(
            self.layer_class_for(i)(config, dtype, shard, tp, window) for i, window in enumerate(config.layer_windows)
        )
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(vocab_rows, config.hidden_size, dtype=dtype), requires_grad=False)
        )
        self.rotary = Rotary(
            config.head_dim, config.rope_theta, max_len, dtype,
            config.rope_scaling, config.rotary_dim, config.max_position_embeddings,
        )  # fmt: skip
        no_rotary = Rotary(config.head_dim, config.rope_theta, 1, dtype, rotary_dim=0)
        self.layer_rotary = [self.rotary if rope else no_rotary for rope in config.layer_rope]
        self.lm_head_linear: Linear | QuantizedLinear | None = None
        self.embed_packed: PackedWeight | None = None  # the embedding table, where it is kept quantized
        # Decode-only steps in one call: set by the execution layer (execution/fused_step.py) where
        # it chose the C++ kernels and `decode_math()` fits; None runs the layer loop.
        self.fused_decode: DecodeStep | None = None

    def layer_class_for(self, index: int) -> type[DecoderLayer]:
        """The class of layer `index` (one class for every layer, unless a model mixes kinds)."""
        return self.layer_class

    def load_hf_weights(
        self,
        weights: dict[str, torch.Tensor | QuantizedWeight],
        linear_backend: str = "torch",
        small_batch: bool = True,
        quantized: QuantizedBuilder | None = None,
    ) -> None:
        """Copy Hugging Face-named float32 tensors in, fusing Q/K/V and gate/up, then
        build the projections with `linear_backend` (see pagedllm/layers/linear.py), with the
        C++ small-batch kernels for steps of a few rows where `small_batch` and the CPU allow.
        Weights given as QuantizedWeight (a GGUF's, with weights='native') stay quantized and
        run as `quantized` says; the embedding table too, and the LM head tied to it."""

        def take(name: str) -> torch.Tensor | QuantizedWeight:
            return self.take(weights, name)

        def put(param: nn.Parameter, weight: torch.Tensor | QuantizedWeight) -> None:
            param.copy_(weight.dequantize() if isinstance(weight, QuantizedWeight) else weight)

        with torch.no_grad():
            embed = take("embed_tokens.weight")
            self.embed_packed = None  # the embedding table kept quantized
            if isinstance(embed, QuantizedWeight) and quantized is not None:
                self.embed_packed = quantized.pack(embed)
                self.embed_tokens.data = torch.empty(0, dtype=self.embed_tokens.dtype)
            else:
                put(self.embed_tokens, embed)
            self.norm.copy_(take("norm.weight"))
            head = None if self.config.tie_word_embeddings else take("lm_head.weight")
            if head is not None and not (isinstance(head, QuantizedWeight) and quantized is not None):
                put(self.lm_head, head)
                head = None
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.input_norm.copy_(take(p + "input_layernorm.weight"))
                layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
                for name, (fused_name, part_names) in layer.projection_sources.items():
                    if fused_name is not None and p + fused_name + ".weight" in weights:
                        weight = fuse([take(p + fused_name + ".weight")])
                    else:
                        weight = fuse([take(p + part + ".weight") for part in part_names])
                    param = getattr(layer, name)
                    if isinstance(weight, list) and quantized is None:
                        weight = torch.cat([w.dequantize() for w in weight])
                    if isinstance(weight, list):
                        layer.quantized[name] = weight
                        param.data = torch.empty(0, dtype=param.dtype)
                    else:
                        put(param, weight)
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]))
                if layer.q_norm is not None:
                    layer.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
                    layer.k_norm.copy_(take(p + "self_attn.k_norm.weight"))
                layer.load_extra_weights(weights, p, quantized)
        kernels = self.ops.small_batch if small_batch else None
        for layer in self.layers:
            layer.prepare_linears(linear_backend, kernels, quantized)
        if quantized is not None and (self.embed_packed is not None and self.config.tie_word_embeddings):
            # The tied LM head reads the embedding's quantized table (on the sampled rows only).
            self.lm_head_linear = quantized.linear([self.embed_packed], max_rows=quantized.lm_head_max_rows)
            return
        if head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)
            self.lm_head_linear = quantized.linear([head], max_rows=quantized.lm_head_max_rows)
            return
        # The LM head keeps its weight (tied to the embedding table in SmolLM2).  It runs on the
        # sampled rows only, so in bfloat16 a decode step's rows go to the small-batch kernel too
        # (measured 1.06-1.73x oneDNN at 1-128 rows; float32's was not measured, and its packed
        # copy would cost 108 MiB for SmolLM2, 640 MiB for Gemma 3).
        lm_head_kernels = kernels if self.lm_head.dtype == torch.bfloat16 else None
        self.lm_head_linear = Linear(self.lm_head.data, linear_backend, lm_head_kernels)

    # The math of this model's layers, for the one-call decode step (execution/fused_step.py):
    # "llama" for plain llama layers; a subclass with layers of its own declares its own or None.
    layer_math: str | None = "llama"
    # Whether LoRA adapters may target this model's projections (layers/lora.py).
    supports_lora = True

    def decode_math(self) -> str | None:
        """`layer_math`, or None where this configuration adds math the one-call step lacks."""
        c = self.config
        extras = c.attention_bias or c.qk_norm or c.residual_multiplier != 1.0 or c.attention_multiplier is not None
        return None if extras else self.layer_math

    @staticmethod
    def take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        return weights[name]

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
        """`kv_caches` and (with layer groups, core/layer_groups.py) `meta`: one per layer.
        `rope_lengths`: per token, the sequence length its rotary is for (see layers/rotary.py);
        needed only where `self.rotary.length_dependent`.  `lora`: the step's LoRA adapters."""
        residual = self.embed(input_ids)
        if self.config.embedding_multiplier != 1.0:
            residual = residual * self.config.embedding_multiplier
        if self.fused_decode_applies(meta, residual.shape[0], lora):
            return self.fused_decode(residual, positions, kv_caches, meta, lora)
        delta = self.run_layers(residual, positions, kv_caches, meta, rope_lengths, lora)
        return self.ops.add_rms_norm(delta, residual, self.norm, self.config.rms_norm_eps)

    def fused_decode_applies(
        self, meta: AttentionMetadata | list[AttentionMetadata], rows: int, lora: LoraStep | None
    ) -> bool:
        """Whether the one-call decode step takes this step (adapters only where it adds their updates)."""
        fused = self.fused_decode
        return fused is not None and (lora is None or lora.fused) and fused.applies(meta, rows)

    def run_layers(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],
        rope_lengths: torch.Tensor | None,
        lora: LoraStep | None,
    ) -> torch.Tensor:
        """Every layer over the embedded tokens (the residual stream, updated in place): the last
        layer's output, not yet added to it."""
        delta = None
        layers = zip(
            self.layers, kv_caches, per_layer(meta, len(self.layers)), self.step_rotary(positions, rope_lengths)
        )
        for i, (layer, kv_cache, layer_meta, rotary) in enumerate(layers):
            layer_lora = None if lora is None else lora.layer(i)
            delta = layer(delta, residual, kv_cache, layer_meta, rotary, self.attention, self.ops, layer_lora)
        return delta

    def step_rotary(self, positions: torch.Tensor, rope_lengths: torch.Tensor | None) -> list[RotaryStep]:
        """Each layer's rotary for this step's tokens (each distinct table looked up once)."""
        steps: dict[int, RotaryStep] = {}
        for rotary in self.layer_rotary:
            if id(rotary) not in steps:
                steps[id(rotary)] = rotary.for_step(positions, rope_lengths)
        return [steps[id(rotary)] for rotary in self.layer_rotary]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_packed is not None:
            return quantized_embedding(self.embed_packed, self.ops.kernels, input_ids, self.embed_tokens.dtype)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocab-parallel: look up the ids this rank holds, zeros for the rest, then sum over ranks.
        local = input_ids - self.shard.vocab_start
        held = (local >= 0) & (local < self.shard.vocab_shard)
        x = F.embedding(local.clamp(0, self.shard.vocab_shard - 1), self.embed_tokens)
        return self.tp.all_reduce(x.masked_fill_(~held.unsqueeze(1), 0))

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, buffers: OutputBuffers | None = None, float32: bool = True
    ) -> torch.Tensor | None:
        """float32 logits [rows, vocab]; under tensor parallelism every rank must call this, and
        only rank 0 gets the logits (the others get None).  With `buffers` (on the CPU) the head
        writes into tensors reused from call to call, so the logits hold until the next call only.
        `float32=False` (one rank, with `buffers`, no logit scaling): the head's output as it
        comes, in the model's dtype, for a step that only takes each row's argmax."""
        head = self.lm_head_linear
        if buffers is None or not hidden.is_cpu:
            y = head(hidden).float()
        else:
            rows = hidden.shape[0]
            if isinstance(head, QuantizedLinear):
                y = head(hidden, out=buffers.take("lm_head", rows, head.out_features, hidden.dtype))
            else:
                y = head(hidden)
            keep = not float32 and self.tp.size == 1 and self.config.logits_scaling == 1.0
            if y.dtype != torch.float32 and not keep:
                y = buffers.take("logits", rows, y.shape[1], torch.float32).copy_(y)
        logits = self.tp.gather_columns(y)
        if logits is not None and self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return None if logits is None else logits[:, : self.config.vocab_size]

    def kernel_row_limits(self) -> tuple[int, ...]:
        """The row counts that end the ranges within which every projection computes a row the same
        whatever the rows beside it (`row_limits` of Linear and QuantizedLinear); past the last,
        nothing is promised.  Speculative decoding keeps a step's draft rows within its range."""
        linears = [linear for layer in self.layers for linear in layer.linears.values()]
        if self.lm_head_linear is not None:
            linears.append(self.lm_head_linear)
        every = [linear.row_limits(self.norm.dtype) for linear in linears]
        last = min(limits[-1] for limits in every)
        return tuple(sorted({limit for limits in every for limit in limits if limit <= last}))

    def weight_bytes(self) -> int:
        """Bytes of every weight this rank holds (packed copies included, the LM head once when tied)."""
        linears = [linear for layer in self.layers for linear in layer.linears.values()]
        if self.lm_head_linear is not None:
            linears.append(self.lm_head_linear)
        packed = {id(w): w for linear in linears if isinstance(linear, QuantizedLinear) for w in linear.parts}
        if self.embed_packed is not None:
            packed[id(self.embed_packed)] = self.embed_packed
        linears = [linear for linear in linears if not isinstance(linear, QuantizedLinear)]
        quantized_bytes = sum(w.nbytes for w in packed.values())
        tensors = [p.data for p in self.parameters()] + [linear.weight for linear in linears]
        tensors += [linear.small_weight for linear in linears if linear.small_weight is not None]
        # A plain Linear shares its parameter's storage; packed weights (oneDNN's, the small-batch
        # kernels') are copies of their own.
        distinct = {id(t) if t.is_mkldnn else t.data_ptr(): t for t in tensors if t.numel()}
        return quantized_bytes + sum(t.numel() * t.element_size() for t in distinct.values())
