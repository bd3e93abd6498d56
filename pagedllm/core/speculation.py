"""Speculative decoding's policy: which decoding requests get draft tokens this step, and how many.

Pure Python.  A decoding request that gets k draft tokens computes k + 1 tokens this step (its
pending token and the drafts); the model's token at each of those positions is sampled, the
drafts are accepted while they equal it, and the first that differs is replaced by the
model's own token.  So a step emits between 1 and k + 1 tokens for it, and its output is
exactly what decoding one token at a time gives (core/scheduler.py applies the result,
execution/model_runner.py verifies).

Drafts cost compute.  A step costs about `base + sum over rows of (per_row + context *
per_context_token)` (`StepCost`, measured when the engine starts, execution/step_cost.py).
A draft row of request i costs its row, `c_i`; the token it may bring is worth what a token
costs without drafts: `c_i` plus its share of the base, `base / B` over the step's B rows.  A
draft token is taken when its chance of being accepted (the drafter's confidence times the
request's measured acceptance, multiplied along the draft) exceeds `c_i / (c_i + base / B)`.
Draft tokens are considered likeliest first, each one taken adding a row to B.  So one
request with a good acceptance record gets long drafts; a large batch, or a step full of
prompt tokens, whose base is shared by many rows already, gets few or none; and a request
whose drafts keep failing stops getting them until its record decays back to the pooled one.

A request's acceptance is a decaying count of its accepted draft tokens and rejections,
starting from the same count over all requests (itself starting at 0.75): in a workload
whose drafts hold, a new request gets drafts from its first step; where they fail, it
gets none until its own drafts show otherwise.  Steps in which no draft is taken let the
pooled count drift back to its prior, so drafting is tried again after a few hundred such steps.

Asking the drafter costs Python time (a lookup, and indexing the tokens appended since).  A
request whose drafter found nothing worth verifying is not asked again for 1, 2, 4, then at
most `MAX_BACKOFF_STEPS` steps, back to every step once a draft of its is verified: where
nothing repeats (random text) the drafter is asked about one step in nine, and where the output
copies its input, every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.drafting import Draft, Drafter, make_drafter
from pagedllm.core.request import Request

DECAY = 0.9  # per draft token verified since: the weight of an older outcome against the latest
POOL_DECAY = 0.995  # the same, for the record of all requests together
POOL_PRIOR = (3.0, 1.0)  # pseudo-counts of accepted and rejected drafts before any was verified: 0.75
PRIOR_WEIGHT = 2.0  # a request starts from the pooled rate, worth this many of its own outcomes
IDLE_DECAY = 0.97  # per step a request is given no draft: its record drifts back to the pooled rate
# Per step in which no draft is taken: the pooled record drifts back to its prior, so that a pool that
# fell below what drafts must reach is tried again (a serving engine's traffic changes; without it a few
# early rejections would end drafting for good, since only verified drafts move the pool).
POOL_IDLE_DECAY = 0.99
MAX_BACKOFF_STEPS = 8  # the most steps a request whose drafter keeps coming up empty goes without asking


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


@dataclass(frozen=True)
class StepCost:
    """A decode step's cost per row and per context token of a row, over its base cost (no rows)."""

    row: float
    context_token: float = 0.0
    sampled_row: float = 0.0  # a row sampled at a temperature (greedy rows take an argmax, ~free)

    def of_row(self, context_tokens: int, greedy: bool = True) -> float:
        return self.row + self.context_token * context_tokens + (0.0 if greedy else self.sampled_row)


@dataclass
class _Record:
    """Decaying counts of accepted draft tokens and of rejections (at most one a verification): the
    chance that a draft token is accepted after the ones before it were."""

    accepted: float = 0.0
    rejected: float = 0.0

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)

    def add(self, num_draft: int, num_accepted: int, decay: float) -> None:
        factor = decay**num_draft
        self.accepted = self.accepted * factor + num_accepted
        self.rejected = self.rejected * factor + (1 if num_accepted < num_draft else 0)

    def decay(self, factor: float) -> None:
        self.accepted *= factor
        self.rejected *= factor


@dataclass
class Speculation:
    drafter: Drafter
    max_draft_tokens: int
    cost: StepCost  # measured at engine start
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    _records: dict[str, _Record] = field(default_factory=dict)
    _pool: _Record = field(default_factory=_Record)  # every request's verifications together
    max_backoff_steps: int = MAX_BACKOFF_STEPS  # 0: ask the drafter every step
    _backoff: dict[str, tuple[int, int]] = field(default_factory=dict)  # request: (misses in a row, next step to ask)

    def acceptance(self, request_id: str) -> float:
        """The chance that a request's next draft token is accepted: its own record, starting from
        the pooled record of all requests (so a workload whose drafts hold gets them from the start)."""
        pooled = self._pool.rate(POOL_PRIOR[0] / sum(POOL_PRIOR), sum(POOL_PRIOR))
        record = self._records.get(request_id)
        return pooled if record is None else record.rate(pooled, PRIOR_WEIGHT)

    @staticmethod
    def build(method: str, max_draft_tokens: int, cost: StepCost) -> Speculation:
        if max_draft_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {max_draft_tokens}")
        if cost.row <= 0 or cost.context_token < 0 or cost.sampled_row < 0:
            raise ValueError(f"a step's row cost must be positive, got {cost}")
        return Speculation(make_drafter(method), max_draft_tokens, cost)

    def plan(self, decoding: list[Request], other_rows: int, max_draft_tokens: int) -> dict[str, list[int]]:
        """Draft tokens per request id for this step's `decoding` requests (each computes its pending
        token), beside `other_rows` prompt tokens, at most `max_draft_tokens` in all."""
        if not decoding:
            return {}
        self.stats.steps += 1
        if max_draft_tokens <= 0:  # no room: the drafters are not asked, so nobody misses
            return {}
        candidates: list[tuple[float, int, str]] = []  # (chance of acceptance, index in its draft, request)
        drafts: dict[str, Draft] = {}
        rows = len(decoding) + other_rows
        for request in decoding:
            record = self._records.get(request.request_id)
            rate = self.acceptance(request.request_id)
            cost = self.cost.of_row(request.num_tokens, request.sampling_params.greedy)
            if rate * (cost + 1.0 / rows) <= cost:  # not even its first draft token could pay: skip the drafter
                if record is not None:
                    record.decay(IDLE_DECAY)
                continue
            backoff = self._backoff.get(request.request_id)
            if backoff is not None and backoff[1] > self.stats.steps:
                continue
            limit = min(self.max_draft_tokens, request.max_total_tokens - request.num_tokens - 1)
            draft = self.drafter.propose(request.request_id, request.token_ids, limit) if limit > 0 else None
            if not draft or not draft.token_ids:
                self._missed(request.request_id)
                continue
            drafts[request.request_id] = draft
            chance = 1.0
            for j, confidence in enumerate(draft.confidence):
                chance *= rate * confidence
                candidates.append((chance, j, request.request_id))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        row_cost = {
            r.request_id: self.cost.of_row(r.num_tokens, r.sampling_params.greedy)
            for r in decoding
            if r.request_id in drafts
        }
        taken: dict[str, int] = {}
        unpaid: set[str] = set()  # requests whose first draft token did not pay (not: found no room)
        for chance, j, request_id in candidates:
            if rows - len(decoding) - other_rows >= max_draft_tokens:
                break
            if taken.get(request_id, 0) != j:
                continue  # an earlier token of its draft did not pay: neither does this one
            cost = row_cost[request_id]
            if chance * (cost + 1.0 / rows) <= cost:  # the row costs more than the token it may bring
                if j == 0:
                    unpaid.add(request_id)
                continue
            taken[request_id] = j + 1
            rows += 1
        for request_id in unpaid:
            self._missed(request_id)
        for request_id in drafts.keys() - taken.keys():
            if request_id in self._records:
                self._records[request_id].decay(IDLE_DECAY)
        for request_id in taken:
            self._backoff.pop(request_id, None)
        if taken:
            self.stats.steps_with_drafts += 1
        else:
            self._pool.decay(POOL_IDLE_DECAY)
        return {rid: drafts[rid].token_ids[:n] for rid, n in taken.items()}

    def _missed(self, request_id: str) -> None:
        """The request's drafter was asked and gave nothing worth verifying: wait longer before asking again."""
        if self.max_backoff_steps:
            misses = self._backoff.get(request_id, (0, 0))[0] + 1
            wait = min(2 ** (misses - 1), self.max_backoff_steps)
            self._backoff[request_id] = (misses, self.stats.steps + wait + 1)

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
        self._record(request_id).add(num_draft, num_accepted, DECAY)
        self._pool.add(num_draft, num_accepted, POOL_DECAY)

    def finish(self, request: Request) -> None:
        self._records.pop(request.request_id, None)
        self._backoff.pop(request.request_id, None)
        self.drafter.finish(request.request_id, request.output_token_ids)
