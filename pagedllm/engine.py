"""The engine: requests in, a step loop (schedule, run, update), outputs out."""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.beam_search import BeamSearchState
from pagedllm.core.contiguous_kv import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_metrics import KVMemoryTracker
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.request import FinishReason, Request, check_prompt_length
from pagedllm.core.request_group import RequestGroup, text_token_ids
from pagedllm.core.sampling_params import SamplingParamError, SamplingParams, StructuredOutput
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.distributed.launcher import RankMemory, WorkerGroup, external_rank, gather_rank_memory, rss_bytes
from pagedllm.execution.model_runner import ModelRunner, ModelRunnerOutput
from pagedllm.execution.rank_model import build_rank_model
from pagedllm.execution.structured_output import StructuredOutputs
from pagedllm.execution.thread_control import AdaptiveThreads
from pagedllm.layers.tensor_parallel import TensorParallel
from pagedllm.text.detokenizer import IncrementalDetokenizer
from pagedllm.text.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")


MAX_FAILED_STEPS = 3  # forward passes failing in a row before the engine stops


class EngineStepError(RuntimeError):
    """The engine cannot compute any more (its forward pass keeps failing); it serves nothing more."""


@dataclass
class EngineStats:
    steps: int = 0
    peak_running: int = 0
    kv_peak_blocks_used: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.workers: WorkerGroup | None = None
        tp = TensorParallel()
        if config.tensor_parallel_size > 1:
            tp = TensorParallel(0, config.tensor_parallel_size)
            if config.distributed_init_method:
                tp = external_rank(config)
            if tp.rank != 0:  # a launcher started this process as a worker: serve rank 0's steps, then leave
                from pagedllm.distributed.worker import run_worker

                run_worker(config, tp)
                raise SystemExit(0)
            self.workers = WorkerGroup(config)
            self.workers.start()
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        # One rank, no thread count given: use the cores other processes leave free (thread_control.py).
        self.threads = (
            AdaptiveThreads(torch.set_num_threads, max_threads=torch.get_num_threads())
            if config.tensor_parallel_size == 1 and not config.num_threads and config.adaptive_threads
            else None
        )
        try:
            built = build_rank_model(config, tp)
            self.runner = ModelRunner(
                built.model, built.num_blocks, config.block_size, built.dtype, config.seed, built.device, built.groups
            )
            if built.memory_plan is not None:
                logger.info("GPU memory: %s", built.memory_plan)
            if built.device != "cpu" and not config.enforce_eager and config.tensor_parallel_size == 1:
                from pagedllm.execution.cuda_graphs import DecodeGraphs

                self.runner.graphs = DecodeGraphs(self.runner, config.max_num_seqs, built.max_model_len)
            if self.workers is not None:
                self.workers.connect()
                atexit.register(self.shutdown)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(send=False)
            raise
        model_config, num_blocks = built.model_config, built.num_blocks
        self.dtype = built.dtype
        self.layer_groups = built.groups  # which layers share a block, and which free theirs
        self.kv_block_bytes = built.bytes_per_token * config.block_size * tp.size  # one pool block, all ranks
        self.device = built.device
        self.model_config = model_config
        self.linear_backend = built.linear_backend
        self.max_model_len = built.max_model_len
        self.model_path = built.path  # the resolved file or directory the weights came from
        self.tokenizer = Tokenizer(built.path)
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = model_config.eos_token_id
        # Constrained sequences' grammar matchers; they use the tokenizer on this (the engine's) thread only.
        self.runner.structured = StructuredOutputs(
            self.tokenizer.hf, model_config.vocab_size, self.eos_token_id, self.runner.sampler.kernels
        )
        self.rank_memory = gather_rank_memory(
            tp, RankMemory(0, built.model.weight_bytes(), self.runner.kv_cache_bytes, rss_bytes())
        )

        if config.kv_layout == "contiguous":
            self.kv_cache = ContiguousKVCacheManager(num_blocks, config.block_size, self.max_model_len, config.reserve)
        else:
            self.kv_cache = KVCacheManager(
                num_blocks, config.block_size, config.enable_prefix_caching, group_windows=built.groups.windows
            )
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_batched_tokens, config.max_num_seqs, config.prefill_tokens_with_decodes
        )
        tokens = num_blocks * config.block_size
        c = model_config
        logger.info(
            "model %s (%s on %s, %d layers, %s linears); %s KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB "
            "(%s); max model length %d -> %.2fx concurrency at full length",
            built.path.name,
            str(self.dtype).removeprefix("torch."),
            built.device,
            c.num_layers,
            self.linear_backend,
            self._layout_description(),
            num_blocks,
            config.block_size,
            tokens,
            tokens * built.bytes_per_token * tp.size / 2**30,
            built.groups.describe(),
            self.max_model_len,
            tokens / built.groups.num_groups / self.max_model_len,
        )
        logger.info(
            "step budget %d tokens; beside decodes at most %s prompt tokens a step",
            config.max_num_batched_tokens,
            config.prefill_tokens_with_decodes or config.max_num_batched_tokens,
        )
        if tp.size > 1:
            for m in self.rank_memory:
                logger.info(
                    "tensor parallel rank %d/%d: weights %.1f MiB, KV cache %.1f MiB, process RSS %.1f MiB",
                    m.rank,
                    tp.size,
                    m.weight_bytes / 2**20,
                    m.kv_cache_bytes / 2**20,
                    m.rss_bytes / 2**20,
                )

        self.requests: dict[str, Request] = {}  # by sequence id (a request's id when n=1)
        self.groups: dict[str, RequestGroup] = {}  # by request id
        self._group_of: dict[str, RequestGroup] = {}  # sequence id -> its request
        self._ids = itertools.count()
        self._beam_ids = itertools.count(1)  # sequence ids of forked beams
        self.stats = EngineStats()
        self.memory = KVMemoryTracker()
        self._step_failures = 0  # forward-pass failures in a row
        self._step_error = ""

    def _layout_description(self) -> str:
        config = self.config
        if config.kv_layout == "contiguous":
            return f"contiguous (reserve {config.reserve}, no prefix caching)"
        return "paged (prefix caching on)" if config.enable_prefix_caching else "paged (prefix caching off)"

    # --- requests ----------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; with `params.n > 1` its samples fork from one computed prompt."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._check_prompt(token_ids)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_word_ids(params))
        vocab = self.model_config.vocab_size
        outside = [t for t in params.logit_bias if t >= vocab]
        if outside:
            raise SamplingParamError(
                "logit_bias", f"logit_bias names token ids outside the vocabulary [0, {vocab}): {outside[:5]}"
            )
        if params.n > 1 and self.config.kv_layout != "paged":
            raise ValueError("n > 1 shares the prompt's blocks between samples: it needs kv_layout='paged'")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if params.beam_width > 1:
            return self._add_beam_search(request_id, text, token_ids, params)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self.groups or any(s in self.requests for s in seq_ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_output is not None:  # each sample its own matcher; an invalid grammar raises here
            self.runner.structured.add(seq_ids, params.structured_output)
        sequences = [
            Request(
                s, token_ids, params.for_sample(i) if params.n > 1 else params, self.eos_token_id, self.max_model_len
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
                self.runner.structured.release(sequence_id)
            raise
        group = RequestGroup(
            request_id, text, sequences, [IncrementalDetokenizer(self.tokenizer, params.stop) for _ in sequences]
        )
        self.groups[request_id] = group
        for sequence in sequences:
            self._register(group, sequence)
        return request_id

    def prepare_structured_output(self, spec: StructuredOutput) -> None:
        """Compile a constraint and build its first matcher now, on the calling thread (any thread), so
        that adding the request later costs a copy: a big schema's matcher takes seconds to build."""
        self.runner.structured.prepare(spec)

    def _add_beam_search(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams) -> str:
        """A beam-search request starts as one sequence; each step its live beams fork into the next ones."""
        if self.config.kv_layout != "paged":
            raise ValueError("beam search shares blocks between beams: it needs kv_layout='paged'")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        width = params.beam_width
        # Beams only compute and report their 2W best next tokens; the search picks the tokens.
        beam_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * width)
        first = Request(f"{request_id}~0", token_ids, beam_params, self.eos_token_id, self.max_model_len)
        state = BeamSearchState(
            width,
            first.max_total_tokens - len(token_ids),
            None if params.ignore_eos else self.eos_token_id,
            params.length_penalty,
            params.early_stopping,
        )
        self.scheduler.add_request(first)  # raises if it can never fit
        group = RequestGroup(request_id, text, [first], [], beam=state, num_returned=params.n)
        self.groups[request_id] = group
        self._register(group, first)
        return request_id

    def _register(self, group: RequestGroup, sequence: Request) -> None:
        self.requests[sequence.request_id] = sequence
        self._group_of[sequence.request_id] = group

    def _unregister(self, sequence: Request) -> None:
        del self.requests[sequence.request_id], self._group_of[sequence.request_id]
        self.runner.release(sequence.request_id)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        check_prompt_length(len(token_ids), None, self.max_model_len)

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids, as it starts a text and after a space (two spellings in most vocabularies)."""
        words = [list(ids) for ids in params.bad_words_token_ids]
        for word in params.bad_words:
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.hf.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return words

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (all its samples) at once, freeing its blocks; None if it is unknown or done."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for sequence in reversed(group.sequences):
            self.scheduler.finish(sequence, FinishReason.ABORT)
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the step loop -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, run the model, update the requests."""
        scheduled = self.scheduler.schedule()
        result = self._execute(scheduled) if not scheduled.is_empty else ModelRunnerOutput({}, {})
        outputs = self._update(scheduled, result) if result is not None else self._fail_step(scheduled)
        if self.threads is not None:
            self.threads.after_step()
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's model output; None when the shared forward pass failed (the rule in `_fail_step`)."""
        if self.workers is None:
            try:
                result = self.runner.execute(scheduled)
            except Exception as error:
                self._step_failures += 1
                if self._step_failures >= MAX_FAILED_STEPS:
                    raise EngineStepError(
                        f"{self._step_failures} steps in a row failed in the model's forward pass; "
                        f"the last failure: {error!r}"
                    ) from error
                logger.exception("a step's forward pass failed; its requests end with an error")
                self._step_error = f"the model step failed: {error!r}"
                return None
            self._step_failures = 0
            return result
        self.workers.check()
        try:
            return self.runner.execute(scheduled)
        except RuntimeError as error:  # gloo ends a collective whose peer died
            failure = self.workers.explain(error)
            self.workers.shutdown(send=False)
            raise failure from error

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op on one rank); the engine runs no more steps after it."""
        if self.workers is not None:
            atexit.unregister(self.shutdown)
            self.workers.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _update(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        stats = self.stats
        stats.steps += 1
        stats.peak_running = max(stats.peak_running, len(scheduled.scheduled))
        stats.kv_peak_blocks_used = max(stats.kv_peak_blocks_used, self.kv_cache.num_used_blocks)
        # A fault in one sequence's sampling fails its whole request (every sample of it).
        failed = {
            self._group_of[s].request_id: (self._group_of[s], why, s in result.failed_by_grammar)
            for s, why in result.failed.items()
        }
        # Beams do not take their sampled token: the search chooses among their candidates below.
        candidates = {
            s: result.logprobs[s][1]
            for s in result.sampled
            if self._group_of[s].beam is not None and self._group_of[s].request_id not in failed
        }
        sampled = {s: token for s, token in result.sampled.items() if s not in candidates}
        for seq_id in sampled:
            if seq_id in result.logprobs:
                self.requests[seq_id].logprobs.append(result.logprobs[seq_id])
        self.scheduler.update(scheduled, sampled)

        updated: dict[str, RequestGroup] = {}
        for group, why, by_grammar in failed.values():
            self._fail_group(group, why, "structured_output" if by_grammar else None)
            updated[group.request_id] = group
        for group in {self._group_of[s].request_id: self._group_of[s] for s in candidates}.values():
            if self._advance_beams(group, candidates):
                updated[group.request_id] = group
        for seq_id in result.exhausted:  # no token is allowed: the rule in SamplingParams ends it here
            sequence = self.requests.get(seq_id)
            if sequence is not None and not sequence.finished:
                self.scheduler.finish(sequence, FinishReason.STOP)
        for seq_id in [*sampled, *result.exhausted]:
            group = self._group_of.get(seq_id)
            if group is None or group.request_id in failed:
                continue
            try:
                self._detokenize(group, self.requests[seq_id])
            except Exception as error:  # this request's text alone
                logger.exception("detokenizing %s failed", seq_id)
                self._fail_group(group, f"detokenization failed: {error!r}")
            updated[group.request_id] = group
        outputs = [self._output(group) for group in updated.values()]
        self.memory.record(self.scheduler, stats.steps, scheduled.admission_blocked_by == "memory")
        return outputs

    def _detokenize(self, group: RequestGroup, sequence: Request) -> None:
        index = group.sequences.index(sequence)
        ids = text_token_ids(sequence, self.eos_token_id)
        delta, hit_stop = group.detokenizers[index].update(ids, sequence.finished)
        if hit_stop and not sequence.finished:
            self.scheduler.finish(sequence, FinishReason.STOP)
        group.deltas[index] += delta
        group.first_token_time = group.first_token_time or sequence.first_token_time

    def _fail_group(self, group: RequestGroup, why: str, param: str | None = None) -> None:
        """End every sequence of a request with an error and free their blocks; the others go on.
        `param`: the request's setting at fault, when its input caused the fault (its grammar)."""
        if group.error is None:
            group.error, group.error_param = why, param
        for sequence in reversed(group.sequences):
            self.scheduler.finish(sequence, FinishReason.ERROR)

    def _fail_step(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """The forward pass is shared by every request in the step, so a failure there belongs to no one
        request: each request of the step ends with the error and frees its blocks, nothing of the step
        is counted as computed (or cached), and the engine goes on with the rest.  `MAX_FAILED_STEPS`
        failures in a row mean the engine cannot compute at all: then `step` raises EngineStepError."""
        groups = {}
        for chunk in scheduled.scheduled:
            for sequence in (chunk.request, *chunk.forks):
                group = self._group_of.get(sequence.request_id)
                if group is not None:
                    groups[group.request_id] = group
        for group in groups.values():
            self._fail_group(group, self._step_error)
        self.stats.steps += 1
        return [self._output(group) for group in groups.values()]

    def _advance_beams(self, group: RequestGroup, candidates: dict[str, list[tuple[int, float]]]) -> bool:
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
            )
            child.adopt_output([*parent.output_token_ids, beam.token_id])
            child.first_token_time = group.first_token_time = group.first_token_time or time.monotonic()
            self.scheduler.fork(parent, child)  # shares every block; the last one is copied when written
            children.append(child)
        for sequence in live:  # extended by a child or pruned: either way its hold on blocks ends now
            self.scheduler.finish(sequence, FinishReason.STOP)
            self._unregister(sequence)
        group.sequences = children
        for child in children:
            self._register(group, child)
        return group.beam.done

    def _output(self, group: RequestGroup) -> RequestOutput:
        output = group.output(self.tokenizer.decode)
        if output.finished:
            self._forget(group)
        return output

    def _forget(self, group: RequestGroup) -> None:
        del self.groups[group.request_id]
        for sequence in group.sequences:
            self._unregister(sequence)

    def wait_all(self) -> list[RequestOutput]:
        """Run steps until every request is done; return the final outputs in finish order."""
        finished = []
        while self.has_unfinished_requests():
            finished.extend(o for o in self.step() if o.finished)
        return finished
