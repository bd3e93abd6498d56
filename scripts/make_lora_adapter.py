"""Write a random LoRA adapter (PEFT's directory format) for a model, to try adapters without
training one.  Its replies differ from the base model's, and are not meant to be good.

    python scripts/make_lora_adapter.py --model smollm2 --rank 16 --seed 1 adapters/demo-1
    pagedllm serve --lora demo=adapters/demo-1
"""

from __future__ import annotations

import argparse

from pagedllm.models.loader import read_model_config, resolve_model_path
from pagedllm.models.lora_files import TARGETS
from pagedllm.testing.lora import write_random_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the adapter directory to write")
    parser.add_argument("--model", default=None, help="a bundled model, GGUF file or HF directory (default: smollm2)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="spread of the random A and B values")
    args = parser.parse_args()
    config = read_model_config(resolve_model_path(args.model))
    path = write_random_adapter(args.out, config, args.rank, args.alpha, tuple(args.targets), args.seed, args.std)
    print(f"wrote a rank-{args.rank} adapter on {', '.join(args.targets)} to {path}")


if __name__ == "__main__":
    main()
