"""What a checkpoint says about its architecture: sizes, rotary bases, windows, norms."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"  # one of ARCHITECTURES' values
    attention_bias: bool = False  # biases on the q, k and v projections (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before rotary (qwen3)
    # Per layer: how many of the latest positions a query sees (0: all of them).  Mistral's
    # sliding window is on every layer; Qwen's, where turned on, on the layers its
    # `layer_types` name.  A query at position p sees keys p - window + 1 .. p.
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: rotary base of the sliding layers (the full ones use rope_theta), the scale
    # of q.k (query_pre_attn_scalar ** -0.5) and a cap on the logits (tanh), where set.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
