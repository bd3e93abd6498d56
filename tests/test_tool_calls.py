"""Reading a reply as tool calls, and the constraint each tool_choice asks for (no model)."""

import json

from pagedllm.serving.tool_calls import Tool, ToolMode, call_as_text

WEATHER = Tool("get_weather", "The weather", {"type": "object", "properties": {"city": {"type": "string"}}})
TIME = Tool("get_time", None, {"type": "object"})


def test_auto_reads_a_call_only_when_the_reply_is_exactly_one():
    auto = ToolMode("auto", (WEATHER, TIME))
    (call,) = auto.parse('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert auto.parse("It is sunny in Paris.") is None
    assert auto.parse('{"name": "unknown", "arguments": {}}') is None
    assert auto.parse('{"name": "get_weather", "arguments": "Paris"}') is None
    assert auto.constraint() is None


def test_named_and_required_constraints():
    named = ToolMode("named", (WEATHER, TIME), "get_weather")
    assert named.constraint().json_schema == WEATHER.parameters
    assert named.parse('{"city": "Rome"}')[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    required = ToolMode("required", (WEATHER, TIME)).constraint().json_schema
    assert [s["properties"]["name"]["const"] for s in required["anyOf"]] == ["get_weather", "get_time"]
    assert "get_weather" in ToolMode("auto", (WEATHER,)).system_message()


def test_earlier_calls_are_shown_in_the_form_the_model_writes_them():
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}}]
    assert json.loads(call_as_text(calls)) == {"name": "get_time", "arguments": {"timezone": "UTC"}}


def test_a_template_that_renders_tools_gets_them_and_its_tool_call_blocks_are_read():
    from pagedllm.models.loader import default_model_path
    from pagedllm.text.tokenizer import Tokenizer

    mode = ToolMode("auto", (WEATHER, TIME), in_template=True)
    reply = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    (call,) = mode.parse(reply)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert mode.content_besides_calls(reply) == "Let me look."
    assert mode.parse("No call here.") is None
    assert mode.parse('<tool_call>{"name": "nope", "arguments": {}}</tool_call>') is None

    tokenizer = Tokenizer(default_model_path())
    assert not tokenizer.template_takes_tools  # SmolLM2's template: the tools go into a system message instead
    tokenizer.hf.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    )
    assert tokenizer.template_takes_tools
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], mode.openai_tools())
    assert "<tools>get_weather;get_time;</tools>" in tokenizer.decode(ids)
