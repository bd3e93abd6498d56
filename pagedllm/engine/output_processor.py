"""A step's results applied to its requests, and the outputs the caller sees.

The rules of fault isolation live here.  A sequence whose sampling, grammar or detokenization
raised ends its whole request (every sample) with `finish_reason="error"`, and its blocks are
freed that step; the rest of the batch goes on.  A failed forward pass belongs to no one
request: every request of that step ends with the error (`fail_step`).  Beam search advances
here too: each step every live beam reports its best candidates, the search picks the next
beams, and each new beam is a fork sharing its parent's blocks.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from pagedllm.core.outputs import RequestOutput
from pagedllm.core.request import FinishReason, Request
from pagedllm.core.request_group import RequestGroup, text_token_ids
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.request_table import RequestTable
from pagedllm.execution.model_runner import ModelRunnerOutput
from pagedllm.text.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")


@dataclass
class OutputProcessor:
    table: RequestTable
    scheduler: Scheduler
    tokenizer: Tokenizer
    eos_token_id: int | None
    max_model_len: int

    def __post_init__(self) -> None:
        self._beam_ids = itertools.count(1)  # sequence ids of forked beams

    def process(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply one step's sampled tokens; the outputs of every request that changed."""
        group_of = self.table.group_of
        # A fault in one sequence's sampling fails its whole request (every sample of it).
        failed = {
            group_of[s].request_id: (group_of[s], why, s in result.failed_by_grammar)
            for s, why in result.failed.items()
        }
        # Beams do not take their sampled token: the search chooses among their candidates below.
        candidates = {
            s: result.logprobs[s][0][1]  # beams take no draft tokens: one token each
            for s in result.sampled
            if group_of[s].beam is not None and group_of[s].request_id not in failed
        }
        sampled = {s: tokens for s, tokens in result.sampled.items() if s not in candidates}
        before = {s: self.table.sequences[s].num_output_tokens for s in sampled if s in result.logprobs}
        self.scheduler.update(scheduled, sampled)
        for seq_id, num_before in before.items():  # the tokens a stop left standing
            sequence = self.table.sequences[seq_id]
            sequence.logprobs.extend(result.logprobs[seq_id][: sequence.num_output_tokens - num_before])

        updated: dict[str, RequestGroup] = {}
        for group, why, by_grammar in failed.values():
            self.fail_group(group, why, "structured_output" if by_grammar else None)
            updated[group.request_id] = group
        for group in {group_of[s].request_id: group_of[s] for s in candidates}.values():
            if self.advance_beams(group, candidates):
                updated[group.request_id] = group
        for seq_id in result.exhausted:  # no token is allowed: the rule in SamplingParams ends it here
            sequence = self.table.sequences.get(seq_id)
            if sequence is not None and not sequence.finished:
                self.scheduler.finish(sequence, FinishReason.STOP)
        for seq_id in [*sampled, *result.exhausted]:
            group = group_of.get(seq_id)
            if group is None or group.request_id in failed:
                continue
            try:
                self.detokenize(group, self.table.sequences[seq_id])
            except Exception as error:  # this request's text alone
                logger.exception("detokenizing %s failed", seq_id)
                self.fail_group(group, f"detokenization failed: {error!r}")
            updated[group.request_id] = group
        return [self.output(group) for group in updated.values()]

    def detokenize(self, group: RequestGroup, sequence: Request) -> None:
        index = group.sequences.index(sequence)
        ids = text_token_ids(sequence, self.eos_token_id)
        delta, hit_stop = group.detokenizers[index].update(ids, sequence.finished)
        if hit_stop and not sequence.finished:
            self.scheduler.finish(sequence, FinishReason.STOP)
        group.deltas[index] += delta
        group.first_token_time = group.first_token_time or sequence.first_token_time

    def fail_group(self, group: RequestGroup, why: str, param: str | None = None) -> None:
        """End every sequence of a request with an error and free their blocks; the others go on.
        `param`: the request's setting at fault, when its input caused the fault (its grammar)."""
        if group.error is None:
            group.error, group.error_param = why, param
        for sequence in reversed(group.sequences):
            self.scheduler.finish(sequence, FinishReason.ERROR)

    def fail_step(self, scheduled: SchedulerOutput, why: str) -> list[RequestOutput]:
        """The forward pass is shared by every request in the step, so a failure there belongs to no one
        request: each request of the step ends with the error and frees its blocks, and nothing of the
        step is counted as computed (or cached)."""
        groups = {}
        for chunk in scheduled.scheduled:
            for sequence in (chunk.request, *chunk.forks):
                group = self.table.group_of.get(sequence.request_id)
                if group is not None:
                    groups[group.request_id] = group
        for group in groups.values():
            self.fail_group(group, why)
        return [self.output(group) for group in groups.values()]

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request (all its samples) at once, freeing its blocks; None if it is unknown or done."""
        group = self.table.groups.get(request_id)
        if group is None:
            return None
        for sequence in reversed(group.sequences):
            self.scheduler.finish(sequence, FinishReason.ABORT)
        return self.output(group)

    def advance_beams(self, group: RequestGroup, candidates: dict[str, list[tuple[int, float]]]) -> bool:
        """One beam-search step for a group whose beams all computed this step; True once it is done."""
        live = group.sequences
        if any(s.request_id not in candidates for s in live):
            # A beam was preempted: the others compute their last token again next step, in lockstep.
            for sequence in live:
                if sequence.request_id in candidates:
                    sequence.num_computed_tokens -= 1
            return False
        chosen = group.beam.step([candidates[s.request_id] for s in live], [tuple(s.output_token_ids) for s in live])
        children = []
        for beam in chosen:
            parent = live[beam.parent]
            child = Request(
                f"{group.request_id}~{next(self._beam_ids)}",
                parent.prompt_token_ids,
                parent.sampling_params,
                self.eos_token_id,
                self.max_model_len,
                arrival_time=parent.arrival_time,
                adapter=parent.adapter,
            )
            child.adopt_output([*parent.output_token_ids, beam.token_id])
            child.first_token_time = group.first_token_time = group.first_token_time or time.monotonic()
            self.scheduler.fork(parent, child)  # shares every block; the last one is copied when written
            children.append(child)
        for sequence in live:  # extended by a child or pruned: either way its hold on blocks ends now
            self.scheduler.finish(sequence, FinishReason.STOP)
            self.table.unregister(sequence)
        group.sequences = children
        for child in children:
            self.table.register(group, child)
        return group.beam.done

    def output(self, group: RequestGroup) -> RequestOutput:
        output = group.output(self.tokenizer.decode)
        if output.finished:
            self.table.forget(group)
        return output
