"""A Hugging Face `config.json` read into a ModelConfig, as transformers reads it; whatever
the engine does not run is refused with the field that asks for it."""

from __future__ import annotations

from pagedllm.layers.rotary import ROPE_TYPES, RopeScaling
from pagedllm.models.config import ModelConfig

# Hugging Face `architectures` names (and their `model_type`) this engine runs.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
}
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "granite": "granite",
}
# The activation each architecture's MLP runs (GeGLU for gemma3, SwiGLU for the rest).
_ACTIVATIONS = {"gemma3": ("gelu_pytorch_tanh",)}


def architecture_of(cfg: dict) -> str:
    """The architecture a config.json names, or a clear error naming the supported ones."""
    names = cfg.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = cfg.get("model_type", "llama" if not names else None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    supported = ", ".join(f"{name} ({arch})" for name, arch in ARCHITECTURES.items())
    raise ValueError(
        f"unsupported architecture {names[0] if names else model_type!r} (model_type {cfg.get('model_type')!r}); "
        f"supported: {supported}"
    )


def layer_windows_of(cfg: dict, architecture: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers reads the config."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if architecture in ("qwen2", "qwen3", "qwen3_moe", "smollm3") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return (0,) * layers
    layer_types = cfg.get("layer_types")
    if layer_types is None and architecture == "gemma3":  # every sixth layer attends to everything
        pattern = cfg.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if layer_types is None and architecture in ("qwen2", "qwen3", "qwen3_moe"):
        first = cfg.get("max_window_layers", layers)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if layer_types is None and architecture == "smollm3":  # the NoPE layers slide
        layer_types = ["full_attention" if rope else "sliding_attention" for rope in layer_rope_of(cfg, architecture)]
    if layer_types is None:
        return (int(window),) * layers
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in layer_types)


def layer_rope_of(cfg: dict, architecture: str) -> tuple[bool, ...]:
    """Per layer, whether it applies rotary: SmolLM3 leaves it out of every fourth layer (or as
    its `no_rope_layers` says: 1 for a layer with rotary)."""
    layers = cfg["num_hidden_layers"]
    if architecture != "smollm3":
        return (True,) * layers
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(bool(f) for f in flags)


def rope_of(cfg: dict, architecture: str, params: dict, head_dim: int) -> tuple[float, RopeScaling, int | None]:
    """(theta, variant, rotary dims or None for all) from one set of rotary parameters:
    transformers 5's `rope_parameters` or the older `rope_scaling` with a top-level `rope_theta`."""
    default_theta = 1e6 if architecture == "gemma3" else 1e4
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or default_theta)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if architecture == "phi3" and rope_type in ("su", "yarn"):  # transformers' Phi-3 reads both as LongRoPE
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES or rope_type == "freq_factors":
        supported = ", ".join(t for t in ROPE_TYPES if t != "freq_factors")
        raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {supported}")
    original = None
    if rope_type in ("llama3", "yarn", "longrope"):
        original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0
    rotary_dim = None
    if partial != 1.0:
        if architecture != "phi3":
            raise ValueError(f"partial_rotary_factor {partial} is not supported for {architecture} (only phi3)")
        rotary_dim = int(head_dim * partial)
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=params.get("factor"),
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
    )
    return theta, scaling, rotary_dim


def _refuse_unsupported(cfg: dict, architecture: str) -> None:
    activation = cfg.get("hidden_activation", cfg.get("hidden_act"))
    allowed = _ACTIVATIONS.get(architecture, ("silu",))
    if activation is not None and activation not in allowed:
        raise ValueError(f"{architecture} with activation {activation!r} is not supported (supported: {allowed})")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError("checkpoints with MLP biases (mlp_bias) are not supported")
    if architecture not in ("qwen2",) and cfg.get("attention_bias"):
        raise ValueError(f"{architecture} checkpoints with attention biases (attention_bias) are not supported")
    if architecture == "qwen3_moe" and cfg.get("shared_expert_intermediate_size"):
        raise ValueError("qwen3_moe with a shared expert (shared_expert_intermediate_size) is not supported")


def config_from_hf_dict(cfg: dict) -> ModelConfig:
    architecture = architecture_of(cfg)
    _refuse_unsupported(cfg, architecture)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    # transformers 5's rope_parameters, with an older config's rope_scaling over it where both are set.
    rope_params = dict(cfg.get("rope_parameters") or {})
    rope_params.update(cfg.get("rope_scaling") or {})
    # Gemma 3 names one set of rotary parameters per layer type.
    local_params = rope_params.get("sliding_attention") or {}
    rope_params = rope_params.get("full_attention", rope_params)
    theta, scaling, rotary_dim = rope_of(cfg, architecture, rope_params, head_dim)
    extra: dict = {}
    if architecture == "gemma3":
        _, local_scaling, _ = rope_of(cfg, architecture, local_params, head_dim)
        if local_scaling.rope_type != "default":
            raise ValueError(f"rope scaling {local_scaling.rope_type!r} on gemma3's sliding layers is not supported")
        extra = {
            "rope_local_theta": float(local_params.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        }
    if architecture == "granite":
        extra = {
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(cfg.get("attention_multiplier", head_dim**-0.5)),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
        }
    if architecture == "qwen3_moe":
        extra = _moe_fields(cfg)
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size"),
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", architecture == "gemma3")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        architecture=architecture,
        attention_bias=architecture == "qwen2",
        qk_norm=architecture in ("qwen3", "qwen3_moe", "gemma3"),
        layer_windows=layer_windows_of(cfg, architecture),
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        layer_rope=layer_rope_of(cfg, architecture),
        **extra,
    )


def _moe_fields(cfg: dict) -> dict:
    # transformers 5 writes num_local_experts; the published configs num_experts.
    layers, experts = cfg["num_hidden_layers"], cfg.get("num_experts") or cfg.get("num_local_experts", 0)
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg.get("num_experts_per_tok", 0),
        "moe_intermediate_size": cfg.get("moe_intermediate_size", 0),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "layer_moe": tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
    }
