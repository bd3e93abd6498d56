"""What a GGUF file's header says about its model, in the engine's terms: llama.cpp's metadata
keys mapped to a ModelConfig (RoPE scaling included), and its tensor names mapped to the
Hugging Face names the models load.  Every architecture the engine runs from a checkpoint
directory runs from GGUF too, under llama.cpp's architecture name.

RoPE in a GGUF: `rope.scaling.type` linear or yarn with its factor and original length;
Llama 3's scaling as a `rope_freqs` tensor (one divisor per rotated pair, what llama3's
formula gives); Phi-3's LongRoPE as `rope_factors_short` / `rope_factors_long` tensors;
`rope.dimension_count` below the head size for partial rotary.  These tensors are read into
the config here, not loaded as weights.  A sliding window on a llama-architecture file
(a Mistral) applies to every layer, as Mistral's config does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedllm.layers.rotary import RopeScaling
from pagedllm.models.config import ModelConfig

# llama.cpp's architecture name -> the engine's.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "granite": "granite",
    "smollm3": "smollm3",
}
# Architectures whose q and k rows llama.cpp's converter interleaves per rotary pair (its
# "normal" RoPE); the loader restores Hugging Face's half-split order.
PERMUTED_QK = ("llama", "granite", "smollm3")
# Tensors that carry RoPE parameters rather than weights.
ROPE_TENSORS = ("rope_freqs", "rope_factors_short", "rope_factors_long")

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v fused
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # [experts, inter, hidden]
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma 3 has four norms per layer; llama.cpp names them differently.
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def field(reader, key: str, default=None):
    """A metadata value of a GGUFFile (pagedllm/models/gguf_file.py), or `default`."""
    value = reader.fields.get(key)
    return default if value is None else value


def hf_tensor_name(gguf_name: str, arch: str, path: Path) -> str:
    """The Hugging Face name of a GGUF tensor, or an error naming the tensor."""
    prefix, _, rest = gguf_name.partition(".")
    if prefix == "blk":
        index, _, rest = rest.partition(".")
        kind, _, suffix = rest.partition(".")
        names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
        if arch == "phi3" and kind == "ffn_up":  # phi3's ffn_up holds gate and up
            return f"layers.{index}.mlp.gate_up_proj.{suffix}"
        if kind in names and suffix in ("weight", "bias"):
            return f"layers.{index}.{names[kind]}.{suffix}"
    elif prefix in TOP_NAMES and rest == "weight":
        return f"{TOP_NAMES[prefix]}.weight"
    raise ValueError(f"{path.name}: tensor {gguf_name!r} is not one a {arch} model has (no weight to load it into)")


def _rope_tensor(reader, name: str) -> tuple[float, ...]:
    tensor = next((t for t in reader.tensors if t.name == f"{name}.weight"), None)
    if tensor is None:
        return ()
    return tuple(float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1))


def rope_scaling_of(reader, arch: str, path: Path) -> RopeScaling:
    key = f"{arch}.rope.scaling."
    kind = field(reader, key + "type", "none")
    original = field(reader, key + "original_context_length")
    factor = field(reader, key + "factor")
    freq_factors = _rope_tensor(reader, "rope_freqs")
    short, long = _rope_tensor(reader, "rope_factors_short"), _rope_tensor(reader, "rope_factors_long")
    if long:
        if kind == "yarn":
            kind = "longrope"  # Phi-3 files name their LongRoPE yarn, as transformers reads Phi-3's config
        return RopeScaling(
            "longrope",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=field(reader, key + "attn_factor"),
            short_factor=short or (1.0,) * len(long),
            long_factor=long,
        )
    if freq_factors:
        if kind not in ("none", "llama3"):
            raise ValueError(f"{path.name}: rope_freqs together with rope scaling {kind!r} is not supported")
        return RopeScaling("freq_factors", freq_factors=freq_factors)
    if kind in ("none", None):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=float(factor))
    if kind == "yarn":
        return RopeScaling(
            "yarn",
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(field(reader, key + "yarn_beta_fast", 32.0)),
            beta_slow=float(field(reader, key + "yarn_beta_slow", 1.0)),
        )
    raise ValueError(f"{path.name}: rope scaling type {kind!r} is not supported (none, linear, yarn, rope_freqs)")


def gguf_config(reader, path: Path) -> ModelConfig:
    """The model's shape from a GGUF header and its RoPE tensors (no weight is read)."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    ours = GGUF_ARCHITECTURES[arch]
    heads = int(field(reader, f"{arch}.attention.head_count"))
    hidden = int(field(reader, f"{arch}.embedding_length"))
    layers = int(field(reader, f"{arch}.block_count"))
    names = {t.name: t for t in reader.tensors}
    head_dim = int(field(reader, f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = field(reader, f"{arch}.rope.dimension_count")
    rotary_dim = None if rotary_dim is None or int(rotary_dim) == head_dim else int(rotary_dim)
    window = int(field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if ours == "gemma3":  # five sliding layers, then one full (transformers' default; GGUF does not say)
        windows = tuple(window if (i + 1) % 6 else 0 for i in range(layers))
    else:
        windows = (window,) * layers
    extra: dict = {}
    if ours == "gemma3":
        extra = {"rope_local_theta": 10000.0, "query_pre_attn_scalar": 256.0}
    if ours == "granite":
        extra = {
            "embedding_multiplier": float(field(reader, f"{arch}.embedding_scale", 1.0)),
            "residual_multiplier": float(field(reader, f"{arch}.residual_scale", 1.0)),
            "attention_multiplier": float(field(reader, f"{arch}.attention.scale", head_dim**-0.5)),
            "logits_scaling": float(field(reader, f"{arch}.logit_scale", 1.0)),
        }
    if ours == "smollm3":  # no rotary in every fourth layer (llama.cpp's fixed step)
        extra = {"layer_rope": tuple((i + 1) % 4 != 0 for i in range(layers))}
    if ours == "qwen3_moe":
        experts = int(field(reader, f"{arch}.expert_count", 0))
        extra = {
            "num_experts": experts,
            "num_experts_per_tok": int(field(reader, f"{arch}.expert_used_count", 0)),
            "moe_intermediate_size": int(field(reader, f"{arch}.expert_feed_forward_length", 0)),
            "norm_topk_prob": bool(field(reader, f"{arch}.expert_weights_norm", True)),
            "layer_moe": tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)),
        }
    feed_forward = field(reader, f"{arch}.feed_forward_length") or extra.get("moe_intermediate_size")
    return ModelConfig(
        vocab_size=int(names["token_embd.weight"].shape[-1]),  # GGUF lists the innermost dimension first
        hidden_size=hidden,
        intermediate_size=int(feed_forward),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 1e6 if ours == "gemma3" else 10000.0)),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        architecture=ours,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        layer_windows=windows,
        rope_scaling=rope_scaling_of(reader, arch, path),
        rotary_dim=rotary_dim,
        **extra,
    )
