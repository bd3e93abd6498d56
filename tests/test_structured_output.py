"""Structured outputs on the real SmolLM2 (float32): JSON schemas, any JSON object, regular
expressions, a choice and a GBNF grammar, enforced token by token; replies always parse and
validate, also sampled at temperature 0.8 and with n > 1; a constrained row in a batch gets
what it gets alone; bad constraints are clear errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.core.sampling_params import SamplingParamError, StructuredOutput

SCHEMAS = [
    {  # nested object, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    {  # array of enums, bounded
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
        "required": ["colours"],
        "additionalProperties": False,
    },
    {  # numbers and booleans
        "type": "object",
        "properties": {"score": {"type": "number"}, "passed": {"type": "boolean"}},
        "required": ["score", "passed"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]
QUESTIONS = [
    "Describe a person and where they live.",
    "List some colours you like.",
    "Grade this essay.",
    "Give me a few items with ids.",
    "Reply in JSON.",
]


@pytest.fixture
def llm(make_llm):
    return make_llm(kv_cache_memory="128MiB")


def chat(llm, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_json_schema_replies_parse_and_validate_when_sampled(llm, schema_index):
    schema = SCHEMAS[schema_index]
    prompts = [chat(llm, q) for q in QUESTIONS]
    params = SamplingParams(
        temperature=0.8, seed=schema_index, max_tokens=160, structured_output=StructuredOutput(json_schema=schema)
    )
    for output in llm.generate(prompts, params):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)


def test_json_object_regex_choice_and_grammar(llm):
    prompt = chat(llm, "What is the capital of France?")
    greedy = dict(temperature=0.7, seed=5, max_tokens=80)
    anything = llm.generate([prompt], SamplingParams(**greedy, structured_output=StructuredOutput(json_object=True)))
    assert isinstance(json.loads(anything[0].text), dict)
    phone = llm.generate(
        [prompt], SamplingParams(**greedy, structured_output=StructuredOutput(regex=r"\(\d{3}\) \d{3}-\d{4}"))
    )
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone[0].text), phone[0].text
    choice = llm.generate(
        [prompt] * 4, SamplingParams(**greedy, structured_output=StructuredOutput(choice=("Paris", "Rome", "Berlin")))
    )
    assert all(o.text in ("Paris", "Rome", "Berlin") for o in choice)
    grammar = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "maybe"'
    ebnf = llm.generate([prompt] * 3, SamplingParams(**greedy, structured_output=StructuredOutput(grammar=grammar)))
    assert all(re.fullmatch(r"The answer is (yes|no|maybe)\.", o.text) for o in ebnf), [o.text for o in ebnf]


def test_samples_and_batch_neighbours(llm):
    """n > 1: every sample has its own matcher; a constrained row beside a plain one equals itself alone."""
    schema = SCHEMAS[1]
    # Greedy: a sampled draw can flip on float rounding that differs between batch sizes.
    constrained = SamplingParams(
        temperature=0.0, max_tokens=60, n=3, structured_output=StructuredOutput(json_schema=schema)
    )
    plain = SamplingParams(temperature=0.0, max_tokens=30)
    prompts = [chat(llm, QUESTIONS[1]), chat(llm, QUESTIONS[0])]
    engine = llm.engine
    engine.add_request(prompts[0], constrained, request_id="c")
    engine.add_request(prompts[1], plain, request_id="p")
    together = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                together[output.request_id] = [c.token_ids for c in output.outputs]
    alone_c = llm.generate([prompts[0]], constrained)[0]
    alone_p = llm.generate([prompts[1]], plain)[0]
    assert together["c"] == [c.token_ids for c in alone_c.outputs]
    assert together["p"] == [c.token_ids for c in alone_p.outputs]
    for sample in alone_c.outputs:
        jsonschema.validate(json.loads(sample.text), schema)
    assert not engine.runner.structured.matchers  # every matcher released


def test_a_constrained_request_cut_by_max_tokens_says_length(llm):
    out = llm.generate(
        [chat(llm, QUESTIONS[0])],
        SamplingParams(temperature=0, max_tokens=5, structured_output=StructuredOutput(json_schema=SCHEMAS[0])),
    )
    assert out[0].finish_reason == "length" and out[0].text.startswith("{")


def test_bad_constraints_are_clear_errors(llm):
    prompt = chat(llm, "hi")
    for spec, words in [
        (StructuredOutput(regex="(unclosed"), "invalid regex"),
        (StructuredOutput(json_schema={"type": "bogus"}), "invalid json schema"),
        (StructuredOutput(json_schema="{not json"), "not JSON"),
        (StructuredOutput(grammar="root ::= undefined_rule"), "invalid grammar"),
    ]:
        with pytest.raises(SamplingParamError, match=words) as error:
            llm.generate([prompt], SamplingParams(structured_output=spec))
        assert error.value.param == "structured_output"
    with pytest.raises(SamplingParamError, match="exactly one of"):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(SamplingParamError, match="exactly one of"):
        StructuredOutput()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.runner.structured.matchers


@pytest.mark.parametrize("vocab, width", [(49152, 49152), (49152, 49280), (100, 97), (49150, 49152)])
def test_grammar_masks_equal_llguidance_eager_and_in_cpp(vocab, width):
    """The masks are applied without llguidance's torch.compile helper (seconds of compiling on the
    first constrained step): eagerly in torch, and by the C++ kernel; both give its exact result."""
    import llguidance.torch as llt

    from pagedllm.execution.structured_output import apply_bitmask
    from pagedllm.layers.cpu_kernels import load_cpu_kernels

    torch.manual_seed(0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
    bitmask[:, ::3] = 0  # whole words forbidden or allowed, as a grammar's masks mostly are
    bitmask[:, 1::3] = -1
    logits = torch.randn(5, width)
    rows = [0, 2, 4]
    # The rule: token t of a masked row keeps its logit when t < 32 * words and its bit is 1.
    bits = [
        [(int(bitmask[j, t // 32]) >> (t % 32)) & 1 if t < 32 * words else 0 for t in range(width)] for j in range(3)
    ]
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(torch.tensor(bits) == 0, float("-inf"))
    if width == 32 * words:  # llguidance's helper, where its shapes allow, run as written (eagerly):
        # torch.compile'd under torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, what an AVX2-only
        # CPU runs) it masked the wrong tokens with torch 2.13.
        theirs = logits[rows].clone()
        llt.apply_token_bitmask_inplace_kernel.__wrapped__(theirs, bitmask)
        assert torch.equal(theirs, expected[rows])
    eager = logits.clone()
    eager[rows] = apply_bitmask(logits[rows], bitmask)
    assert torch.equal(eager, expected)
    kernels = load_cpu_kernels()
    if kernels is not None:
        in_cpp = logits.clone()
        kernels.mask_rows(in_cpp, bitmask, rows)
        assert torch.equal(in_cpp, expected)
