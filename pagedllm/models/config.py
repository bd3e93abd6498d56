"""What a checkpoint says about its architecture: sizes, rotary bases, windows, norms."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.layers.rotary import RopeScaling


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
    # RoPE variant and its parameters (layers/rotary.py); rotary_dim: dims of each head that
    # rotate (None: all of head_dim; Phi-4-mini rotates part); layer_rope: per layer, whether it
    # applies rotary at all (SmolLM3 leaves it out of every fourth layer; empty: all do).
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rotary_dim: int | None = None
    layer_rope: tuple[bool, ...] = ()
    # Granite's multipliers: on the embeddings, on each layer's attention and MLP output before
    # it joins the residual, the q.k scale (None: head_dim ** -0.5), and logits divided by.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Mixture of experts (qwen3_moe): experts per MoE layer, how many each token uses, each
    # expert's MLP width, whether the chosen experts' weights are renormalized to sum to 1,
    # and per layer whether its MLP is the MoE (empty: none is).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    layer_moe: tuple[bool, ...] = ()

    @property
    def context_length(self) -> int:
        """The longest sequence the model is made for: max_position_embeddings, times the factor of
        a RoPE scaling that extends past it (linear, dynamic NTK, and YaRN from its original
        length); llama3 and LongRoPE configs give the extended length as max_position_embeddings."""
        s = self.rope_scaling
        if s.rope_type in ("linear", "dynamic") and s.factor:
            return int(self.max_position_embeddings * s.factor)
        if s.rope_type == "yarn" and s.factor:
            original = s.original_max_position_embeddings or self.max_position_embeddings
            return max(self.max_position_embeddings, int(original * s.factor))
        return self.max_position_embeddings

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if not self.layer_rope:
            object.__setattr__(self, "layer_rope", (True,) * self.num_layers)
        if len(self.layer_rope) != self.num_layers:
            raise ValueError(f"{len(self.layer_rope)} layer rotary flags for {self.num_layers} layers")
        if not self.layer_moe:
            object.__setattr__(self, "layer_moe", (False,) * self.num_layers)
        if len(self.layer_moe) != self.num_layers:
            raise ValueError(f"{len(self.layer_moe)} layer MoE flags for {self.num_layers} layers")
        if any(self.layer_moe) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.num_experts_per_tok} experts per token of {self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
