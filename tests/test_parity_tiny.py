"""A tiny random-weight llama saved as a Hugging Face checkpoint directory:
loads through the HF-directory path and decodes exactly like transformers."""

import pytest
import torch

from pagedllm import LLM
from pagedllm.testing.hf_reference import greedy, hf_greedy, hf_logits, our_logits, save_random_llama


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_random_llama(
        path,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=5000.0,
        tie_word_embeddings=False,
        # Weights 10x the default scale: top-2 logit gaps ~1e-2 rather than ~1e-4, so
        # float rounding between batched and single runs cannot flip a greedy argmax.
        # (head_dim 16 runs the pure-torch decode path; a NaN in a never-written cache
        # slot once leaked through it here, see test_attention's slot test.)
        initializer_range=0.2,
    )
    return path, model


def test_tiny_llama_greedy_and_logits_match_transformers(tiny_checkpoint):
    path, hf_model = tiny_checkpoint
    llm = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory="8MiB")
    assert llm.engine.model_config.num_kv_heads == 2 and not llm.engine.model_config.tie_word_embeddings
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 64)]
    outputs = llm.generate(prompts, greedy(24))
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf_model, prompt, 24)
        ids = prompt + output.token_ids
        torch.testing.assert_close(our_logits(llm, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model path"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "empty"))
