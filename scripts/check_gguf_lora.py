"""Check GGUF LoRA adapters against llama.cpp itself, on a tiny random llama (float32).

Writes the base model as a HF directory and as GGUF, and a random PEFT adapter as a directory and
as a GGUF adapter (pagedllm.testing.lora.write_gguf_adapter).  Then:
- with `--llama-cpp-src DIR` (a llama.cpp source tree, e.g. the one inside llama-cpp-python's
  sdist), converts the PEFT adapter with llama.cpp's own convert_lora_to_gguf.py and checks that
  every tensor is byte for byte the one the test writer wrote, and that the engine reads it;
- where llama-cpp-python is installed, compares llama.cpp's greedy tokens under the GGUF adapter
  with the engine's under the same file and under the PEFT directory.

    python scripts/check_gguf_lora.py --llama-cpp-src /path/to/llama.cpp
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-src", type=Path, default=None, help="a llama.cpp source tree")
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gguf-lora-") as folder:
        check(Path(folder), args.llama_cpp_src, args.tokens)


def check(work: Path, llama_cpp_src: Path | None, num_tokens: int) -> None:
    import gguf

    from pagedllm import LLM
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.models.hf_config import config_from_hf_dict
    from pagedllm.testing.gguf_export import write_gguf
    from pagedllm.testing.hf_reference import save_random_llama
    from pagedllm.testing.lora import write_gguf_adapter, write_random_adapter

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    save_random_llama(work / "base", **shape, num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.2)
    config = config_from_hf_dict(json.loads((work / "base" / "config.json").read_text()))
    write_gguf(work / "base", work / "base.gguf")
    write_random_adapter(work / "adapter", config, rank=8, alpha=16.0, seed=3, std=0.3)
    ours = write_gguf_adapter(work / "adapter", work / "adapter.gguf", config)

    if llama_cpp_src is not None:
        theirs = work / "theirs.gguf"
        command = [sys.executable, "convert_lora_to_gguf.py", str(work / "adapter"), "--base", str(work / "base")]
        command += ["--outtype", "f32", "--outfile", str(theirs)]
        subprocess.run(command, cwd=llama_cpp_src, check=True, capture_output=True)
        mine = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
        converted = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
        if sorted(mine) != sorted(converted):
            raise SystemExit(f"tensor names differ: {sorted(set(mine) ^ set(converted))[:6]}")
        for name, tensor in converted.items():
            if not np.array_equal(np.asarray(tensor.data), np.asarray(mine[name].data)):
                raise SystemExit(f"{name}: llama.cpp's converter wrote other values")
        print(f"llama.cpp's converter: {len(converted)} tensors, each byte for byte the test writer's")
        ours = theirs

    prompt = list(range(100, 140))
    llm = LLM(str(work / "base.gguf"), dtype="float32", lora_modules=[f"gguf={ours}", f"peft={work / 'adapter'}"])
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    engine = {name: llm.generate([prompt], params, lora=name)[0].token_ids for name in ("gguf", "peft", None)}
    print(f"pagedllm, GGUF adapter:  {engine['gguf']}")
    print(f"pagedllm, PEFT adapter:  {engine['peft']}")
    print(f"pagedllm, no adapter:    {engine[None]}")
    if engine["gguf"] != engine["peft"] or engine["gguf"] == engine[None]:
        raise SystemExit("the GGUF adapter does not give the PEFT adapter's tokens")
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no comparison with llama.cpp's tokens")
        return
    model = Llama(str(work / "base.gguf"), lora_path=str(ours), n_ctx=256, verbose=False)
    reference = []
    for token in model.generate(prompt, top_k=1, temp=0.0):
        reference.append(int(token))
        if len(reference) == num_tokens:
            break
    print(f"llama.cpp, GGUF adapter: {reference}")
    if reference != engine["gguf"]:
        raise SystemExit("llama.cpp's tokens under the adapter differ from the engine's")
    print("llama.cpp and pagedllm agree under the GGUF adapter")


if __name__ == "__main__":
    main()
