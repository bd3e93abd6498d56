"""A request as the user sees it: its sequences, and the outputs built from them (pure Python).

With n=1 a request is one sequence.  With n>1 it is n sequences that fork from
one computed prompt.  With beam search its sequences are the live beams, which
change every step, and its result is the best finished hypotheses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.core.beam_search import BeamSearchState, Hypothesis
from pagedllm.core.outputs import CompletionOutput, RequestOutput
from pagedllm.core.request import FinishReason, Request


class TextSoFar(Protocol):
    """What a group reads of a sequence's detokenizer (pagedllm/text/detokenizer.py): the engine
    hands each group its detokenizers, and the core never builds one."""

    text: str


def text_token_ids(request: Request, eos_token_id: int | None) -> list[int]:
    """Output ids that make up the text: a final stop token is not part of it."""
    ids = request.output_token_ids
    if (
        request.finish_reason == FinishReason.STOP
        and ids
        and (ids[-1] in request.sampling_params.stop_token_ids or ids[-1] == eos_token_id)
    ):
        return ids[:-1]
    return ids


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    sequences: list[Request]
    detokenizers: list[TextSoFar]  # one per sequence (none for beam search)
    beam: BeamSearchState | None = None  # beam search: `sequences` are the live beams
    num_returned: int = 1  # beam search: how many of the best hypotheses to return
    first_token_time: float | None = None
    error: str | None = None  # what ended the request, when a fault did
    error_param: str | None = None  # the setting at fault, when the request's own input was
    deltas: list[str] = field(init=False)  # text each sequence added since the last output

    def __post_init__(self) -> None:
        self.deltas = [""] * len(self.sequences)
        self.prompt_token_ids = self.sequences[0].prompt_token_ids
        self.arrival_time = self.sequences[0].arrival_time

    def output(self, decode: Callable[[list[int]], str]) -> RequestOutput:
        """The request's state now; deltas start again from empty."""
        if self.beam is not None:  # asked for only when the search is done, or aborted
            completions = self._beam_completions(decode)
        else:
            completions = [self._completion(i) for i in range(len(self.sequences))]
        self.deltas = [""] * len(self.sequences)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=all(c.finished for c in completions),
            time_to_first_token=(self.first_token_time - self.arrival_time) if self.first_token_time else None,
            error=self.error,
            error_param=self.error_param,
        )

    def _completion(self, index: int) -> CompletionOutput:
        sequence = self.sequences[index]
        # The sequence's own lists, read up to this length (outputs.py): nothing is copied per step.
        return CompletionOutput(
            index=index,
            text=self.detokenizers[index].text,
            token_ids=sequence.output_token_ids,
            finished=sequence.finished,
            finish_reason=sequence.finish_reason.value if sequence.finish_reason else None,
            logprobs=sequence.logprobs if sequence.sampling_params.logprobs is not None else None,
            num_preemptions=sequence.num_preemptions,
            delta=self.deltas[index],
            num_tokens=sequence.num_output_tokens,
        )

    def _beam_completions(self, decode: Callable[[list[int]], str]) -> list[CompletionOutput]:
        beam = self.beam
        if beam.done:
            hypotheses, reason = beam.finished[: self.num_returned], None
        else:  # aborted or failed mid-search: what the live beams hold
            live = zip(self.sequences, beam.live_scores)
            hypotheses = [Hypothesis(tuple(s.output_token_ids), lp, lp) for s, lp in live]
            reason = (FinishReason.ERROR if self.error is not None else FinishReason.ABORT).value
        completions = []
        for index, hyp in enumerate(hypotheses):
            ends_with_eos = bool(hyp.token_ids) and hyp.token_ids[-1] == beam.eos_token_id
            completions.append(
                CompletionOutput(
                    index=index,
                    text=decode(list(hyp.token_ids[:-1] if ends_with_eos else hyp.token_ids)),
                    token_ids=list(hyp.token_ids),
                    finished=True,
                    finish_reason=reason or ("stop" if ends_with_eos else "length"),
                    cumulative_logprob=hyp.cumulative_logprob,
                    score=hyp.score,
                )
            )
        return completions
