"""Response bodies and stream chunks in OpenAI's shapes, built from engine outputs.

A request with several prompts (completions) and/or n samples has one
choice per (prompt, sample): choice index = prompt index * n + sample index.
`ChoiceTracker` remembers, per choice, how many tokens' log-probabilities were
already sent, so a stream sends each token's once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pagedllm.serving.tool_calls import ToolMode

Decode = Callable[[list[int]], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(completion: CompletionOutput) -> str | None:
    # "abort" never reaches a client: an aborted request has no one listening.
    return completion.finish_reason if completion.finished else None


def completion_logprobs(entries: list[TokenLogprob], decode: Decode, text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, alternatives as {token text: logprob}."""
    tokens = [decode([e.token_id]) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], decode: Decode) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ChoiceTracker:
    """Builds a response for one API request from the outputs of its engine requests."""

    chat: bool
    model: str
    n: int
    request_ids: list[str]  # one engine request per prompt, in prompt order
    decode: Decode
    want_logprobs: bool
    tools: ToolMode | None = None  # chat with tools: finished replies may become tool calls
    keep: int | None = None  # best_of: return only the `keep` samples of each prompt with the best log-probability
    echo: dict[str, str] | None = None  # completions with echo: each engine request's prompt text
    id: str = field(default_factory=lambda: "")
    created: int = field(default_factory=lambda: int(time.time()))
    latest: dict[str, RequestOutput] = field(default_factory=dict)
    _logprobs_sent: dict[int, int] = field(default_factory=dict)
    _text_sent: dict[int, int] = field(default_factory=dict)
    _finish_sent: set[int] = field(default_factory=set)
    _echo_sent: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.chat else "cmpl")
        self._prompt_index = {request_id: i for i, request_id in enumerate(self.request_ids)}

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def choice_index(self, output: RequestOutput, completion: CompletionOutput) -> int:
        return self._prompt_index[output.request_id] * self.n + completion.index

    def _logprobs(self, index: int, completion: CompletionOutput, text_offset: int) -> dict | None:
        if not self.want_logprobs or completion.logprobs is None:
            return None
        sent = self._logprobs_sent.get(index, 0)
        entries = completion.logprobs_since(sent)
        self._logprobs_sent[index] = sent + len(entries)
        if self.chat:
            return chat_logprobs(entries, self.decode)
        return completion_logprobs(entries, self.decode, text_offset)

    # --- streaming ---------------------------------------------------------------------

    def chunk(self, output: RequestOutput) -> dict | None:
        """The chunk for one step's output: every choice that has new text or just finished."""
        self.latest[output.request_id] = output
        choices = []
        for completion in output.outputs:
            index = self.choice_index(output, completion)
            reason = finish_reason(completion)
            if self.tools is not None:  # the reply is read whole when it ends: nothing streams before
                if reason is None or index in self._finish_sent:
                    continue
                delta, reason = self._tool_reply(completion, reason)
                self._finish_sent.add(index)
                choices.append({"index": index, "delta": delta, "logprobs": None, "finish_reason": reason})
                continue
            if not completion.delta and (reason is None or index in self._finish_sent):
                continue
            offset = self._text_sent.get(index, 0)
            self._text_sent[index] = offset + len(completion.delta)
            choice: dict = {
                "index": index,
                "logprobs": self._logprobs(index, completion, offset),
                "finish_reason": reason,
            }
            if self.chat:
                choice["delta"] = {"content": completion.delta} if completion.delta else {}
            else:
                choice["text"] = completion.delta
                if self.echo is not None and index not in self._echo_sent:  # the prompt leads the first chunk
                    self._echo_sent.add(index)
                    choice["text"] = self.echo[output.request_id] + completion.delta
            if reason is not None:
                self._finish_sent.add(index)
            choices.append(choice)
        return self._envelope(choices) if choices else None

    def role_chunk(self) -> dict:
        """Chat streams open with the assistant role, one chunk per choice."""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(self.request_ids) * self.n)
        ]
        return self._envelope(choices)

    def usage_chunk(self) -> dict:
        return {**self._envelope([]), "usage": self.usage()}

    def _envelope(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # --- whole responses ---------------------------------------------------------------

    def response(self) -> dict:
        choices = []
        for request_id in self.request_ids:
            output = self.latest[request_id]
            completions = output.outputs
            if self.keep is not None:
                completions = sorted(completions, key=lambda c: -sum(e.logprob for e in c.logprobs or []))
                completions = completions[: self.keep]
            for rank, completion in enumerate(completions):
                if self.keep is None:
                    index = self.choice_index(output, completion)
                else:
                    index = self._prompt_index[output.request_id] * self.keep + rank
                choice: dict = {
                    "index": index,
                    "logprobs": self._logprobs(index, completion, 0),
                    "finish_reason": finish_reason(completion),
                }
                if self.chat and self.tools is not None and completion.finished:
                    message, choice["finish_reason"] = self._tool_reply(completion, choice["finish_reason"])
                    for call in message.get("tool_calls", []):
                        del call["index"]  # only stream deltas number their calls
                    choice["message"] = {"role": "assistant", "content": None, **message}
                elif self.chat:
                    choice["message"] = {"role": "assistant", "content": completion.text}
                else:
                    choice["text"] = (self.echo[request_id] if self.echo is not None else "") + completion.text
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        return {**body, "choices": choices, "usage": self.usage()}

    def _tool_reply(self, completion: CompletionOutput, reason: str | None) -> tuple[dict, str | None]:
        """({"tool_calls": [...]}, "tool_calls") when a finished reply is a call, else its text as content."""
        calls = self.tools.parse(completion.text) if reason == "stop" else None
        if calls is None:
            return {"content": completion.text}, reason
        reply: dict = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        content = self.tools.content_besides_calls(completion.text)
        if content is not None:
            reply["content"] = content
        return reply, "tool_calls"

    def usage(self) -> dict:
        outputs = [self.latest[r] for r in self.request_ids if r in self.latest]
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        generated = sum(c.num_tokens for o in outputs for c in o.outputs)
        return usage(prompt, generated)
