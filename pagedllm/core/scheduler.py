"""Continuous batching: who runs this step, and how many tokens each computes.

Pure Python.  One rule covers prefill, chunked prefill and decode: a request
has `num_computed_tokens`; each step gives it up to `num_tokens -
num_computed_tokens` more, within the step's token budget.  Running requests
are served first (in arrival order), then waiting requests are admitted first
come first served.  While some request decodes, the step's prefill tokens
(running chunks and admissions together) are capped at
`prefill_tokens_with_decodes`: a long prompt then arrives over several short
steps instead of stalling every decode behind one long step.  When the cache
runs out of blocks, the latest-arrived running request is preempted: it gives
back all its blocks and waits, to be recomputed later.

Speculative decoding (core/speculation.py): a decoding request may get draft tokens, and
then computes its pending token and the drafts in one chunk.  The runner samples the
model's token at each of them; `update` keeps the drafts that match and the first model
token after them, counts only those as computed, and gives back the blocks wholly past
them.  Prefix-cache keys are made of computed tokens only, so never of a rejected draft.
Drafts add rows to a step, and the model's kernels change with the row count: with
`draft_row_limits` a step's drafts keep it in the row range it is in without them, so every
row is computed as it would be without drafts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.kv_cache import KVCache
from pagedllm.core.kv_cache_manager import adapter_salt
from pagedllm.core.request import FinishReason, Request, RequestStatus
from pagedllm.core.speculation import Speculation


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: positions [start, start + num_new_tokens)."""

    request: Request
    start: int
    num_new_tokens: int
    block_table: list[int]
    samples: bool  # the chunk reaches the end of the request's tokens: its last position yields a token
    # n>1: samples that fork from this request at this chunk's token; each samples its own token
    # from the same logits, then holds the request's blocks (copy-on-write from then on).
    forks: list[Request] = field(default_factory=list)
    # Speculative decoding: tokens guessed to follow the request's pending token, computed after it.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def token_ids(self) -> list[int]:
        end = self.start + self.num_new_tokens - len(self.draft_token_ids)
        ids = self.request.token_ids[self.start : end]
        return ids + self.draft_token_ids if self.draft_token_ids else ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_samples(self) -> int:
        """Tokens sampled from this chunk's last position: the request's and its forks'."""
        return 1 + len(self.forks) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Why the waiting queue's head was not admitted: "memory" (no room in the KV
    # cache, or a preemption this step), "budget", "max_num_seqs", "adapter" (its LoRA adapter
    # cannot be made resident yet); None when nobody waits.
    admission_blocked_by: str | None = None
    # Copy-on-write: (source, destination) blocks to copy before this step's attention.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCache,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        prefill_tokens_with_decodes: int | None = None,
        prompt_salt: Callable[[int], bytes] | None = None,
        speculation: Speculation | None = None,
        draft_filter: Callable[[Request, list[int]], int] | None = None,
        draft_row_limits: tuple[int, ...] = (),
        admit: Callable[[Request], bool] | None = None,
        adapter_blocks: Callable[[str], int] | None = None,
    ) -> None:
        """`prompt_salt`: what, given a prompt's length, besides its tokens makes a request's KV
        differ (mixed into its prefix-cache keys); None: nothing.  `speculation`: draft tokens for
        decoding requests (None: off); `draft_filter(request, draft)`: how many leading draft
        tokens the request can take at all (its grammar's say); `draft_row_limits`: the row
        counts that end the ranges within which the model computes a row the same whatever the
        rows beside it (the last range ends at the last); a step's drafts keep its rows, and its
        decoding rows, within the range they are in without drafts, and a step past the last gets
        none.  Empty: drafts are not limited so.  `admit(request)`: whether what a waiting request
        needs besides KV blocks is ready (its LoRA adapter resident); False keeps it waiting at the
        head of the queue, as a lack of blocks does.  `adapter_blocks(key)`: the pool blocks that
        adapter's pages take while its requests run (a request must fit beside them)."""
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if prefill_tokens_with_decodes is not None and prefill_tokens_with_decodes < 1:
            raise ValueError(f"prefill_tokens_with_decodes must be at least 1, got {prefill_tokens_with_decodes}")
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_tokens_with_decodes = prefill_tokens_with_decodes
        self.max_num_seqs = max_num_seqs
        self.prompt_salt = prompt_salt
        self.speculation = speculation
        self.draft_row_limits = tuple(sorted(draft_row_limits))
        self.draft_filter = draft_filter
        self.admit = admit
        self.adapter_blocks = adapter_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_cow_copies = 0  # blocks copied because a forked sequence wrote into a shared block
        self.num_forks = 0
        self.prefix_cache_queried_tokens = 0  # prompt tokens of admitted requests (first admission only)
        self.prefix_cache_hit_tokens = 0  # of those, tokens whose KV came from the prefix cache

    def add_request(self, request: Request) -> None:
        needed = self.kv_cache.max_blocks_held(request.max_total_tokens, self.max_num_batched_tokens)
        pages = self.adapter_blocks(request.adapter) if request.adapter and self.adapter_blocks else 0
        if needed + pages > self.kv_cache.num_blocks:
            beside = f" beside its LoRA adapter's {pages} blocks of pages" if pages else ""
            raise ValueError(
                f"request {request.request_id} can never fit: prompt ({request.num_prompt_tokens} tokens) + "
                f"max_tokens is {request.max_total_tokens} tokens and may hold {needed} blocks{beside}, but the "
                f"whole KV cache has {self.kv_cache.num_blocks} blocks ({self.kv_cache.num_tokens_capacity} tokens); "
                "lower max_tokens or raise kv_cache_memory"
            )
        self.waiting.append(request)

    def _salt(self, request: Request) -> bytes:
        # A request's KV depends on its adapter: blocks computed under one never serve another.
        salt = b"" if self.prompt_salt is None else self.prompt_salt(request.num_prompt_tokens)
        return salt if request.adapter is None else salt + adapter_salt(request.adapter)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        self.kv_cache.begin_step()
        drafts = self._plan_drafts(prefill_budget) if self.speculation is not None else {}

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = drafts.get(request.request_id, [])[: budget - 1] if num_new == 1 else []
            if draft:
                if not self._allocate_or_preempt(request, 1 + len(draft), output):
                    break
                output.scheduled.append(self._chunk(request, 1 + len(draft), draft))
                budget -= 1 + len(draft)
                index += 1
                continue
            if num_new > 1:
                num_new = min(num_new, prefill_budget)
                if num_new == 0:  # the prefill share is spent: this chunk waits, later decodes still run
                    index += 1
                    continue
                prefill_budget -= num_new
            if not self._allocate_or_preempt(request, num_new, output):
                break  # the request preempted itself: it was the latest arrival
            if num_new > 1:  # a prefill chunk: its full blocks can serve this step's admissions
                self.kv_cache.mark_pending(
                    request.request_id, request.token_ids, request.num_computed_tokens + num_new, self._salt(request)
                )
            output.scheduled.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1

        # Admit waiting requests only when nothing was preempted this step;
        # otherwise a new arrival could take the blocks just given back.
        while self.waiting:
            if output.preempted:
                output.admission_blocked_by = "memory"
                break
            if budget <= 0 or prefill_budget <= 0:
                output.admission_blocked_by = "budget"
                break
            if len(self.running) >= self.max_num_seqs:
                output.admission_blocked_by = "max_num_seqs"
                break
            request = self.waiting[0]
            if self.admit is not None and not self.admit(request):
                output.admission_blocked_by = "adapter"
                break
            cached = self.kv_cache.find_cached_prefix(request.token_ids, self._salt(request))
            num_cached = self.kv_cache.cached_tokens(cached)
            num_new = min(request.num_tokens - num_cached, budget, prefill_budget)
            if (
                self.kv_cache.allocate_slots(request.request_id, num_cached + num_new, request.max_total_tokens, cached)
                is None
            ):
                output.admission_blocked_by = "memory"
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.num_preemptions == 0:  # hit rate is about prompts, not recomputation
                self.prefix_cache_queried_tokens += request.num_prompt_tokens
                self.prefix_cache_hit_tokens += num_cached
            request.num_computed_tokens = num_cached
            # Later admissions of this step may share the prompt blocks this chunk computes.
            self.kv_cache.mark_pending(request.request_id, request.token_ids, num_cached + num_new, self._salt(request))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._chunk(request, num_new))
            budget -= num_new
            prefill_budget -= num_new
        if drafts and self.draft_row_limits:
            self._keep_drafts_in_range(output)
        return output

    def _range(self, rows: int) -> int:
        """Which of `draft_row_limits`' ranges a step of `rows` rows is in (len: past the last)."""
        return next((i for i, limit in enumerate(self.draft_row_limits) if rows <= limit), len(self.draft_row_limits))

    def _keep_drafts_in_range(self, output: SchedulerOutput) -> None:
        """Drafts were planned before the step's admissions: where those took the step's rows (or its
        sampled rows) into another range than without the drafts, the step verifies none, and the
        slots taken for them go back."""
        num_drafts = sum(len(chunk.draft_token_ids) for chunk in output.scheduled)
        if not num_drafts:
            return
        rows = output.num_batched_tokens
        sampled = sum(1 + len(chunk.draft_token_ids) for chunk in output.scheduled if chunk.samples)
        if self._range(rows) == self._range(rows - num_drafts) and self._range(sampled) == self._range(
            sampled - num_drafts
        ):
            return
        for i, chunk in enumerate(output.scheduled):
            if chunk.draft_token_ids:
                self.kv_cache.truncate(chunk.request.request_id, chunk.start + 1)
                output.scheduled[i] = self._chunk(chunk.request, 1)

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may compute: the whole budget, or the cap when some request decodes."""
        cap = self.prefill_tokens_with_decodes
        if cap is None or cap >= self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        if any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return cap
        return self.max_num_batched_tokens

    def _plan_drafts(self, prefill_budget: int) -> dict[str, list[int]]:
        decoding, other_rows = [], 0
        for r in self.running:
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining == 1 and not r.forks and r.sampling_params.beam_width == 1:
                decoding.append(r)
            elif remaining > 1:
                other_rows += remaining
        if len(self.running) < self.max_num_seqs:  # prompts likely admitted this step share its rows
            for r in self.waiting:  # (only up to the prefill budget: a long queue costs nothing more)
                if other_rows >= prefill_budget:
                    break
                other_rows += r.num_tokens - r.num_computed_tokens
        other_rows = min(other_rows, prefill_budget)
        allowance = self.max_num_batched_tokens - len(self.running) - other_rows
        if self.draft_row_limits:  # the rows (and the sampled rows) stay within their kernels' range
            decoding_rows = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
            for rows in (decoding_rows, decoding_rows + other_rows):
                limit = next((limit for limit in self.draft_row_limits if limit >= rows), rows)
                allowance = min(allowance, limit - rows)
        drafts = self.speculation.plan(decoding, other_rows, allowance)
        if self.draft_filter is not None:
            by_id = {r.request_id: r for r in decoding}
            for request_id, draft in drafts.items():
                drafts[request_id] = draft[: self.draft_filter(by_id[request_id], draft)]
        return drafts

    def _chunk(self, request: Request, num_new: int, draft: list[int] | None = None) -> ScheduledRequest:
        start = request.num_computed_tokens
        samples = start + num_new == request.num_tokens + len(draft or ())
        return ScheduledRequest(
            request,
            start,
            num_new,
            self.kv_cache.block_table(request.request_id),
            samples,
            list(request.forks) if samples else [],
            list(draft or ()),
        )

    def _allocate_running(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        result = self.kv_cache.allocate_slots(
            request.request_id,
            request.num_computed_tokens + num_new,
            request.max_total_tokens,
            num_computed_tokens=request.num_computed_tokens,
        )
        if result is None:
            return False
        output.block_copies.extend(result.copies)
        self.num_cow_copies += len(result.copies)
        return True

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        while not self._allocate_running(request, num_new, output):
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are the latest running arrivals, yet earlier than every waiting request.
        self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, append each sequence's sampled tokens (one, or with draft tokens
        the accepted drafts and the model's next token); return the sequences that finished."""
        finished = []
        for chunk in output.scheduled:
            request = chunk.request
            computed = request.token_ids
            if chunk.draft_token_ids:
                computed = self._apply_verification(chunk, sampled.get(request.request_id))
            else:
                request.num_computed_tokens += chunk.num_new_tokens
            # Before a possible finish frees them, so a finished prompt stays findable.
            self.kv_cache.cache_full_blocks(
                request.request_id, computed, request.num_computed_tokens, self._salt(request)
            )
            for child in chunk.forks:
                request.forks.remove(child)
                self.fork(request, child)
            for sequence in (request, *chunk.forks):
                for token in sampled.get(sequence.request_id, ()):
                    reason = sequence.append_token(token)
                    if reason is not None:  # tokens after a stop are dropped
                        self.finish(sequence, reason)
                        finished.append(sequence)
                        break
        return finished

    def _apply_verification(self, chunk: ScheduledRequest, tokens: list[int] | None) -> list[int]:
        """The pending token and the accepted drafts are computed; the slots of the rejected ones
        are not, and the blocks wholly past the computed tokens and the new one go back.  Returns
        the request's computed tokens (its tokens and the accepted drafts, appended after this)."""
        request, draft = chunk.request, chunk.draft_token_ids
        accepted = len(tokens) - 1 if tokens else 0
        if tokens and (accepted > len(draft) or tokens[:accepted] != draft[:accepted]):
            raise ValueError(
                f"verification of {request.request_id} returned {tokens}, which does not start with "
                f"its accepted draft tokens (draft {draft})"
            )
        request.num_computed_tokens = chunk.start + 1 + accepted
        self.kv_cache.truncate(request.request_id, request.num_computed_tokens + 1)
        if tokens:
            self.speculation.record(request.request_id, len(draft), accepted)
        return request.token_ids + draft[:accepted]

    def fork(self, parent: Request, child: Request) -> None:
        """The child starts running on the parent's blocks: its first `parent.num_computed_tokens`
        tokens must be the parent's, and are not computed again."""
        self.kv_cache.fork(parent.request_id, child.request_id)
        self.num_forks += 1
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request wherever it is (running, waiting) and free its blocks."""
        if request.finished:
            return
        for child in list(request.forks):  # samples that never forked end with it
            self.finish(child, reason)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.fork_parent is not None and request in request.fork_parent.forks:
            request.fork_parent.forks.remove(request)  # never forked: holds nothing
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        if self.speculation is not None:
            self.speculation.finish(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
