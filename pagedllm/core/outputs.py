"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


class CompletionOutput:
    """One generated sequence: one of a request's `n` samples.

    `token_ids` and `logprobs` are read from the sequence's own growing lists up to this
    output's length, and built only when read: the engine hands out an output per request
    every step, and copying every token so far each time would cost O(length) a step,
    O(length^2) a request.  The lists only ever grow, so an output stays true after later steps.
    """

    __slots__ = (
        "index",
        "text",
        "finished",
        "finish_reason",
        "num_preemptions",
        "delta",
        "cumulative_logprob",
        "score",
        "num_tokens",
        "_token_ids",
        "_logprobs",
    )

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finished: bool,
        finish_reason: str | None,  # "stop", "length", "abort", "error" or None while running
        logprobs: list[tuple[float, list[tuple[int, float]]]] | list[TokenLogprob] | None = None,
        num_preemptions: int = 0,
        delta: str = "",  # text added since the previous output of this request
        cumulative_logprob: float | None = None,  # beam search: the hypothesis' summed log-probability
        score: float | None = None,  # beam search: cumulative_logprob / len(token_ids) ** length_penalty
        num_tokens: int | None = None,  # how much of `token_ids` (and `logprobs`) is this output's
    ) -> None:
        self.index = index
        self.text = text
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_preemptions = num_preemptions
        self.delta = delta
        self.cumulative_logprob = cumulative_logprob
        self.score = score
        self.num_tokens = len(token_ids) if num_tokens is None else num_tokens
        self._token_ids = token_ids
        self._logprobs = logprobs

    @property
    def token_ids(self) -> list[int]:
        return list(self._token_ids[: self.num_tokens])

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return None if self._logprobs is None else self.logprobs_since(0)

    def logprobs_since(self, start: int) -> list[TokenLogprob]:
        """The entries of tokens start .. num_tokens - 1 (what a stream has not sent yet)."""
        if self._logprobs is None:
            return []
        entries = []
        for i in range(start, min(self.num_tokens, len(self._logprobs))):
            entry = self._logprobs[i]
            if not isinstance(entry, TokenLogprob):
                logprob, top = entry
                entry = TokenLogprob(self._token_ids[i], logprob, top)
            entries.append(entry)
        return entries

    def with_delta(self, delta: str) -> CompletionOutput:
        """This output with `delta` in place of its own (coalescing outputs a consumer has not read)."""
        copy = CompletionOutput.__new__(CompletionOutput)
        for name in CompletionOutput.__slots__:
            setattr(copy, name, getattr(self, name))
        copy.delta = delta
        return copy

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, num_tokens={self.num_tokens}, "
            f"finished={self.finished}, finish_reason={self.finish_reason!r})"
        )


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt and its completions (one per sample, by index).

    `text`, `token_ids`, `finish_reason`, `logprobs`, `delta` and
    `num_preemptions` are those of the first completion, the only one when n=1.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # every completion is finished
    time_to_first_token: float | None = None  # seconds from arrival to the first sampled token
    error: str | None = None  # set when a fault ended this request (finish reason "error")
    # The setting at fault when the request's own input caused it ("structured_output": a grammar
    # too complex for the grammar engine); None when the fault was the engine's.
    error_param: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def delta(self) -> str:
        return self.outputs[0].delta

    @property
    def num_preemptions(self) -> int:
        return self.outputs[0].num_preemptions
