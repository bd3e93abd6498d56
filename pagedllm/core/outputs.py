"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    """One generated sequence: one of a request's `n` samples."""

    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    delta: str = ""  # text added since the previous output of this request
    cumulative_logprob: float | None = None  # beam search: the hypothesis' summed log-probability
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty


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
