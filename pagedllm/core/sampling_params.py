"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

MAX_N = 256  # samples per request: each is a sequence with its own blocks once it diverges
# Bounds on list-valued settings: each costs work every step (stop strings are searched in
# every new piece of text, bad words checked per step), so one request must not bring thousands.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 256
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 1024  # beam search asks for 2 x beam_width
MAX_SEED = 2**63 - 1 - MAX_N  # n samples draw with seed + index, which torch takes as a 64-bit integer


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint every generated token must keep satisfiable: exactly one of a JSON schema
    (a dict or its JSON text), any JSON object, a regular expression, one of a list of
    strings, or a grammar (Lark syntax, or GBNF/EBNF with `::=` rules).  Enforced token by
    token with a grammar engine (pagedllm/execution/structured_output.py)."""

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON (a schema or json_object): "compact" allows no whitespace beyond the grammar engine's
    # compact separators; "flexible" allows any (a small model may then pad its reply with newlines).
    whitespace: str = "compact"
    # A JSON schema's objects that list `properties` and say nothing of other keys allow none
    # (pagedllm/core/strict_schema.py), as OpenAI's strict mode does; False keeps JSON Schema's
    # own default (any undeclared key), which lets a small model add keys until max_tokens.
    strict: bool = True

    def __post_init__(self) -> None:
        if self.whitespace not in ("compact", "flexible"):
            raise SamplingParamError(
                "structured_output", f"whitespace must be 'compact' or 'flexible', got {self.whitespace!r}"
            )
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None] + (
            ["json_object"] if self.json_object else []
        )
        if len(given) != 1:
            raise SamplingParamError(
                "structured_output",
                f"invalid sampling parameter: structured_output takes exactly one of json_schema, json_object, "
                f"regex, choice or grammar; got {given or 'none'}",
            )
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise SamplingParamError(
                    "structured_output", "invalid sampling parameter: choice must be non-empty strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))


class SamplingParamError(ValueError):
    """A bad sampling setting; `param` names the field (the server reports it as OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"invalid sampling parameter: {message}")
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy.  `top_k` 0 (or -1) and `top_p` 1 and `min_p` 0
    disable those filters.  `logprobs=k` returns, for every generated token,
    its log-probability and the k most likely alternatives, computed from the
    model's raw distribution (before temperature and filters).  A `stop`
    string ends generation and is cut from the returned text; a token in
    `stop_token_ids` (or EOS unless `ignore_eos`) ends generation and is kept
    in `token_ids` but not in the text.

    Penalties and bias change the logits before sampling (greedy included), as vLLM
    does: `repetition_penalty` (transformers' rule over prompt and output tokens: a
    seen token's positive logit is divided by it, a negative one multiplied),
    `presence_penalty` and `frequency_penalty` (OpenAI's rule over the output so far:
    logit -= frequency_penalty * count + presence_penalty * (count > 0)), then
    `logit_bias` (token id -> value added, -100 to 100).  `min_tokens` bans EOS and
    `stop_token_ids` until that many tokens are out.  `bad_words` are never generated:
    the engine turns each into its token ids (with and without a leading space, into
    `bad_words_token_ids`), and a word's last token is banned whenever the tokens before
    it have just been generated.

    When the rules leave a step no token to choose (a complete grammar allows only EOS while
    `min_tokens` bans it; `bad_words` cover every token a grammar allows), the request ends
    there with finish reason "stop" and no further token: a complete grammar wins over
    `min_tokens`, and nothing is sampled from outside what the rules allow.  NaN logits count
    as forbidden; a row with nothing else left ends the same way.  The sampler never returns
    an id outside the vocabulary.  Every number must be finite (NaN and infinities are
    refused), and list-valued settings are bounded (`MAX_STOP_STRINGS` and the rest above).

    `beam_width=W > 1` turns on beam search (see `pagedllm/core/beam_search.py`):
    sampling settings are ignored, `length_penalty` and `early_stopping` act as
    in transformers, and the request returns its best `n` (at most W)
    hypotheses, best first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(message: str) -> SamplingParamError:
            return SamplingParamError(message.split(" ", 1)[0], message)  # every message starts with its field

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer from 1 to {MAX_N}, got {self.n!r}")
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_N:
            raise bad(f"beam_width must be an integer from 1 to {MAX_N}, got {self.beam_width!r}")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise bad(f"n ({self.n}) cannot exceed beam_width ({self.beam_width}): it counts returned beams")
        if not _is_finite(self.length_penalty):
            raise bad(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise bad(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not _is_int(self.max_tokens):
            raise bad(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad(f"seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad(f"stop must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative integers, got {_short(self.stop_token_ids)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids")
        bias = self.logit_bias.items()
        if any(not _is_int(t) or t < 0 or not _is_finite(v) or not -100 <= v <= 100 for t, v in bias):
            raise bad(f"logit_bias must map token ids (>= 0) to numbers in [-100, 100], got {_short(self.logit_bias)}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if len(self.bad_words) > MAX_BAD_WORDS or len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise bad(f"bad_words takes at most {MAX_BAD_WORDS} words")
        if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
            raise bad(f"bad_words must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if any(
            not ids or len(ids) > MAX_STOP_STRING_CHARS or any(not _is_int(t) or t < 0 for t in ids)
            for ids in self.bad_words_token_ids
        ):
            shown = _short(self.bad_words_token_ids)
            raise bad(f"bad_words_token_ids must be non-empty lists of token ids, got {shown}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) cannot exceed max_tokens ({self.max_tokens})")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise bad(f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}")
        if self.beam_width > 1 and self.structured_output is not None:
            raise bad("beam_width > 1 takes no structured_output (beams rank raw log-probabilities)")
        if self.beam_width > 1 and self.processes_logits:
            raise bad("beam_width > 1 takes no penalties, logit_bias or min_tokens (beams rank raw log-probabilities)")

    def for_sample(self, index: int) -> SamplingParams:
        """The settings of sample `index` of an n>1 request: one sequence, seed + index when seeded."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def processes_logits(self) -> bool:
        """Whether the logits need penalties, bias or a min_tokens ban before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words_token_ids
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real number, not NaN or infinite (Python's json reads NaN and Infinity; they are no setting)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range: no setting either
        return False


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
