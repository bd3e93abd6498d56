"""Speculative decoding's policy: which decoding requests get draft tokens this step, and how many.

Pure Python.  A decoding request that gets k draft tokens computes k + 1 tokens this step (its
pending token and the drafts); the model's token at each of those positions is sampled, the
drafts are accepted while they equal it, and the first that differs is replaced by the
model's own token.  So a step emits between 1 and k + 1 tokens for it, and its output is
exactly what decoding one token at a time gives (core/scheduler.py applies the result,
execution/model_runner.py verifies).

Drafts cost compute: on a CPU a step costs about `base + per_row * rows`, and the `row_cost`
ratio per_row / base is measured when the engine starts.  A draft token adds a row and is
worth its chance of being accepted: the drafter's confidence times the request's measured
acceptance (a decaying count of accepted and rejected drafts), raised along the draft.  Draft
tokens are taken, the likeliest first, while each one raises the step's expected tokens per
unit of time.  So one request with a good acceptance record gets long drafts, a large batch
(whose step is compute-bound already) gets few or none, and a request whose drafts keep
failing stops getting them until its record decays back to the prior.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.drafting import Draft, Drafter, make_drafter
from pagedllm.core.request import Request

DECAY = 0.9  # per draft token verified since: the weight of an older outcome against the latest
PRIOR = (1.0, 1.0)  # pseudo-counts of accepted and rejected drafts: a new request's acceptance is 0.5
IDLE_DECAY = 0.97  # per step a request has a draft but is given none: its record drifts back to the prior


@dataclass
class SpeculationStats:
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    verifications: int = 0  # request-steps that verified at least one draft token
    steps_with_drafts: int = 0
    steps: int = 0  # steps with at least one decoding request

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request emits per step: the accepted drafts plus the model's own token."""
        return (self.accepted_tokens + self.verifications) / self.verifications if self.verifications else 0.0

    @property
    def draft_tokens_per_step(self) -> float:
        return self.draft_tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verifications": self.verifications,
            "steps_with_drafts": self.steps_with_drafts,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "draft_tokens_per_step": round(self.draft_tokens_per_step, 4),
        }


@dataclass
class _Record:
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR[0]) / (self.accepted + self.rejected + PRIOR[0] + PRIOR[1])


@dataclass
class Speculation:
    drafter: Drafter
    max_draft_tokens: int
    row_cost: float  # a step's cost per row, over its cost with no rows (measured at engine start)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    _records: dict[str, _Record] = field(default_factory=dict)

    @staticmethod
    def build(method: str, max_draft_tokens: int, row_cost: float) -> Speculation:
        if max_draft_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {max_draft_tokens}")
        if row_cost <= 0:
            raise ValueError(f"row_cost must be positive, got {row_cost}")
        return Speculation(make_drafter(method), max_draft_tokens, row_cost)

    def plan(self, decoding: list[Request], other_rows: int, max_draft_tokens: int) -> dict[str, list[int]]:
        """Draft tokens per request id for this step's `decoding` requests (each computes its pending
        token), beside `other_rows` prompt tokens, at most `max_draft_tokens` in all."""
        if not decoding:
            return {}
        self.stats.steps += 1
        candidates: list[tuple[float, int, str]] = []  # (chance of acceptance, index in its draft, request)
        drafts: dict[str, Draft] = {}
        for request in decoding:
            limit = min(self.max_draft_tokens, request.max_total_tokens - request.num_tokens - 1)
            draft = self.drafter.propose(request.request_id, request.token_ids, limit) if limit > 0 else None
            if not draft or not draft.token_ids:
                continue
            drafts[request.request_id] = draft
            rate, chance = self._record(request.request_id).rate, 1.0
            for j, confidence in enumerate(draft.confidence):
                chance *= rate * confidence
                candidates.append((chance, j, request.request_id))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        expected = float(len(decoding))  # tokens the step emits: each decoding request's own, so far
        cost = 1.0 + self.row_cost * (len(decoding) + other_rows)
        taken: dict[str, int] = {}
        for num_taken, (chance, j, request_id) in enumerate(candidates):
            if num_taken >= max_draft_tokens:
                break
            if chance * cost <= expected * self.row_cost:  # one more row would lower tokens per unit time
                break
            taken[request_id] = j + 1  # sorted by chance, then index: its earlier tokens are taken
            expected += chance
            cost += self.row_cost
        for request_id in drafts.keys() - taken.keys():
            record = self._records[request_id]
            record.accepted *= IDLE_DECAY
            record.rejected *= IDLE_DECAY
        if taken:
            self.stats.steps_with_drafts += 1
        return {rid: drafts[rid].token_ids[:n] for rid, n in taken.items()}

    def _record(self, request_id: str) -> _Record:
        record = self._records.get(request_id)
        if record is None:
            record = self._records[request_id] = _Record()
        return record

    def record(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """A verification: `num_accepted` of `num_draft` draft tokens were right."""
        self.stats.draft_tokens += num_draft
        self.stats.accepted_tokens += num_accepted
        self.stats.verifications += 1
        record, decay = self._record(request_id), DECAY**num_draft
        record.accepted = record.accepted * decay + num_accepted
        record.rejected = record.rejected * decay + (1 if num_accepted < num_draft else 0)

    def finish(self, request: Request) -> None:
        self._records.pop(request.request_id, None)
        self.drafter.finish(request.request_id, request.output_token_ids)
