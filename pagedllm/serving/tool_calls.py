"""Tool calls for /v1/chat/completions: the tools shown to the model, the constraint that
`tool_choice` asks for, and the model's reply read back as calls.

Where the model's chat template renders tools itself (it names `tools`, as Qwen's and
Hermes-style templates do), the tools go to the template and `auto` reads the calls in
that family's format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(text outside them stays the content).  Otherwise the tools go into a system message,
with the instruction to call one by replying with only a JSON object `{"name": ...,
"arguments": {...}}`.  `tool_choice`:

- a named function: the reply is constrained to that function's parameters schema (the
  grammar guarantees the arguments validate); the call is built around them;
- `required`: the reply is constrained to `{"name": one of the tools, "arguments": that
  tool's schema}`;
- `auto` (the default when tools are given): the reply is free; when it is exactly such
  a JSON object naming a tool, it becomes a call, otherwise it is the message's content;
- `none`: the tools are not shown and nothing is parsed.

A reply that became calls has `finish_reason: "tool_calls"` and `content: null`.  An
assistant message with `tool_calls` in a later request is shown to the model in the same
JSON form, and `role: "tool"` messages as the tool's output.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedllm.core.sampling_params import StructuredOutput
from pagedllm.core.strict_schema import strict_schema

EMPTY_PARAMETERS = {"type": "object"}
TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict
    strict: bool | None = None  # OpenAI's `strict`: only an explicit False compiles `parameters` leniently

    @property
    def constrained_parameters(self) -> dict:
        """The schema the arguments are held to: strict unless the tool asked otherwise."""
        return self.parameters if self.strict is False else strict_schema(self.parameters)


@dataclass(frozen=True)
class ToolMode:
    """What this request does with its tools: 'auto', 'required' or 'named' (`name` set)."""

    kind: str
    tools: tuple[Tool, ...]
    name: str | None = None
    in_template: bool = False  # the chat template renders the tools (and its model writes <tool_call> blocks)

    def openai_tools(self) -> list[dict]:
        """The tools in OpenAI's shape, for a chat template that renders them."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters},
            }
            for t in self.tools
        ]

    def constraint(self) -> StructuredOutput | None:
        if self.kind == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return StructuredOutput(json_schema=tool.parameters, strict=tool.strict is not False)
        if self.kind == "required":
            definitions: dict[str, dict] = {}
            calls = [_call_schema(t, f"tool{i}", definitions) for i, t in enumerate(self.tools)]
            schema: dict = {"anyOf": calls}
            if definitions:
                schema["$defs"] = definitions
            return StructuredOutput(json_schema=schema, strict=False)  # each tool's part made strict or not
        return None

    def system_message(self) -> str:
        listing = [
            {"name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.parameters}
            for t in self.tools
        ]
        return (
            "You can call these functions. To call one, reply with only a JSON object of the form "
            '{"name": <function name>, "arguments": <arguments object>}.\n' + json.dumps(listing)
        )

    def parse(self, text: str) -> list[dict] | None:
        """The calls in a finished reply (OpenAI's `tool_calls`), or None when it is plain content."""
        if self.kind == "named":
            return [_call(self.name, text)]
        if self.in_template and self.kind == "auto":
            blocks = TOOL_CALL_BLOCK.findall(text)
            calls = [self._read_call(block) for block in blocks]
            return calls if calls and all(calls) else None
        call = self._read_call(text)
        return [call] if call else None

    def content_besides_calls(self, text: str) -> str | None:
        """The text around `<tool_call>` blocks (None when there is none)."""
        if not self.in_template:
            return None
        return TOOL_CALL_BLOCK.sub("", text).strip() or None

    def _read_call(self, text: str) -> dict | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        names = {t.name for t in self.tools}
        if (
            not isinstance(value, dict)
            or value.get("name") not in names
            or not isinstance(value.get("arguments"), dict)
        ):
            return None
        return _call(value["name"], json.dumps(value["arguments"]))


def _call_schema(tool: Tool, prefix: str, definitions: dict[str, dict]) -> dict:
    """`{"name": <the tool>, "arguments": <its parameters>}`.  A schema that refers into itself
    (`$ref` to `#/$defs/...`, `#/definitions/...` or `#`) is moved under the root's `$defs` as
    `prefix`, its own definitions beside it as `prefix.NAME`, and its references rewritten to
    match: nested under `arguments` as it is, they would point at nothing."""
    parameters = tool.constrained_parameters
    if not _has_local_refs(parameters):
        arguments = parameters
    else:
        own = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
        body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
        definitions[prefix] = _rewrite_refs(body, prefix)
        for name, definition in own.items():
            definitions[f"{prefix}.{name}"] = _rewrite_refs(definition, prefix)
        arguments = {"$ref": f"#/$defs/{prefix}"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _has_local_refs(schema: object) -> bool:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_refs(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_local_refs(v) for v in schema)
    return False


def _rewrite_refs(schema: object, prefix: str) -> object:
    if isinstance(schema, list):
        return [_rewrite_refs(v, prefix) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rewrite_refs(v, prefix) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                out["$ref"] = f"#/$defs/{prefix}.{ref[len(root) :]}"
                break
        else:  # a pointer into the parameters themselves
            out["$ref"] = f"#/$defs/{prefix}{ref[1:]}"
    return out


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def call_as_text(tool_calls: list[dict]) -> str:
    """An assistant message's earlier calls, in the form the model was asked to write them."""
    texts = []
    for call in tool_calls:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = function.get("arguments")
        texts.append(json.dumps({"name": function.get("name"), "arguments": arguments}))
    return "\n".join(texts)
