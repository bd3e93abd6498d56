"""The real SmolLM2 against transformers on the same GGUF weights, float32."""

import pytest

from pagedllm.testing.hf_reference import greedy, hf_greedy, hf_logits, our_logits

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Tell me a short story about a robot who learns to paint, with a twist at the end.",
]
NEW_TOKENS = 32
BYTES_PER_BLOCK_16 = 16 * 2 * 30 * 3 * 64 * 4  # float32 SmolLM2: one 16-token block of K and V


@pytest.fixture(scope="module")
def prompts(make_llm):
    tok = make_llm().tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(prompts, hf_model):
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def make_llm():
    # module-scoped, so that the module-scoped prompts fixture can use it
    from conftest import llm_factory

    with llm_factory() as make:
        yield make


def test_teacher_forced_logits_match(make_llm, prompts, reference, hf_model):
    llm = make_llm()
    for prompt, continuation in zip(prompts, reference):
        ids = prompt + continuation
        diff = (our_logits(llm, ids) - hf_logits(hf_model, ids)).abs().max().item()
        assert diff < 1e-3, f"logits differ by {diff}"


def test_greedy_each_prompt_alone(make_llm, prompts, reference):
    llm = make_llm()
    for prompt, expected in zip(prompts, reference):
        assert llm.generate(prompt, greedy(NEW_TOKENS))[0].token_ids == expected


@pytest.mark.parametrize(
    "engine_args",
    [
        {},  # block size 16
        {"block_size": 4},
        {"max_num_batched_tokens": 16},  # every prompt is split over several steps
    ],
    ids=["batched-bs16", "batched-bs4", "chunked-prefill"],
)
def test_greedy_batched(make_llm, prompts, reference, engine_args):
    llm = make_llm(**engine_args)
    outputs = llm.generate(prompts, greedy(NEW_TOKENS))
    assert [o.token_ids for o in outputs] == reference
    if "max_num_batched_tokens" in engine_args:
        assert all(len(p) > 16 for p in prompts)


def test_greedy_with_preemption(make_llm, prompts, reference):
    # 14 blocks of 16 tokens: each request fits alone (at most 6 blocks), all of them do not.
    llm = make_llm(kv_cache_memory=14 * BYTES_PER_BLOCK_16)
    assert llm.engine.kv_cache.num_blocks == 14
    before = llm.engine.scheduler.num_preemptions
    outputs = llm.generate(prompts, greedy(NEW_TOKENS))
    assert llm.engine.scheduler.num_preemptions > before, "the test meant to force preemption"
    assert any(o.num_preemptions for o in outputs)
    assert [o.token_ids for o in outputs] == reference
