"""Structured outputs: every sampled token keeps the output a prefix of what a grammar accepts.

The grammar engine is llguidance (PyPI `llguidance`: a Rust library with no Python
dependencies, CPU wheels; xgrammar, the other choice, pulls in triton).  A constraint
(`StructuredOutput`) becomes a grammar string once (cached); each constrained sequence
gets its own matcher, which the model runner advances with every sampled token.  Before
sampling, the masks of every constrained row in the step are filled into one bitmask and
applied to the logits in one batched call: tokens the grammar forbids get -inf.  Once the
grammar is complete only EOS is allowed, so a constrained request ends with `stop`, or
`length` when `max_tokens` comes first.

JSON (a schema, `json_object`, tool calls) is compact by default: one line, with `", "`
between items and `": "` after keys (SmolLM2 at temperature 0 loops on `{"a":1,"a":...`
without the spaces), so a small model cannot fill its reply with newlines until
`max_tokens` cuts it; `whitespace="flexible"` allows any whitespace.  Properties come
in the schema's own order.  Schemas are strict by default: an object that lists its
properties allows no others unless it says so (pagedllm/core/strict_schema.py).

A big schema costs seconds to turn into a matcher (1.7 s for a 1 MB schema here), which
must not happen on the engine thread between steps: `prepare` builds the first matcher
on the caller's thread (the server's preparation thread), and `add` copies it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict

import torch

from pagedllm.core.sampling_params import SamplingParamError, StructuredOutput
from pagedllm.core.strict_schema import strict_schema

logger = logging.getLogger("pagedllm")


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise SamplingParamError(
            "structured_output", "structured outputs need the llguidance package: pip install llguidance"
        ) from None
    return llguidance


@functools.lru_cache(maxsize=256)
def _compile(kind: str, text: str, flexible_whitespace: bool = False) -> str:
    """The llguidance grammar for one constraint; raises SamplingParamError naming what is wrong."""
    llg = _llguidance()
    try:
        grammar = _grammar_text(llg, kind, text, flexible_whitespace)
    except (ValueError, RuntimeError) as error:  # a grammar the converter cannot read
        raise SamplingParamError(
            "structured_output", f"invalid {kind.replace('_', ' ')}: {_short(str(error))}"
        ) from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise SamplingParamError("structured_output", f"invalid {kind.replace('_', ' ')}: {_short(error)}")
    return grammar


def _grammar_text(llg, kind: str, text: str, flexible_whitespace: bool) -> str:
    if kind == "json_schema":
        if flexible_whitespace:
            defaults = {"whitespace_flexible": True}
        else:  # one space after "," and ":", as json.dumps writes: small models keep to it better than none
            defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
    elif kind == "regex":
        grammar = llg.grammar_from("regex", text)
    elif kind == "grammar":
        grammar = llg.grammar_from("grammar", text)  # Lark, or GBNF (`::=` rules)
    else:
        raise KeyError(kind)
    return grammar


def compile_grammar(spec: StructuredOutput) -> str:
    """The grammar of a constraint, kept on the (frozen) constraint once made: a big schema is
    serialized once, on the thread that prepares the request, not again on the engine thread."""
    grammar = spec.__dict__.get("_grammar")
    if grammar is None:
        grammar = _compile_spec(spec)
        object.__setattr__(spec, "_grammar", grammar)
    return grammar


def _compile_spec(spec: StructuredOutput) -> str:
    flexible = spec.whitespace == "flexible"
    if spec.json_object:
        return _compile("json_schema", '{"type": "object"}', flexible)
    if spec.json_schema is not None:
        schema = spec.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise SamplingParamError("structured_output", f"invalid json schema: not JSON ({error})") from None
        if not isinstance(schema, dict):
            raise SamplingParamError("structured_output", "invalid json schema: it must be a JSON object")
        if spec.strict:
            schema = strict_schema(schema)
        return _compile("json_schema", json.dumps(schema), flexible)  # the schema's own key order
    if spec.regex is not None:
        return _compile("regex", spec.regex)
    if spec.choice is not None:
        import re

        return _compile("regex", "|".join(f"({re.escape(c)})" for c in spec.choice))
    return _compile("grammar", spec.grammar)


class StructuredOutputs:
    """The matchers of the running constrained sequences, and their masks for a step."""

    PREPARED = 32  # matchers kept ready to copy, by grammar (most recent first)

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_id: int | None, kernels=None) -> None:
        """`kernels`: the C++ CPU kernels, whose `mask_rows` applies the masks on the CPU (0.3 ms for
        32 rows; eager torch takes ~8 ms)."""
        self.kernels = kernels
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = None  # the grammar engine's view of the vocabulary (~0.4 s for SmolLM2)
        self._lock = threading.Lock()  # `prepare` runs on other threads than the engine's
        self._prepared: OrderedDict[str, object] = OrderedDict()
        self.matchers: dict[str, object] = {}

    def build_tokenizer(self) -> None:
        """Build the grammar engine's tokenizer now, and run one small constraint through every
        stage (compile, matcher, mask): a server does so at start, in the background, rather than
        make its first constrained request wait (seconds: imports, the vocabulary's trie)."""
        self.prepare(StructuredOutput(choice=("warm",)))

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                self._tokenizer = llg.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return self._tokenizer

    def _bitmask(self, rows: int) -> torch.Tensor:
        """An all-allowed bitmask for `rows` rows (llguidance's own allocator asks CUDA whether to pin)."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def prepare(self, spec: StructuredOutput) -> None:
        """Compile `spec` and build its first matcher on the calling thread, for `add` to copy."""
        grammar = compile_grammar(spec)
        with self._lock:
            if grammar in self._prepared:
                self._prepared.move_to_end(grammar)
                return
        matcher = self._new_matcher(grammar, first_mask=True)
        with self._lock:
            self._prepared[grammar] = matcher
            while len(self._prepared) > self.PREPARED:
                self._prepared.popitem(last=False)

    def _new_matcher(self, grammar: str, first_mask: bool = False):
        """A matcher for `grammar`; with `first_mask`, its first mask computed too, so that a grammar
        the engine gives up on at once (too complex) is refused here, not in a step."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self._llg_tokenizer(), grammar)
        if first_mask and not matcher.is_error():
            llg.torch.fill_next_token_bitmask(matcher, self._bitmask(1), 0)
        if matcher.is_error():
            raise SamplingParamError("structured_output", f"invalid structured output: {_short(matcher.get_error())}")
        return matcher

    def add(self, sequence_ids: list[str], spec: StructuredOutput) -> None:
        """One matcher per sequence: copies of a prepared one, else built here."""
        grammar = compile_grammar(spec)
        with self._lock:
            template = self._prepared.get(grammar)
        if template is None:
            template = self._new_matcher(grammar)
        for sequence_id in sequence_ids:
            self.matchers[sequence_id] = template.deep_copy()

    def release(self, sequence_id: str) -> None:
        self.matchers.pop(sequence_id, None)

    def apply_masks(
        self, logits: torch.Tensor, sequence_ids: list[str], prefixes: list[list[int]] | None = None
    ) -> torch.Tensor:
        """logits with every constrained row's forbidden tokens at -inf (in place).  `prefixes`: per
        row, draft tokens the row follows (speculative decoding; a sequence's rows come in order of
        growing prefix): its mask is the grammar's after them.  The matchers end as they began."""
        rows = [i for i, sid in enumerate(sequence_ids) if sid in self.matchers]
        if not rows:
            return logits
        llt = _llguidance().torch
        bitmask = self._bitmask(len(rows))
        consumed: dict[str, int] = {}  # draft tokens each matcher took for this call, taken back below
        try:
            for j, row in enumerate(rows):
                sid = sequence_ids[row]
                matcher = self.matchers[sid]
                prefix = prefixes[row] if prefixes is not None else ()
                done = consumed.get(sid, 0)
                if len(prefix) > done:
                    # The scheduler keeps only drafts the grammar allows (`valid_prefix`).
                    if not matcher.consume_tokens(list(prefix[done:])):
                        raise StructuredOutputError(sid, f"draft tokens the grammar refuses: {matcher.get_error()}")
                    consumed[sid] = len(prefix)
                if matcher.is_error():  # raised here, the batch is sampled row by row and this row fails alone
                    raise StructuredOutputError(sid, matcher.get_error())
                llt.fill_next_token_bitmask(matcher, bitmask, j)
        finally:
            for sid, count in consumed.items():
                self.matchers[sid].rollback(count)
        if self.kernels is not None and logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous():
            self.kernels.mask_rows(logits, bitmask, rows)
            return logits
        index = torch.tensor(rows, device=logits.device)
        logits.index_copy_(0, index, apply_bitmask(logits.index_select(0, index), bitmask.to(logits.device)))
        return logits

    def valid_prefix(self, sequence_id: str, token_ids: list[int]) -> int:
        """How many leading `token_ids` the sequence's grammar allows now (all where unconstrained)."""
        matcher = self.matchers.get(sequence_id)
        return len(token_ids) if matcher is None else matcher.validate_tokens(token_ids)

    def accept(self, sequence_id: str, token_id: int) -> None:
        """Advance a sequence's matcher; a matcher that fails (a grammar it gives up on mid-way, too
        complex for its limits) raises StructuredOutputError, which ends that request alone."""
        matcher = self.matchers.get(sequence_id)
        if matcher is not None and not matcher.consume_token(token_id):
            raise StructuredOutputError(sequence_id, matcher.get_error())


# Row b: the 8 bits of byte value b, lowest first (a little-endian int32's bits 0-7 are its first byte).
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, width] with -inf where bit t of its row's bitmask [rows, ceil(vocab / 32)] int32
    is 0, and past the bitmask's vocabulary.  Eager torch: llguidance's own helper is a
    `torch.compile` function that costs seconds of compiling on its first call, in a step."""
    rows, width = logits.shape
    table = _BYTE_BITS.to(bitmask.device)
    allowed = table[bitmask.contiguous().view(torch.uint8).long()].reshape(rows, -1)
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :width], float("-inf"))


class StructuredOutputError(RuntimeError):
    """A sequence's grammar matcher failed; the message holds the start of the grammar engine's error."""

    def __init__(self, sequence_id: str, error: str) -> None:
        super().__init__(f"the grammar engine gave up on {sequence_id}: {_short(error)}")


def _short(text: str, limit: int = 300) -> str:
    """The start of a grammar engine message: its errors may quote the whole grammar (megabytes)."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
