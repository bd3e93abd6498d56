"""Requests in: checked, tokenized, turned into sequences and handed to the scheduler.

Every check runs before anything is allocated, so a refused request leaves no trace: an empty
or too-long prompt, token ids outside the vocabulary, a logit bias on such ids, a layout that
cannot share blocks (n > 1 and beams need the paged one), a request id in use, an invalid
grammar (raised while its matcher is built), a prompt that could never fit the KV cache (the
scheduler's check).  n > 1 samples are forks of one sequence that computes the prompt once; a
beam search starts as one sequence whose beams fork every step (pagedllm/engine/output_processor.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from pagedllm.core.beam_search import BeamSearchState
from pagedllm.core.request import Request, check_prompt_length
from pagedllm.core.request_group import RequestGroup
from pagedllm.core.sampling_params import SamplingParamError, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.request_table import RequestTable
from pagedllm.execution.structured_output import StructuredOutputs
from pagedllm.text.detokenizer import IncrementalDetokenizer
from pagedllm.text.tokenizer import Tokenizer


@dataclass
class RequestIntake:
    table: RequestTable
    scheduler: Scheduler
    structured: StructuredOutputs
    tokenizer: Tokenizer
    vocab_size: int
    eos_token_id: int | None
    max_model_len: int
    paged: bool  # samples and beams share blocks, which only the paged layout does

    def __post_init__(self) -> None:
        self._ids = itertools.count()

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None, adapter: str | None = None
    ) -> str:
        """Queue a request; `adapter`: the key of the LoRA adapter it runs under (None: the base model)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.check_prompt(token_ids)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_word_ids(params))
        outside = [t for t in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise SamplingParamError(
                "logit_bias", f"logit_bias names token ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}"
            )
        if params.n > 1 and not self.paged:
            raise ValueError("n > 1 shares the prompt's blocks between samples: it needs kv_layout='paged'")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if params.beam_width > 1:
            return self.add_beam_search(request_id, text, token_ids, params, adapter)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if self.table.in_use(request_id, seq_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_output is not None:  # each sample its own matcher; an invalid grammar raises here
            self.structured.add(seq_ids, params.structured_output)
        sequences = [
            Request(
                s,
                token_ids,
                params.for_sample(i) if params.n > 1 else params,
                self.eos_token_id,
                self.max_model_len,
                adapter=adapter,
            )
            for i, s in enumerate(seq_ids)
        ]
        parent = sequences[0]
        parent.forks = sequences[1:]
        for child in parent.forks:
            child.fork_parent = parent
        try:
            self.scheduler.add_request(parent)  # raises if it can never fit
        except ValueError:
            for sequence_id in seq_ids:
                self.structured.release(sequence_id)
            raise
        detokenizers = [IncrementalDetokenizer(self.tokenizer, params.stop) for _ in sequences]
        self.table.add(RequestGroup(request_id, text, sequences, detokenizers))
        return request_id

    def add_beam_search(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams, adapter: str | None
    ) -> str:
        """A beam-search request starts as one sequence; each step its live beams fork into the next ones."""
        if not self.paged:
            raise ValueError("beam search shares blocks between beams: it needs kv_layout='paged'")
        if request_id in self.table.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        width = params.beam_width
        # Beams only compute and report their 2W best next tokens; the search picks the tokens.
        beam_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * width)
        first = Request(
            f"{request_id}~0", token_ids, beam_params, self.eos_token_id, self.max_model_len, adapter=adapter
        )
        state = BeamSearchState(
            width,
            first.max_total_tokens - len(token_ids),
            None if params.ignore_eos else self.eos_token_id,
            params.length_penalty,
            params.early_stopping,
        )
        self.scheduler.add_request(first)  # raises if it can never fit
        self.table.add(RequestGroup(request_id, text, [first], [], beam=state, num_returned=params.n))
        return request_id

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        check_prompt_length(len(token_ids), None, self.max_model_len)

    def bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids, as it starts a text and after a space (two spellings in most vocabularies)."""
        words = [list(ids) for ids in params.bad_words_token_ids]
        for word in params.bad_words:
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.hf.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return words
