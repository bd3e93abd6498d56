"""Penalties, logit bias and min_tokens on the real SmolLM2 (float32), against transformers
and against OpenAI's formula written out here; batched rows equal the same requests alone."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.core.sampling_params import SamplingParamError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite colours are red, green and"]


@pytest.fixture
def llm(make_llm):
    return make_llm(kv_cache_memory="64MiB")


def test_repetition_penalty_and_min_tokens_equal_transformers_generate(llm, hf_model):
    for text in PROMPTS:
        ids = llm.tokenizer.encode(text)
        ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, min_tokens=24))
        theirs = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=24,
            min_new_tokens=24,  # EOS banned throughout: both sides give exactly 24 tokens
            do_sample=False,
            repetition_penalty=1.3,
        )[0, len(ids) :].tolist()
        assert ours[0].token_ids == theirs, text
    plain = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24))[0].token_ids
    penalized = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3))[0]
    assert penalized.token_ids != plain


@torch.inference_mode()
def openai_penalized_greedy(hf_model, ids: list[int], steps: int, presence: float, frequency: float) -> list[int]:
    """OpenAI's rule, written out: logit[j] -= count[j] * frequency + (count[j] > 0) * presence,
    counts over the tokens generated so far."""
    out: list[int] = []
    for _ in range(steps):
        logits = hf_model(torch.tensor([ids + out]), logits_to_keep=1).logits[0, -1].float()  # the last row's
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[0]).float()
        logits = logits - counts * frequency - (counts > 0).float() * presence
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.2), (0.7, 0.9), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_follow_openais_formula(llm, hf_model, presence, frequency):
    ids = llm.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
    )
    ours = llm.generate([ids], params)[0].token_ids
    assert ours == openai_penalized_greedy(hf_model, ids, 20, presence, frequency)


def test_logit_bias_bans_and_forces_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPTS[0], greedy)[0].token_ids[0]
    banned = llm.generate(PROMPTS[0], SamplingParams(**{**greedy.__dict__, "logit_bias": {first: -100}}))[0]
    assert first not in banned.token_ids
    forced = llm.generate(PROMPTS[0], SamplingParams(temperature=0.9, seed=3, max_tokens=6, logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 6


def test_min_tokens_holds_eos_back(llm):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
    short = llm.generate([chat], SamplingParams(temperature=0, max_tokens=40))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 10
    longer = llm.generate([chat], SamplingParams(temperature=0, max_tokens=40, min_tokens=15))[0]
    assert len(longer.token_ids) >= 15
    assert llm.engine.eos_token_id not in longer.token_ids[:14]


def test_batched_rows_equal_the_same_requests_alone(llm):
    """Penalized, biased and plain rows side by side in one batch: each gets what it gets alone
    (greedy: a sampled draw can flip on float rounding that differs between batch sizes)."""
    settings = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **extra)
        for i, extra in enumerate(
            [
                {},
                {"presence_penalty": 1.0},
                {"frequency_penalty": 0.8, "repetition_penalty": 1.2},
                {"logit_bias": {198: -100, 13: 5.0}},
                {"min_tokens": 10},
                {},
                {"repetition_penalty": 0.9},
                {"presence_penalty": -0.5, "frequency_penalty": 0.5},
            ]
        )
    ]
    prompts = [PROMPTS[i % 3] for i in range(len(settings))]
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(prompts, settings)):
        engine.add_request(prompt, params, request_id=f"batched-{i}")
    batched: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                batched[output.request_id] = output.token_ids
    for i, (prompt, params) in enumerate(zip(prompts, settings)):
        assert batched[f"batched-{i}"] == llm.generate(prompt, params)[0].token_ids, params


def test_bad_penalties_and_bias_are_clear_errors(llm):
    for kwargs, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 150}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"beam_width": 2, "presence_penalty": 1.0}, "beam_width"),
    ]:
        with pytest.raises(SamplingParamError) as error:
            SamplingParams(**kwargs)
        assert error.value.param == param, kwargs
    with pytest.raises(SamplingParamError, match=r"outside the vocabulary \[0, 49152\)") as error:
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={49152: 1.0}))
    assert error.value.param == "logit_bias"
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_are_never_generated(llm):
    """' Eiffel' is two tokens here (' E' + 'iffel'): its second is banned right after its first."""
    assert len(llm.tokenizer.hf.encode(" Eiffel", add_special_tokens=False)) == 2
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the tallest tower in Paris?"}])
    free = llm.generate([chat], SamplingParams(temperature=0, max_tokens=40))[0].text
    assert "Eiffel" in free and "Paris" in free
    banned = llm.generate([chat], SamplingParams(temperature=0, max_tokens=40, bad_words=["Eiffel", "Paris"]))[0]
    assert "Eiffel" not in banned.text and "Paris" not in banned.text
    with pytest.raises(SamplingParamError, match="bad_words"):
        SamplingParams(bad_words=[" "])
