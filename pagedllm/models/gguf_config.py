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

from pagedllm.errors import ModelFileError
from pagedllm.layers.rotary import RopeScaling
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_metadata import check_tokenizer_metadata, meta_float, meta_int, meta_str, meta_token_id
from pagedllm.models.tensor_checks import check_tensors

# Bounds on the shape the engine runs, far past any real model: a value beyond is a damaged or
# hostile file, refused before anything is sized by it.
MAX_WIDTH = 2**20  # hidden size, head dimension, MLP width
MAX_HEADS = 2**12
MAX_CONTEXT = 2**24  # tokens
MAX_EXPERTS = 2**12

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
    """A metadata value of a GGUFFile (pagedllm/models/gguf_file.py), or `default` (unchecked: the
    shape's keys are read through gguf_metadata's checked getters)."""
    value = reader.fields.get(key)
    return default if value is None else value


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; restore Hugging Face's half-split order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


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
    raise ModelFileError(path, f"tensor {gguf_name!r}", f"is not one a {arch} model has (no weight to load it into)")


def gguf_name_of(hf_name: str, arch: str) -> str:
    """The GGUF name of a Hugging Face weight name (the inverse of hf_tensor_name), for errors that
    name a tensor the file lacks."""
    if hf_name.startswith("layers."):
        _, index, rest = hf_name.split(".", 2)
        stem, _, suffix = rest.rpartition(".")
        names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
        if arch == "phi3" and stem == "mlp.gate_up_proj":
            return f"blk.{index}.ffn_up.{suffix}"
        kind = next((k for k, v in names.items() if v == stem), stem)
        return f"blk.{index}.{kind}.{suffix}"
    top = {f"{v}.weight": f"{k}.weight" for k, v in TOP_NAMES.items()}
    return top.get(hf_name, hf_name)


def _rope_tensor(reader, name: str, path: Path) -> tuple[float, ...]:
    """A RoPE parameter tensor's values (finite and positive: they divide frequencies), or ()."""
    tensor = next((t for t in reader.tensors if t.name == f"{name}.weight"), None)
    if tensor is None:
        return ()
    if len(tensor.shape) != 1 or tensor.tensor_type.name not in ("F32", "F16") or tensor.shape[0] > 2**16:
        raise ModelFileError(
            path,
            f"tensor {tensor.name!r}",
            f"must be a float vector of rotary factors, got {tensor.tensor_type.name} {list(tensor.shape)}",
        )
    values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ModelFileError(path, f"tensor {tensor.name!r}", "holds a factor that is not a finite positive number")
    return tuple(float(x) for x in values)


def rope_scaling_of(reader, arch: str, path: Path) -> RopeScaling:
    key = f"{arch}.rope.scaling."
    kind = meta_str(reader, path, key + "type", "none")
    original = meta_int(reader, path, key + "original_context_length", 0, 0, MAX_CONTEXT) or None
    factor = meta_float(reader, path, key + "factor", 1.0, 0.0, 1e6) if key + "factor" in reader.fields else None
    freq_factors = _rope_tensor(reader, "rope_freqs", path)
    short, long = _rope_tensor(reader, "rope_factors_short", path), _rope_tensor(reader, "rope_factors_long", path)
    if long:
        if kind == "yarn":
            kind = "longrope"  # Phi-3 files name their LongRoPE yarn, as transformers reads Phi-3's config
        return RopeScaling(
            "longrope",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=meta_float(reader, path, key + "attn_factor", 1.0, 0.0, 1e6)
            if key + "attn_factor" in reader.fields
            else None,
            short_factor=short or (1.0,) * len(long),
            long_factor=long,
        )
    if freq_factors:
        if kind not in ("none", "llama3"):
            raise ModelFileError(path, key + "type", f"rope_freqs together with rope scaling {kind!r} is not supported")
        return RopeScaling("freq_factors", freq_factors=freq_factors)
    if kind in ("none", None):
        return RopeScaling()
    if kind in ("linear", "yarn") and factor is None:
        raise ModelFileError(path, key + "factor", f"is missing (rope scaling {kind} needs it)")
    if kind == "linear":
        return RopeScaling("linear", factor=float(factor))
    if kind == "yarn":
        return RopeScaling(
            "yarn",
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=meta_float(reader, path, key + "yarn_beta_fast", 32.0, 0.0, 1e6),
            beta_slow=meta_float(reader, path, key + "yarn_beta_slow", 1.0, 0.0, 1e6),
        )
    raise ModelFileError(path, key + "type", f"rope scaling {kind!r} is not supported (none, linear, yarn, rope_freqs)")


def gguf_config(reader, path: Path) -> ModelConfig:
    """The model's shape from a GGUF header and its RoPE tensors, every value checked for its type
    and range before anything is sized by it (no weight is read)."""
    arch = meta_str(reader, path, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(
            path,
            "general.architecture",
            f"{arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}",
        )
    ours = GGUF_ARCHITECTURES[arch]
    names = {t.name: t for t in reader.tensors}
    embedding = names.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        shape = "is missing" if embedding is None else f"has shape {list(embedding.shape)}, not 2 dimensions"
        raise ModelFileError(path, "tensor 'token_embd.weight'", shape)
    vocab_size = int(embedding.shape[-1])  # GGUF lists the innermost dimension first
    hidden = meta_int(reader, path, f"{arch}.embedding_length", None, 1, MAX_WIDTH)
    heads = meta_int(reader, path, f"{arch}.attention.head_count", None, 1, MAX_HEADS)
    kv_heads = meta_int(reader, path, f"{arch}.attention.head_count_kv", heads, 1, heads)
    if heads % kv_heads:
        raise ModelFileError(path, f"{arch}.attention.head_count_kv", f"{kv_heads} does not divide {heads} query heads")
    if f"{arch}.attention.key_length" not in reader.fields and hidden % heads:
        raise ModelFileError(path, f"{arch}.attention.head_count", f"{heads} heads do not divide the width {hidden}")
    head_dim = meta_int(reader, path, f"{arch}.attention.key_length", hidden // heads, 1, MAX_WIDTH)
    meta_int(reader, path, f"{arch}.attention.value_length", head_dim, head_dim, head_dim)  # the engine's v = k
    # Every layer holds tensors of its own, so a file cannot describe more layers than tensors.
    layers = meta_int(reader, path, f"{arch}.block_count", None, 1, max(1, len(reader.tensors)))
    rotary_dim = meta_int(reader, path, f"{arch}.rope.dimension_count", head_dim, 2, head_dim)
    if rotary_dim % 2:
        raise ModelFileError(path, f"{arch}.rope.dimension_count", f"{rotary_dim} is odd (rotary turns pairs)")
    rotary_dim = None if rotary_dim == head_dim else rotary_dim
    window = meta_int(reader, path, f"{arch}.attention.sliding_window", 0, 0, MAX_CONTEXT)
    if ours == "gemma3":  # five sliding layers, then one full (transformers' default; GGUF does not say)
        windows = tuple(window if (i + 1) % 6 else 0 for i in range(layers))
    else:
        windows = (window,) * layers
    extra: dict = {}
    if ours == "gemma3":
        extra = {"rope_local_theta": 10000.0, "query_pre_attn_scalar": 256.0}
    if ours == "granite":
        extra = {
            "embedding_multiplier": meta_float(reader, path, f"{arch}.embedding_scale", 1.0, 0.0, 1e6),
            "residual_multiplier": meta_float(reader, path, f"{arch}.residual_scale", 1.0, 0.0, 1e6),
            "attention_multiplier": meta_float(reader, path, f"{arch}.attention.scale", head_dim**-0.5, 0.0, 1e6),
            "logits_scaling": meta_float(reader, path, f"{arch}.logit_scale", 1.0, 0.0, 1e6),
        }
    if ours == "smollm3":  # no rotary in every fourth layer (llama.cpp's fixed step)
        extra = {"layer_rope": tuple((i + 1) % 4 != 0 for i in range(layers))}
    if ours == "qwen3_moe":
        experts = meta_int(reader, path, f"{arch}.expert_count", None, 1, MAX_EXPERTS)
        extra = {
            "num_experts": experts,
            "num_experts_per_tok": meta_int(reader, path, f"{arch}.expert_used_count", None, 1, experts),
            "moe_intermediate_size": meta_int(reader, path, f"{arch}.expert_feed_forward_length", None, 1, MAX_WIDTH),
            "norm_topk_prob": bool(field(reader, f"{arch}.expert_weights_norm", True)),
            "layer_moe": tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)),
        }
    feed_forward = meta_int(
        reader, path, f"{arch}.feed_forward_length", extra.get("moe_intermediate_size"), 1, MAX_WIDTH
    )
    default_theta = 1e6 if ours == "gemma3" else 10000.0
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=feed_forward,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=meta_float(reader, path, f"{arch}.rope.freq_base", default_theta, 1.0, 1e12),
        rms_norm_eps=meta_float(reader, path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, 0.0, 0.5),
        max_position_embeddings=meta_int(reader, path, f"{arch}.context_length", 2048, 1, MAX_CONTEXT),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta_token_id(reader, path, "tokenizer.ggml.bos_token_id", vocab_size),
        eos_token_id=meta_token_id(reader, path, "tokenizer.ggml.eos_token_id", vocab_size),
        architecture=ours,
        # Qwen2 always has q/k/v biases and Qwen3 (and its MoE) q/k norms, as llama.cpp requires them.
        attention_bias="blk.0.attn_q.bias" in names or ours == "qwen2",
        qk_norm="blk.0.attn_q_norm.weight" in names or ours in ("qwen3", "qwen3_moe"),
        layer_windows=windows,
        rope_scaling=rope_scaling_of(reader, arch, path),
        rotary_dim=rotary_dim,
        **extra,
    )
    if config.context_length > MAX_CONTEXT:
        raise ModelFileError(
            path, f"{arch}.rope.scaling.factor", f"extends the context to {config.context_length} tokens"
        )
    return config


def check_gguf(reader, path: Path) -> ModelConfig:
    """The one validation pass over a GGUF's header, before anything is allocated: the model's
    shape (gguf_config), every tensor the shape implies present once with its shape and no other,
    and the tokenizer's metadata.  Returns the config."""
    config = gguf_config(reader, path)
    arch = meta_str(reader, path, "general.architecture")
    present: dict[str, tuple[int, ...]] = {}
    file_names: dict[str, str] = {}
    rotary_pairs = (config.rotary_dim or config.head_dim) // 2
    for tensor in reader.tensors:
        if tensor.name.removesuffix(".weight") in ROPE_TENSORS:
            if tuple(tensor.shape) != (rotary_pairs,):
                raise ModelFileError(
                    path,
                    f"tensor {tensor.name!r}",
                    f"has shape {list(tensor.shape)}, not one factor per rotated pair ({rotary_pairs})",
                )
            continue
        name = hf_tensor_name(tensor.name, arch, path)
        present[name] = tuple(reversed(tensor.shape))
        file_names[name] = tensor.name
    check_tensors(
        path, config, present, lambda name: file_names.get(name) or gguf_name_of(name, arch), refuse_extra=True
    )
    if reader.layout_error is not None:
        raise reader.layout_error
    check_tokenizer_metadata(reader, path, config.vocab_size)
    return config
