"""What computing on the GGUF's quantized blocks costs in accuracy: weights=native against the
same file dequantized (weights=dequantized), both in --dtype; or with `--compare kv-cache-dtype`,
a float16 KV cache against a float32 one (float32 activations, the weights as `auto` holds them);
or with `--compare kv-cache-float8`, a float8 e4m3 KV cache against the default one of --dtype
(bfloat16 beside bfloat16, float16 beside float32).

    python benchmarks/quantized_accuracy.py [--model smollm2|gemma3-270m] [--prompts 50]
    python benchmarks/quantized_accuracy.py --compare kv-cache-dtype --dtype float32
    python benchmarks/quantized_accuracy.py --compare kv-cache-float8

The text is a real one every Python install carries: the sections of the Python language
reference in `pydoc_data.topics`.
- Greedy agreement: the first 200 tokens (at most) of each of `--prompts` sections as a prompt,
  64 tokens out (EOS ignored), all prompts at once as a user would run them; the share of the
  64 tokens that are identical, and of leading tokens before the first difference.
- Perplexity: teacher-forced over the first 1,024 tokens of each of the 8 longest sections (not
  among the prompts), fed in
  chunks of 16 tokens so that every projection runs on the integer kernels, as in decoding
  (the engine's many-row steps run a float GEMM on the dequantized weights instead).
Results go to bench-results/quantized-accuracy.json (or --output).
"""

from __future__ import annotations

import argparse
import math

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarking.compare import machine
from pagedllm.benchmarking.throughput import print_result
from pagedllm.layers.cpu_kernels import cpu_summary
from pagedllm.testing.hf_reference import negative_log_likelihood

# What each comparison runs: the baseline first, then the variant measured against it.
VARIANTS = {
    "weights": [("dequantized", {"weights": "dequantized"}), ("native", {"weights": "native"})],
    "kv-cache-dtype": [("float32", {"kv_cache_dtype": "float32"}), ("float16", {"kv_cache_dtype": "float16"})],
    "kv-cache-float8": [("default", {"kv_cache_dtype": "auto"}), ("float8_e4m3", {"kv_cache_dtype": "float8_e4m3"})],
}


def sections() -> list[str]:
    """The reference's sections, longest first."""
    import pydoc_data.topics

    return sorted(pydoc_data.topics.topics.values(), key=len, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--compare", choices=sorted(VARIANTS), default="weights")
    parser.add_argument("--output", default="bench-results/quantized-accuracy.json")
    args = parser.parse_args()
    texts = sections()
    if len(texts) < args.prompts + 8:
        raise SystemExit(f"pydoc_data.topics has {len(texts)} sections; ask for at most {len(texts) - 8}")
    outputs: dict[str, list[list[int]]] = {}
    nll: dict[str, float] = {}
    scored_tokens = 0
    kv_dtypes: dict[str, str] = {}
    (base, _), (variant, _) = VARIANTS[args.compare]
    for label, settings in VARIANTS[args.compare]:
        llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="1GiB", **settings)
        tok = llm.tokenizer
        prompts = [tok.encode(text)[:200] for text in texts[8 : 8 + args.prompts]]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        outputs[label] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        documents = [tok.encode(text)[:1024] for text in texts[:8]]
        nll[label] = sum(negative_log_likelihood(llm, ids, 16) for ids in documents)
        scored_tokens = sum(len(ids) - 1 for ids in documents)
        dtype = str(llm.engine.dtype).removeprefix("torch.")
        kv_dtypes[label] = str(llm.engine.kv_dtype).removeprefix("torch.")
        llm.shutdown()
    same = leading = 0
    for a, b in zip(outputs[variant], outputs[base]):
        same += sum(x == y for x, y in zip(a, b))
        leading += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    total = 64 * args.prompts
    perplexity = {w: math.exp(v / scored_tokens) for w, v in nll.items()}
    report = {
        "model": args.model,
        "compare": args.compare,
        "dtype": dtype,
        "kv_cache_dtypes": kv_dtypes,
        "cpu": cpu_summary(),
        "machine": machine(),
        "prompts": args.prompts,
        "tokens_compared": total,
        "identical_tokens": round(same / total, 4),
        "identical_leading_tokens": round(leading / total, 4),
        "perplexity_tokens": scored_tokens,
        "perplexity": {w: round(p, 4) for w, p in perplexity.items()},
        "perplexity_change": round(perplexity[variant] / perplexity[base] - 1, 5),
    }
    print_result(report, args.output)


if __name__ == "__main__":
    main()
