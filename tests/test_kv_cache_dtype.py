"""The KV cache's element type: float16 beside float32 activations on the CPU (the default there),
or the model's dtype; the real SmolLM2 on a float16 cache against transformers."""

from __future__ import annotations

import pytest
import torch

from pagedllm.execution.device import resolve_kv_cache_dtype
from pagedllm.testing.hf_reference import first_divergence_is_a_near_tie, greedy, hf_greedy, hf_logits, our_logits

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def test_auto_takes_float16_only_beside_float32_on_the_cpu_kernels():
    assert resolve_kv_cache_dtype("auto", F32, "cpu", cpp_attention=True) == F16
    assert resolve_kv_cache_dtype("auto", F32, "cpu", cpp_attention=False) == F32  # torch paths: no gain
    assert resolve_kv_cache_dtype("auto", BF16, "cpu", cpp_attention=True) == BF16
    assert resolve_kv_cache_dtype("auto", F32, "cuda:0", cpp_attention=False) == F32
    assert resolve_kv_cache_dtype("float16", F32, "cpu", cpp_attention=False) == F16
    assert resolve_kv_cache_dtype("float32", F32, "cpu", cpp_attention=True) == F32
    assert resolve_kv_cache_dtype("bfloat16", BF16, "cuda:0", cpp_attention=False) == BF16


@pytest.mark.parametrize(
    "name,dtype,device",
    [("float16", BF16, "cpu"), ("float16", F32, "cuda:0"), ("float32", BF16, "cpu"), ("bfloat16", F32, "cpu")],
)
def test_other_pairs_are_refused_with_a_reason(name, dtype, device):
    with pytest.raises(ValueError, match=f"kv_cache_dtype {name} does not run beside"):
        resolve_kv_cache_dtype(name, dtype, device, cpp_attention=True)


def test_a_float16_cache_holds_twice_the_tokens_in_the_same_memory(make_llm):
    half = make_llm(kv_cache_dtype="float16", kv_cache_memory="64MiB")
    full = make_llm(kv_cache_memory="64MiB")
    assert half.engine.runner.kv_caches[0].dtype == F16 and full.engine.runner.kv_caches[0].dtype == F32
    assert half.engine.kv_cache.num_blocks == 2 * full.engine.kv_cache.num_blocks
    assert half.engine.kv_block_bytes * 2 == full.engine.kv_block_bytes
    assert half.engine.runner.kv_cache_bytes <= 64 * 2**20 + half.engine.kv_block_bytes  # + the padding block


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Why is the sky blue?",
    "Tell me a short story about a robot who learns to paint, with a twist at the end.",
]


def test_real_smollm2_on_a_float16_cache_against_transformers(make_llm, hf_model):
    """Keys and values rounded to float16 (11 significant bits) move SmolLM2's logits by a few
    hundredths of units that span ~30; greedy decoding keeps transformers' float32 tokens but at
    near ties (the story prompt's 24th token is one: logits 16.8470 and 16.8448, which the AVX-512
    build's summation order turns)."""
    llm = make_llm(kv_cache_dtype="float16")
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    reference = [hf_greedy(hf_model, p, 32) for p in prompts]
    outputs = llm.generate(prompts, greedy(32))
    for prompt, output, expected in zip(prompts, outputs, reference):
        assert first_divergence_is_a_near_tie(hf_model, prompt, output.token_ids, expected, 0.05) is None
    assert sum(o.token_ids == r for o, r in zip(outputs, reference)) >= len(prompts) - 1
    worst = 0.0
    for prompt, continuation in zip(prompts, reference):
        ids = prompt + continuation
        worst = max(worst, (our_logits(llm, ids) - hf_logits(hf_model, ids)).abs().max().item())
    assert 0 < worst < 0.15, f"logits differ by {worst}"
