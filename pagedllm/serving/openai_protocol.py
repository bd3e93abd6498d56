"""OpenAI request bodies, checked strictly, and the errors the API answers with.

Types are strict (a string where a number belongs is a 400, never coerced).
Parameters this engine does not implement are refused with a 400 naming
them.  A field no body of this API has is a 400 naming it, as OpenAI
answers (a typo such as `max_token` would otherwise run to the context
length); `pagedllm serve --allow-unknown-fields` ignores them instead, for
clients that send extensions of another server.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedllm.core.sampling_params import SamplingParamError, SamplingParams, StructuredOutput
from pagedllm.execution.structured_output import compile_grammar
from pagedllm.serving.tool_calls import EMPTY_PARAMETERS, Tool, ToolMode, call_as_text

MAX_TOOLS = 128  # each tool's schema is compiled for every request that lists it


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field.

    `param` is the body's field (`prompt`, `messages.0.content`); pydantic's locations
    also name the union member it tried (`prompt.str`, `prompt.list[int]`), which a client
    never wrote, so those parts are dropped."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"] if not _is_type_name(part))
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return bad_request(f"{where or 'body'}: {first['msg']} (got {shown})", param=where or None)


def _is_type_name(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


class Body(BaseModel):
    """A part of a request body: strict types; fields it does not declare are kept aside
    (`model_extra`) for `unknown_fields` to name."""

    model_config = ConfigDict(strict=True, extra="allow")


def unknown_fields(value: Any, where: str = "") -> list[tuple[str, str, list[str]]]:
    """Every undeclared field in a parsed body: (its path, its name, the declared names there)."""
    found: list[tuple[str, str, list[str]]] = []
    if isinstance(value, Body):
        declared = list(type(value).model_fields)
        found += [(f"{where}{name}", name, declared) for name in value.model_extra or {}]
        for name in declared:
            found += unknown_fields(getattr(value, name), f"{where}{name}.")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += unknown_fields(item, f"{where}{i}.")
    return found


def refuse_unknown_fields(request: Body) -> None:
    """A 400 naming the first undeclared field, with the declared name it is closest to."""
    found = unknown_fields(request)
    if found:
        path, name, declared = found[0]
        close = difflib.get_close_matches(name, declared, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise bad_request(
            f"unknown field {path!r}{hint}; this server refuses fields it does not know "
            "(start it with --allow-unknown-fields to ignore them)",
            param=path,
        )


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's; accepted, nothing to obfuscate here


class _SamplingRequest(Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI's bookkeeping fields: accepted and without effect here (no stored completions,
    # no tiers, no cache keys across servers).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Extensions, as in vLLM: more sampling knobs.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* extensions (one of them).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # JSON constraints: one line with ", " and ": " (compact), or any whitespace (flexible).
    json_whitespace: Literal["compact", "flexible"] = "compact"

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The constraint the body asks for, and the field that asked (for errors)."""
        guided = {
            name: getattr(self, name)
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name) is not None
        }
        response_format = self.response_format
        kind = (response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_request(
                f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
            )
        if kind != "text":
            guided["response_format"] = response_format
        if len(guided) > 1:
            raise bad_request(f"give one structured output constraint, not {' and '.join(guided)}", next(iter(guided)))
        if not guided:
            return None, None
        ((field, value),) = guided.items()
        spec, field = self._constraint(field, value, kind)
        return dataclasses.replace(spec, whitespace=self.json_whitespace), field

    def _constraint(self, field: str, value: Any, kind: str) -> tuple[StructuredOutput, str]:
        try:
            if field == "response_format":
                if kind == "json_object":
                    return StructuredOutput(json_object=True), field
                spec = value.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise bad_request("response_format json_schema needs json_schema.schema, a JSON object", field)
                # OpenAI's `strict: false` asks for JSON Schema's own (lenient) form
                return StructuredOutput(json_schema=spec["schema"], strict=spec.get("strict") is not False), field
            if field == "guided_json":
                return StructuredOutput(json_schema=value), field
            if field == "guided_regex":
                return StructuredOutput(regex=value), field
            if field == "guided_choice":
                return StructuredOutput(choice=tuple(value)), field
            return StructuredOutput(grammar=value), field
        except SamplingParamError as error:
            raise bad_request(str(error), field) from None

    def token_bias(self) -> dict[int, float]:
        """logit_bias with its keys read as token ids (JSON keys are strings)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's settings; SamplingParams' own checks (and the grammar's) become 400s."""
        structured, field = self.structured_output()
        if structured is not None:
            try:  # here, on the HTTP side: the engine thread then finds it compiled (cached)
                compile_grammar(structured)
            except SamplingParamError as error:
                raise bad_request(str(error), field) from None
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                max_tokens=max_tokens,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.token_bias(),
                min_tokens=self.min_tokens,
                bad_words=self.bad_words or [],
                structured_output=structured,
            )
        except SamplingParamError as error:
            raise bad_request(str(error), error.param) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo and self.logprobs is not None:
            raise bad_request(
                "echo with logprobs is not supported (the prompt's log-probabilities are not computed)", "echo"
            )
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None:
            if self.best_of < self.n or self.best_of > 256:
                raise bad_request(f"best_of must be from n ({self.n}) to 256, got {self.best_of}", "best_of")
            if self.stream and self.best_of > self.n:
                raise bad_request(
                    "best_of greater than n cannot be streamed (the best are known at the end)", "best_of"
                )

    @property
    def samples(self) -> int:
        """How many samples the engine draws per prompt: best_of, or n."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch: text, token ids, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("prompt must not be empty", "prompt")
        return prompts


class ContentPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str


class MessageToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # OpenAI's other message fields (a reply's message sent back in the next request carries
    # them): accepted, not shown to the model.
    name: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates take it; OpenAI's `developer` role is a system message."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}

    def text(self) -> str:
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return call_as_text([c.model_dump() for c in self.tool_calls])
            raise bad_request(f"a {self.role} message needs content", "messages")
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Absent or true: the arguments' schema is compiled strictly (an object's undeclared
    # properties refused unless it allows them); false: JSON Schema's own lenient form.
    strict: bool | None = None


class ToolSpec(Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(Body):
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted without effect: `required` and a named choice make one call

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        mode = self.tool_mode()
        if mode is not None and mode.kind != "auto" and self.structured_output()[0] is not None:
            raise bad_request("tool_choice required or named cannot be combined with another constraint", "tool_choice")

    def tool_mode(self, template_takes_tools: bool = False) -> ToolMode | None:
        """What the tools and tool_choice ask for (None: no tools in play)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise bad_request(f"tool names must be distinct, got {names}", "tools")
        tools = tuple(
            Tool(t.function.name, t.function.description, t.function.parameters or EMPTY_PARAMETERS, t.function.strict)
            for t in self.tools
        )
        for tool in tools:  # a schema the grammar engine refuses is the client's error, said now
            try:
                compile_grammar(StructuredOutput(json_schema=tool.parameters, strict=tool.strict is not False))
            except SamplingParamError as error:
                raise bad_request(f"tool {tool.name!r}: {error}", "tools") from None
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            name = choice.function.get("name")
            if name not in names:
                raise bad_request(f"tool_choice names {name!r}, which is not among the tools {names}", "tool_choice")
            return ToolMode("named", tools, name, template_takes_tools)
        return ToolMode(choice or "auto", tools, in_template=template_takes_tools)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs)
        mode = self.tool_mode()
        constraint = mode.constraint() if mode is not None else None
        if constraint is None:
            return params
        constraint = dataclasses.replace(constraint, whitespace=self.json_whitespace)
        compile_grammar(constraint)
        return dataclasses.replace(params, structured_output=constraint)

    def conversation(self, template_takes_tools: bool = False) -> list[dict[str, str]]:
        messages = [m.for_template() for m in self.messages]
        mode = self.tool_mode(template_takes_tools)
        if mode is not None and not mode.in_template:  # the tools as a system message after the client's own
            at = 1 if messages and messages[0]["role"] == "system" else 0
            messages.insert(at, {"role": "system", "content": mode.system_message()})
        return messages

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(Body):
    """POST /tokenize: text, or a chat through the model's template (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def parse_body(model: type[Body], body: Any, allow_unknown_fields: bool = False) -> Any:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise validation_error(error) from None
    if not allow_unknown_fields:
        refuse_unknown_fields(request)
    if hasattr(request, "refuse_unsupported"):  # the sampling bodies refuse what this server does not do
        request.refuse_unsupported()
    return request
