"""Strict JSON schemas: objects closed unless they say otherwise, checked on the schema itself
(milliseconds), through the grammar engine, and from a request body's `strict` fields."""

from __future__ import annotations

import functools

import pytest

from pagedllm.core.sampling_params import StructuredOutput
from pagedllm.core.strict_schema import strict_schema

WEATHER = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location"],
}


def test_objects_that_list_properties_are_closed_at_every_depth_without_changing_the_argument():
    schema = {
        "type": "object",
        "properties": {
            # a property named "properties" is a property, not the keyword
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "list": {"type": "array", "items": {"type": "object", "properties": {"b": {}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"c": {}}}, {"type": "null"}]},
        },
        "$defs": {"d": {"type": "object", "properties": {"e": {}}}},
    }
    original = repr(schema)
    closed = strict_schema(schema)
    assert repr(schema) == original
    assert closed["additionalProperties"] is False
    inner = closed["properties"]["properties"]
    assert inner["additionalProperties"] is False and "additionalProperties" not in inner["properties"]
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},
        {"type": "object", "properties": {"a": {}}, "$ref": "#/$defs/x", "$defs": {"x": {}}},
        {"type": "object"},  # no properties listed: any object, as the schema says
    ],
)
def test_a_schema_that_says_it_is_open_or_combines_parts_keeps_its_top_level_form(schema):
    assert strict_schema(schema).get("additionalProperties") == schema.get("additionalProperties")


def test_all_of_members_stay_open_so_they_can_combine():
    schema = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert all("additionalProperties" not in part for part in strict_schema(schema)["allOf"])


@functools.cache
def _grammar_tokenizer():
    pytest.importorskip("llguidance")
    import llguidance
    import llguidance.hf

    from pagedllm.models.loader import default_model_path
    from pagedllm.text.tokenizer import Tokenizer

    return llguidance, llguidance.hf.from_tokenizer(Tokenizer(default_model_path()).hf)


def accepts(spec: StructuredOutput, text: str) -> bool:
    from pagedllm.execution.structured_output import compile_grammar

    llguidance, tokenizer = _grammar_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, compile_grammar(spec))
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_the_grammar_refuses_an_undeclared_key_unless_strict_is_false():
    declared, extra = '{"location": "Boston", "unit": "celsius"}', '{"location": "Boston", "date": "today"}'
    assert accepts(StructuredOutput(json_schema=WEATHER), declared)
    assert not accepts(StructuredOutput(json_schema=WEATHER), extra)
    assert accepts(StructuredOutput(json_schema=WEATHER, strict=False), extra)


def test_a_request_body_asks_for_the_lenient_form_with_openai_strict_false():
    from pagedllm.serving.openai_protocol import ChatCompletionRequest, parse_body

    def constraint(**body) -> StructuredOutput:
        request = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body})
        return request.sampling_params(max_tokens=8, logprobs=None).structured_output

    def tool(**function) -> dict:
        return {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, **function}}

    named = {"type": "function", "function": {"name": "get_weather"}}
    extra = '{"location": "Boston", "date": "today"}'
    assert not accepts(constraint(tools=[tool()], tool_choice=named), extra)
    assert not accepts(constraint(tools=[tool(strict=True)], tool_choice=named), extra)
    assert accepts(constraint(tools=[tool(strict=False)], tool_choice=named), extra)
    required = '{"name": "get_weather", "arguments": ' + extra + "}"
    assert not accepts(constraint(tools=[tool()], tool_choice="required"), required)
    assert accepts(constraint(tools=[tool(strict=False)], tool_choice="required"), required)
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    assert not accepts(constraint(response_format=schema), extra)
    lenient = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": False}}
    assert accepts(constraint(response_format=lenient), extra)


@pytest.mark.parametrize(
    "body,path,hint",
    [
        ({"max_token": 5}, "max_token", "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi", "contnet": "x"}]}, "messages.0.contnet", "content"),
        ({"tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]}, "tools.0.function.paramters",
         "parameters"),
        ({"stream": True, "stream_options": {"include_usage": True, "usage": 1}}, "stream_options.usage", None),
    ],
)  # fmt: skip
def test_an_unknown_field_is_a_400_naming_it_unless_the_server_allows_them(body, path, hint):
    from pagedllm.serving.openai_protocol import APIError, ChatCompletionRequest, parse_body

    full = {"messages": [{"role": "user", "content": "hi"}]} | body
    with pytest.raises(APIError) as raised:
        parse_body(ChatCompletionRequest, full)
    error = raised.value
    assert error.status == 400 and error.param == path and f"unknown field {path!r}" in error.message
    assert (f"did you mean {hint!r}" in error.message) if hint else "did you mean" not in error.message
    assert "--allow-unknown-fields" in error.message
    parse_body(ChatCompletionRequest, full, allow_unknown_fields=True)


def test_openai_bookkeeping_fields_and_a_reply_message_sent_back_are_accepted():
    from pagedllm.serving.openai_protocol import ChatCompletionRequest, parse_body

    reply = {"role": "assistant", "content": "Hi!", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": None}  # fmt: skip
    body = {
        "messages": [{"role": "user", "content": "hi", "name": "ann"}, reply, {"role": "user", "content": "and?"}],
        "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER, "strict": True}}],
    }  # fmt: skip
    parse_body(ChatCompletionRequest, body)
