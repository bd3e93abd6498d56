"""A request's state as it moves through the engine (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"
    ERROR = "error"  # a fault while handling this request ended it (RequestOutput.error says which)


class PromptLengthError(ValueError):
    """A prompt (with `max_tokens` where given) that does not fit the model's context; `param`
    names the field to blame, as the API's error reports it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The one rule for both the engine and the server: the prompt leaves room for at least one
    generated token, and with `max_tokens` the whole request fits `max_model_len`."""
    if num_prompt_tokens >= max_model_len:
        raise PromptLengthError(
            f"the prompt has {num_prompt_tokens} tokens but this model's maximum context length "
            f"is {max_model_len} tokens (prompt plus at least one generated token)",
            "prompt",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise PromptLengthError(
            f"max_tokens is {max_tokens} and the prompt has {num_prompt_tokens} tokens: together over "
            f"this model's maximum context length of {max_model_len} tokens "
            f"(at most {max_model_len - num_prompt_tokens} for this prompt)",
            "max_tokens",
        )


@dataclass(eq=False)  # requests are compared by identity
class Request:
    """One sequence.  `token_ids` holds the prompt followed by the output so far.

    The one scheduling rule: `num_computed_tokens` counts the tokens whose K/V
    are in the cache; each step computes some more.  When it reaches
    `num_tokens` the step's last position yields logits and a new token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    max_model_len: int = 8192
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Per generated token: (logprob of the sampled token, [(token id, logprob)] top alternatives).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # n>1: the other samples, waiting to fork from this sequence when its prompt is computed.
    forks: list[Request] = field(default_factory=list)
    fork_parent: Request | None = None
    # The LoRA adapter it runs under: the key of one load (execution/lora_adapters.py); None: the base model.
    adapter: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self._output_token_ids: list[int] = []  # kept beside token_ids so reading it copies nothing

    def adopt_output(self, output_token_ids: list[int]) -> None:
        """Start from these output tokens (a beam that extends its parent's)."""
        self.token_ids = [*self.prompt_token_ids, *output_token_ids]
        self._output_token_ids = list(output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens: the sequence's own list, which only grows (never mutate it)."""
        return self._output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold in the cache."""
        return min(self.num_prompt_tokens + self.sampling_params.max_tokens, self.max_model_len)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add a sampled token; return why the request must stop, if it must."""
        self.token_ids.append(token_id)
        self._output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        params = self.sampling_params
        if (not params.ignore_eos and token_id == self.eos_token_id) or token_id in params.stop_token_ids:
            return FinishReason.STOP
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
