"""A fault while handling one request ends that request alone; rows with no allowed token.

The faults are injected into the real SmolLM2 engine in the middle of a busy batch:
the other requests must finish with the tokens they produce alone, and no block
may be held after (the `make_llm` fixture checks every block at the end).
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedllm.execution.sampler as sampler_module
from pagedllm import SamplingParams
from pagedllm.core.sampling_params import SamplingParamError, StructuredOutput
from pagedllm.engine import MAX_FAILED_STEPS, EngineStepError
from pagedllm.execution.sampler import Sampler

PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "The largest planet in the solar system is",
    "A haiku about autumn:",
    "def fibonacci(n):",
    "The three primary colors are",
]
POISON_SEED = 4242  # marks the request whose sampling the tests make fail


@pytest.fixture
def llm(make_llm):
    return make_llm()


def greedy(max_tokens: int = 12, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def alone(llm, prompt: str, max_tokens: int = 12) -> list[int]:
    return llm.generate([prompt], greedy(max_tokens))[0].token_ids


def test_a_request_whose_sampling_raises_ends_alone_mid_batch(llm, monkeypatch):
    expected = [alone(llm, p) for p in PROMPTS]
    real = sampler_module.process_logits
    calls = {"raised": 0}

    def process_logits(logits, params, histories):
        for p, h in zip(params, histories):
            if p.seed == POISON_SEED and len(h.output_token_ids) >= 3:  # after three good tokens
                calls["raised"] += 1
                raise RuntimeError("injected sampling fault")
        return real(logits, params, histories)

    monkeypatch.setattr(sampler_module, "process_logits", process_logits)
    poisoned = greedy(presence_penalty=0.1, seed=POISON_SEED)
    prompts = [*PROMPTS[:3], "Tell me about dragons.", *PROMPTS[3:]]
    params = [greedy()] * 3 + [poisoned] + [greedy()] * 3
    outputs = llm.generate(prompts, params)

    assert calls["raised"] >= 1
    bad = outputs[3]
    assert bad.finished and bad.finish_reason == "error"
    assert "injected sampling fault" in bad.error
    assert len(bad.token_ids) == 3  # its tokens before the fault are kept
    others = outputs[:3] + outputs[4:]
    assert [o.token_ids for o in others] == expected
    assert all(o.finish_reason == "length" and o.error is None for o in others)


def test_a_grammar_that_fails_while_masking_ends_its_request_alone(llm, monkeypatch):
    """A matcher the grammar engine gave up on raises when its mask is filled: the batch is then
    sampled row by row, and only that request fails (a 400 on its field, over HTTP)."""
    from pagedllm.execution.structured_output import StructuredOutputError, StructuredOutputs

    expected = [alone(llm, p) for p in PROMPTS[:2]]
    real = StructuredOutputs.apply_masks
    poisoned: set[str] = set()

    def apply_masks(self, logits, sequence_ids, prefixes=None):
        if not poisoned:
            poisoned.update(s for s in sequence_ids if s in self.matchers)
        for sequence_id in sequence_ids:
            if sequence_id in poisoned:
                raise StructuredOutputError(sequence_id, "injected: the grammar is too complex")
        return real(self, logits, sequence_ids, prefixes)

    monkeypatch.setattr(StructuredOutputs, "apply_masks", apply_masks)
    # The constrained request sits first in the batch: the row-by-row pass meets it before any other.
    constrained = greedy(structured_output=StructuredOutput(regex="[a-z ]+"))
    outputs = llm.generate(["Say hi:", *PROMPTS[:2]], [constrained, greedy(), greedy()])
    assert outputs[0].finish_reason == "error" and outputs[0].error_param == "structured_output"
    assert "too complex" in outputs[0].error
    assert [o.token_ids for o in outputs[1:]] == expected


def test_a_failed_forward_pass_ends_that_steps_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    real_run = engine.runner.run
    state = {"step": 0}

    def run(chunks, copies, **kwargs):
        state["step"] += 1
        if state["step"] == 4:
            raise RuntimeError("injected forward fault")
        return real_run(chunks, copies, **kwargs)

    monkeypatch.setattr(engine.runner, "run", run)
    outputs = llm.generate(PROMPTS[:3], greedy())
    assert [o.finish_reason for o in outputs] == ["error"] * 3
    assert all("injected forward fault" in o.error for o in outputs)
    # Nothing of the failed step was cached as computed: the same prompts now give their own tokens.
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], greedy())] == [alone(llm, p) for p in PROMPTS[:3]]


def test_a_forward_pass_that_keeps_failing_stops_the_engine_saying_why(llm, monkeypatch):
    engine = llm.engine

    def run(chunks, copies, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(engine.runner, "run", run)
    engine.add_request(PROMPTS[0], greedy())
    for _ in range(MAX_FAILED_STEPS - 1):
        engine.add_request(PROMPTS[1], greedy())
        engine.step()
    engine.add_request(PROMPTS[2], greedy())
    with pytest.raises(EngineStepError, match="the device is gone"):
        engine.step()
    for request_id in list(engine.groups):  # leave the shared engine clean for the block check
        engine.abort_request(request_id)
    engine._step_failures = 0


def test_a_detokenizer_fault_ends_its_request_alone(llm, monkeypatch):
    from pagedllm.text.detokenizer import IncrementalDetokenizer

    expected = alone(llm, PROMPTS[0])
    real_update = IncrementalDetokenizer.update

    def update(self, output_ids, final):
        if "~" in self.stop:
            raise UnicodeError("injected detokenizer fault")
        return real_update(self, output_ids, final)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    outputs = llm.generate(PROMPTS[:2], [greedy(), greedy(stop=["~"])])
    assert outputs[0].token_ids == expected and outputs[0].finish_reason == "length"
    assert outputs[1].finish_reason == "error" and "injected detokenizer fault" in outputs[1].error


# --- no row without a token ------------------------------------------------------------


def test_the_sampler_never_returns_an_id_outside_the_vocabulary():
    vocab = 50
    sampler = Sampler(seed=0)
    logits = torch.randn(6, vocab)
    logits[0] = float("-inf")  # every token masked
    logits[1] = float("nan")  # NaN everywhere
    logits[2, :10] = float("nan")  # NaN in part of the row: those tokens count as forbidden
    logits[3, 7] = float("inf")  # +inf: the largest logit
    logits[4] = float("-inf")
    logits[4, 33] = 0.0  # one allowed token
    for temperature in (0.0, 0.8):
        params = [SamplingParams(temperature=temperature, top_p=0.9, top_k=20)] * 6
        tokens = sampler(logits.clone(), params, [None] * 6).token_ids
        assert tokens[0] is None and tokens[1] is None
        assert 10 <= tokens[2] < vocab
        assert tokens[3] == 7
        assert tokens[4] == 33
        assert 0 <= tokens[5] < vocab


def test_a_finished_grammar_wins_over_min_tokens(llm):
    """guided_choice ["a"] with min_tokens 5: after "a" the grammar allows only EOS, which
    min_tokens bans; the row has no allowed token, and the request ends with "stop"."""
    params = SamplingParams(
        temperature=0.9, max_tokens=8, min_tokens=5, seed=1, structured_output=StructuredOutput(choice=("a",))
    )
    regex = SamplingParams(
        temperature=0.9, max_tokens=8, min_tokens=5, seed=2, structured_output=StructuredOutput(regex="[0-9]")
    )
    outputs = llm.generate(["Pick:", "Pick a digit:", PROMPTS[0]], [params, regex, greedy()])
    assert outputs[0].text == "a" and outputs[0].finish_reason == "stop"
    assert len(outputs[1].text) == 1 and outputs[1].text.isdigit() and outputs[1].finish_reason == "stop"
    assert outputs[2].token_ids == alone(llm, PROMPTS[0])


def test_bad_words_that_cover_every_choice_end_the_request(llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=8, bad_words=["a", "b"], structured_output=StructuredOutput(choice=("a", "b"))
    )
    out = llm.generate(["Answer:"], params)[0]
    assert out.finish_reason == "stop" and out.text == "" and out.error is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("repetition_penalty", math.nan),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("length_penalty", math.nan),
        ("top_p", math.nan),
        ("seed", 2**64),
        ("logprobs", 10**6),
        ("stop", ["x"] * 65),
        ("logit_bias", {i: 1.0 for i in range(1025)}),
        ("top_k", True),
    ],
)
def test_non_finite_and_oversized_settings_are_refused_offline(field, value):
    with pytest.raises(SamplingParamError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field
