"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[TokenLogprob] | None = None
    time_to_first_token: float | None = None  # seconds from arrival to the first sampled token
    num_preemptions: int = 0
    delta: str = ""  # text added since the previous output of this request
