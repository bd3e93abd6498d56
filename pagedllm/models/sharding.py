"""Tensor parallelism: which slice of every weight a rank holds (the collectives are
pagedllm/layers/tensor_parallel.py).

Megatron-style, over `torch.distributed` (gloo on CPU, NCCL on CUDA):

- Q/K/V and gate/up are column-parallel: rank r holds the rows of its
  attention heads and of its slice of the MLP, so attention and the SwiGLU
  run on local data.  Output and down projections are row-parallel: rank r
  holds the matching input columns, and an all-reduce sums the partial
  outputs, so every rank ends each layer with the whole hidden state.
- KV heads: with N ranks and K KV heads, rank r holds K/N of them when N
  divides K; when N exceeds K (N a multiple of K) each rank holds one KV
  head, replicated on N/K ranks, and only the query heads that read it.
  Each rank's KV cache has its heads in the same block layout and the same
  number of blocks, so one block id names the same tokens on every rank.
- Embedding and LM head are vocab-parallel (the decision of issue 7):
  rank r holds rows [r*S, (r+1)*S) of the vocabulary, S = ceil(V/N), padded
  with zero rows.  The embedding looks up the ids it holds (zeros for the
  others) and all-reduces; the LM head computes its slice of the logits and
  rank 0 gathers them, so only rank 0 ever has whole logits, and samples.
- Norms (Qwen3's per-head q/k norms too) and rotary tables are replicated (a few KB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.arith import cdiv
from pagedllm.layers.tensor_parallel import TensorParallel
from pagedllm.models.config import ModelConfig


@dataclass(frozen=True)
class ShardLayout:
    """The sizes and offsets of one rank's slices of the model."""

    num_heads: int  # query heads on this rank
    head_start: int
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_shard: int  # rows of embedding / LM head on this rank (padded: equal on every rank)
    vocab_start: int

    @classmethod
    def for_rank(cls, config: ModelConfig, tp: TensorParallel) -> ShardLayout:
        check_tensor_parallel_size(config, tp.size)
        n, r = tp.size, tp.rank
        heads = config.num_heads // n
        if n <= config.num_kv_heads:
            kv_heads, kv_start = config.num_kv_heads // n, r * (config.num_kv_heads // n)
        else:  # each KV head replicated on n / K ranks
            kv_heads, kv_start = 1, r // (n // config.num_kv_heads)
        inter = config.intermediate_size // n
        vocab = cdiv(config.vocab_size, n)
        return cls(heads, r * heads, kv_heads, kv_start, inter, r * inter, vocab, r * vocab)


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """A clear error when the model cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if size > 1 and any(config.layer_moe):
        raise ValueError(f"{config.architecture}'s mixture-of-experts layers do not run tensor-parallel yet")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (size <= kv and kv % size) or (size > kv and size % kv):
        raise ValueError(
            f"tensor_parallel_size {size} must divide the model's {kv} KV heads or be a multiple of them "
            "(KV heads are then replicated)"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's MLP width {config.intermediate_size}"
        )


def split_fused(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused qkv_proj and gate_up_proj as the separate projections the other checkpoints
    store (a new dict), so that they shard by the same rules."""
    out = dict(weights)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p = f"layers.{i}."
        qkv = out.pop(p + "self_attn.qkv_proj.weight", None)
        if qkv is not None:
            for name, part in zip("qkv", qkv.split([q, kv, kv])):
                out[p + f"self_attn.{name}_proj.weight"] = part
        gate_up = out.pop(p + "mlp.gate_up_proj.weight", None)
        if gate_up is not None:
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate_up.chunk(2)
    return out


def shard_hf_weights(
    weights: dict[str, torch.Tensor], config: ModelConfig, tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """This rank's slice of every Hugging Face-named tensor (a new dict; `weights` is left as it is)."""
    if tp.size == 1:
        return weights
    s = ShardLayout.for_rank(config, tp)
    d = config.head_dim
    weights = split_fused(weights, config)
    shards = dict(weights)  # norms are replicated

    def rows(name: str, start: int, count: int) -> None:
        shards[name] = weights[name][start : start + count].clone()

    def columns(name: str, start: int, count: int) -> None:
        shards[name] = weights[name][:, start : start + count].contiguous()

    def vocab_rows(name: str) -> None:
        full = weights[name]
        shard = full.new_zeros(s.vocab_shard, full.shape[1])  # the last rank's padding rows stay zero
        part = full[s.vocab_start : s.vocab_start + s.vocab_shard]
        shard[: part.shape[0]] = part
        shards[name] = shard

    for i in range(config.num_layers):
        p = f"layers.{i}."
        rows(p + "self_attn.q_proj.weight", s.head_start * d, s.num_heads * d)
        rows(p + "self_attn.k_proj.weight", s.kv_head_start * d, s.num_kv_heads * d)
        rows(p + "self_attn.v_proj.weight", s.kv_head_start * d, s.num_kv_heads * d)
        if config.attention_bias:
            rows(p + "self_attn.q_proj.bias", s.head_start * d, s.num_heads * d)
            rows(p + "self_attn.k_proj.bias", s.kv_head_start * d, s.num_kv_heads * d)
            rows(p + "self_attn.v_proj.bias", s.kv_head_start * d, s.num_kv_heads * d)
        columns(p + "self_attn.o_proj.weight", s.head_start * d, s.num_heads * d)
        rows(p + "mlp.gate_proj.weight", s.intermediate_start, s.intermediate_size)
        rows(p + "mlp.up_proj.weight", s.intermediate_start, s.intermediate_size)
        columns(p + "mlp.down_proj.weight", s.intermediate_start, s.intermediate_size)
    vocab_rows("embed_tokens.weight")
    if not config.tie_word_embeddings:
        vocab_rows("lm_head.weight")
    return shards
