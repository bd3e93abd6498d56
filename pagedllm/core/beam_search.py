"""Beam search bookkeeping for one request: which beams live on, which are done.

Pure Python; the engine supplies each live beam's top next-token candidates
and carries out the result (forking the chosen parents' blocks, freeing the
pruned beams).  The rules follow Hugging Face transformers' `generate(
num_beams=W, do_sample=False)` so results can be compared token for token:

- each step, every live beam proposes (token, log-probability) pairs; a
  candidate's score is its beam's cumulative log-probability plus its own;
- the best 2W candidates over all beams are kept, best first;
- a candidate that ends its sequence (EOS, or the max_tokens-th token) and
  ranks among the first W becomes a finished hypothesis scored
  `cumulative / generated_length ** length_penalty`; the best W finished are
  kept;
- the first W candidates that do not end become the next live beams;
- the search stops when no live beam can still beat the worst of W finished
  hypotheses (`early_stopping=False`: judged at the current length;
  `"never"` with a positive length penalty: at the longest possible length),
  when W hypotheses are finished and `early_stopping=True`, or when every
  candidate ends (max_tokens reached).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens, the ending one included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty


@dataclass(frozen=True)
class LiveBeam:
    parent: int  # index of the beam it extends, in the previous step's live beams
    token_id: int
    cumulative_logprob: float


@dataclass
class BeamSearchState:
    beam_width: int
    max_tokens: int
    eos_token_id: int | None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_generated: int = 0  # tokens every live beam has generated so far
    live_scores: list[float] = field(default_factory=lambda: [0.0])  # cumulative log-probs of the live beams
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    _improvable: bool = True

    def step(self, candidates: list[list[tuple[int, float]]], histories: list[tuple[int, ...]]) -> list[LiveBeam]:
        """Advance one token.  `candidates[b]`: live beam b's best (token, logprob) pairs, at least 2W of them
        (fewer only if the vocabulary is smaller); `histories[b]`: the tokens it has generated.  Returns the
        next live beams (none once the search is done)."""
        if self.done:
            raise ValueError("the beam search is already done")
        if len(candidates) != len(self.live_scores) or len(histories) != len(self.live_scores):
            raise ValueError(f"expected candidates for {len(self.live_scores)} live beams, got {len(candidates)}")
        width = self.beam_width
        pooled = [
            (self.live_scores[b] + logprob, b, token)
            for b, beam_candidates in enumerate(candidates)
            for token, logprob in beam_candidates
        ]
        # Best first; among equal scores the lower (beam, token) first, like a top-k over the flattened scores.
        pooled.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = pooled[: 2 * width]
        length = self.num_generated + 1
        ends_by_length = length >= self.max_tokens

        live: list[LiveBeam] = []
        new_finished: list[Hypothesis] = []
        full = len(self.finished) >= width and self.early_stopping is True
        for rank, (score, beam, token) in enumerate(top):
            ends = ends_by_length or token == self.eos_token_id
            if ends:
                if rank < width and self._improvable and not full:
                    tokens = (*histories[beam], token)
                    new_finished.append(Hypothesis(tokens, score, score / length**self.length_penalty))
            elif len(live) < width:
                live.append(LiveBeam(beam, token, score))
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[:width]
        self.num_generated = length
        self.live_scores = [b.cumulative_logprob for b in live]
        self._improvable = self._improvable and self._can_improve()
        all_ended = all(ends_by_length or token == self.eos_token_id for _, _, token in top)
        fully_done = len(self.finished) >= width and self.early_stopping is True
        if not self._improvable or fully_done or all_ended or not live:
            self.done = True
            return []
        return live

    def _can_improve(self) -> bool:
        """Could the best live beam still beat the worst of W finished hypotheses?"""
        if len(self.finished) < self.beam_width or not self.live_scores:
            return bool(self.live_scores)
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens
        else:
            length = self.num_generated
        best_possible = max(self.live_scores) / length**self.length_penalty
        return best_possible > self.finished[-1].score
