"""The tensors a model's config implies, with their shapes, checked against what a file holds:
every tensor the architecture needs is there exactly once, with exactly the shape the config
gives it; a GGUF tensor the config does not place is refused (a checkpoint directory's are
named in a warning, since Hugging Face checkpoints often carry buffers such as rotary tables).

Shapes here are in the Hugging Face orientation (outermost dimension first: a projection is
[out, in]); a GGUF lists its dimensions innermost first and is compared reversed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from pagedllm.errors import ModelFileError
from pagedllm.models.config import ModelConfig

logger = logging.getLogger("pagedllm")

Shape = tuple[int, ...]


def expected_tensors(config: ModelConfig, present: Mapping[str, Shape]) -> dict[str, Shape]:
    """Hugging Face name -> shape of every weight `config` needs.  `present` (the file's names)
    decides between forms the engine takes both of: phi3's q/k/v fused or apart."""
    c = config
    hidden, d = c.hidden_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    out: dict[str, Shape] = {"embed_tokens.weight": (c.vocab_size, hidden), "norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, hidden)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = (hidden,)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
        out[p + "self_attn.o_proj.weight"] = (hidden, q)
        if c.architecture == "phi3" and p + "self_attn.qkv_proj.weight" in present:
            out[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, hidden)
        else:
            out.update({p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden)})
            out[p + "self_attn.v_proj.weight"] = (kv, hidden)
        if c.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)})
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if c.qk_norm or c.architecture == "gemma3":
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if c.architecture == "gemma3":
            out.update(
                {p + "pre_feedforward_layernorm.weight": (hidden,), p + "post_feedforward_layernorm.weight": (hidden,)}
            )
        if c.layer_moe[i]:
            out.update(_moe_tensors(c, p, present))
        elif c.architecture == "phi3":  # gate and up fused, as Phi-3 checkpoints and llama.cpp store them
            out[p + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, hidden)
            out[p + "mlp.down_proj.weight"] = (hidden, c.intermediate_size)
        else:
            out.update(
                {
                    p + "mlp.gate_proj.weight": (c.intermediate_size, hidden),
                    p + "mlp.up_proj.weight": (c.intermediate_size, hidden),
                }
            )
            out[p + "mlp.down_proj.weight"] = (hidden, c.intermediate_size)
    return out


def _moe_tensors(c: ModelConfig, p: str, present: Mapping[str, Shape]) -> dict[str, Shape]:
    """A MoE layer's router and experts, in whichever of the three forms the file holds: a GGUF's
    stacked gate, up and down; transformers 5's stacked gate_up and down; one tensor per expert."""
    experts, width, hidden = c.num_experts, c.moe_intermediate_size, c.hidden_size
    out: dict[str, Shape] = {p + "mlp.gate.weight": (experts, hidden)}
    m = p + "mlp.experts."
    if m + "gate_proj.weight" in present:
        out.update({m + "gate_proj.weight": (experts, width, hidden), m + "up_proj.weight": (experts, width, hidden)})
        out[m + "down_proj.weight"] = (experts, hidden, width)
    elif m + "gate_up_proj" in present:
        out.update({m + "gate_up_proj": (experts, 2 * width, hidden), m + "down_proj": (experts, hidden, width)})
    else:
        for e in range(experts):
            q = f"{m}{e}."
            out.update({q + "gate_proj.weight": (width, hidden), q + "up_proj.weight": (width, hidden)})
            out[q + "down_proj.weight"] = (hidden, width)
    return out


def check_tensors(
    path: Path,
    config: ModelConfig,
    present: Mapping[str, Shape],
    file_name: Callable[[str], str],
    refuse_extra: bool,
) -> None:
    """`present`: Hugging Face name -> shape (outermost first) of every tensor in the file;
    `file_name`: the name a weight has (or would have) in the file, what the errors say.  Raises a ModelFileError
    for a missing tensor, a wrong shape, or (where `refuse_extra`) a tensor nothing reads."""
    expected = expected_tensors(config, present)
    for name, shape in expected.items():
        if name not in present:
            raise ModelFileError(path, f"tensor {file_name(name)!r}", f"is missing ({_implied(config)})")
        if tuple(present[name]) != shape:
            raise ModelFileError(
                path,
                f"tensor {file_name(name)!r}",
                f"has shape {list(present[name])}, but the config implies {list(shape)} ({_implied(config)})",
            )
    extra = [file_name(name) for name in present if name not in expected]
    if extra and refuse_extra:
        raise ModelFileError(
            path,
            f"tensor {extra[0]!r}",
            f"is not one a {config.architecture} model of this config reads (no weight to load it into)",
        )
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        logger.warning(
            "%s: %d tensors not read (not weights of a %s model): %s", path.name, len(extra), config.architecture, shown
        )


def _implied(c: ModelConfig) -> str:
    return (
        f"{c.architecture}: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} heads / {c.num_kv_heads} KV "
        f"of {c.head_dim}, MLP {c.intermediate_size}, vocabulary {c.vocab_size}"
    )
