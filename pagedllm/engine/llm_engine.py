"""`LLMEngine`: built once for a model, then a step loop: schedule, run, update."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.contiguous_kv import ContiguousKVCacheManager
from pagedllm.core.kv_cache import KVCache
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_metrics import KVMemoryTracker
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.request import Request
from pagedllm.core.request_group import RequestGroup
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.core.speculation import Speculation, StepCost
from pagedllm.distributed.launcher import RankMemory, gather_rank_memory, rss_bytes, start_ranks
from pagedllm.engine.intake import RequestIntake
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request_table import RequestTable
from pagedllm.engine.state import EngineInfo, RunCounters, begin_run, engine_state, kv_picture, run_report
from pagedllm.execution.lora_adapters import LoraAdapters
from pagedllm.execution.lora_pages import LoraPages
from pagedllm.execution.model_runner import ModelRunner, ModelRunnerOutput
from pagedllm.execution.rank_model import RankModel, build_rank_model
from pagedllm.execution.step_cost import measure_step_cost
from pagedllm.execution.structured_output import StructuredOutputs
from pagedllm.execution.thread_control import AdaptiveThreads
from pagedllm.layers.tensor_parallel import TensorParallel
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


def make_kv_cache(config: EngineConfig, num_blocks: int, max_model_len: int, group_windows: tuple[int, ...]) -> KVCache:
    if config.kv_layout == "contiguous":
        return ContiguousKVCacheManager(num_blocks, config.block_size, max_model_len, config.reserve)
    return KVCacheManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        group_windows=group_windows,
        record_events=config.record_kv_events,
    )


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Assembled from its parts: the ranks, the model on its device (runner), the KV cache,
        the scheduler, and the request intake and output processing around them."""
        self.config = config
        tp, self.workers = start_ranks(config)  # a launched worker rank never returns from it
        self.threads = self._thread_policy(config)
        built = self._build_runner(config, tp)
        self.model_config = model_config = built.model_config
        self.dtype, self.kv_dtype, self.device = built.dtype, built.kv_dtype, built.device
        self.layer_groups = built.groups  # which layers share a block, and which free theirs
        self.kv_block_bytes = built.bytes_per_token * config.block_size * tp.size  # one pool block, all ranks
        self.linear_backend = built.linear_backend
        self.weights = built.weights  # native (a GGUF's quantized blocks) or dequantized
        self.weights_summary = built.weights_summary  # what each tensor type runs as, the resident bytes
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
        self.kv_cache = make_kv_cache(config, built.num_blocks, self.max_model_len, built.groups.windows)
        self.speculation = self._speculation(config)
        self.adapters = self.runner.adapters = LoraAdapters(
            model_config, self.dtype, self.device, config.max_loras, config.max_lora_rank, built.model.ops.kernels
        )
        self.lora_refusal = self._lora_refusal(config, built)
        if not self.lora_refusal and LoraPages.usable(self.kv_cache, self.runner.kv_caches):
            self.adapters.use_pages(LoraPages(self.kv_cache, self.runner.kv_caches, self.runner.groups.layer_slot))
        self.scheduler = self._make_scheduler(config, built)
        self._log_start(built, tp)
        self.table = RequestTable(self.runner.release)
        self.intake = RequestIntake(
            self.table,
            self.scheduler,
            self.runner.structured,
            self.tokenizer,
            model_config.vocab_size,
            self.eos_token_id,
            self.max_model_len,
            paged=config.kv_layout == "paged",
        )
        self.output_processor = OutputProcessor(
            self.table, self.scheduler, self.tokenizer, self.eos_token_id, self.max_model_len
        )
        self.stats = EngineStats()
        self.memory = KVMemoryTracker()
        self._step_failures = 0  # forward-pass failures in a row
        self._step_error = ""
        self._adapter_failures: dict[str, str] = {}  # sequence id -> why its adapter would not load
        self.info = EngineInfo(
            model_path=str(built.path),
            max_model_len=self.max_model_len,
            vocab_size=model_config.vocab_size,
            eos_token_id=self.eos_token_id,
            block_size=config.block_size,
            num_blocks=built.num_blocks,
            kv_layout=config.kv_layout,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            tensor_parallel_size=config.tensor_parallel_size,
            num_layer_groups=self.kv_cache.num_groups,
        )
        for spec in config.lora_modules:
            self.load_lora(*spec.split("=", 1))

    @staticmethod
    def _thread_policy(config: EngineConfig) -> AdaptiveThreads | None:
        """One rank, no thread count given: use the cores other processes leave free (thread_control.py)."""
        if config.tensor_parallel_size == 1 and config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.tensor_parallel_size == 1 and not config.num_threads and config.adaptive_threads:
            return AdaptiveThreads(torch.set_num_threads, max_threads=torch.get_num_threads())
        return None

    def _build_runner(self, config: EngineConfig, tp: TensorParallel) -> RankModel:
        """This rank's model on its device and the runner around it (CUDA graphs where they fit);
        the workers, if any, are connected once it stands, and stopped if it fails."""
        try:
            built = build_rank_model(config, tp)
            self.runner = ModelRunner.for_rank(built, config)
            if built.memory_plan is not None:
                logger.info("GPU memory: %s", built.memory_plan)
            # A length-dependent RoPE reads per-token lengths that the captured graphs do not carry.
            graphs_fit = not built.model.rotary.length_dependent
            if built.device != "cpu" and not config.enforce_eager and config.tensor_parallel_size == 1 and graphs_fit:
                from pagedllm.execution.cuda_graphs import DecodeGraphs

                self.runner.graphs = DecodeGraphs(self.runner, config.max_num_seqs, built.max_model_len)
            if self.workers is not None:
                self.workers.connect()
                atexit.register(self.shutdown)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(send=False)
            raise
        return built

    def _make_scheduler(self, config: EngineConfig, built: RankModel) -> Scheduler:
        rotary = built.model.rotary
        exact = self.speculation is not None and config.speculative_exact
        self.draft_row_limits = built.model.kernel_row_limits() if exact else ()
        if exact:
            logger.info(
                "speculative decoding: drafts keep a step within the row ranges ending at %s", self.draft_row_limits
            )
        return Scheduler(
            self.kv_cache,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.prefill_tokens_with_decodes,
            prompt_salt=rotary.cache_salt if rotary.length_dependent else None,
            speculation=self.speculation,
            draft_filter=self._draft_filter if self.speculation is not None else None,
            draft_row_limits=self.draft_row_limits,
            admit=self._admit,
            adapter_blocks=self.adapters.blocks_of,
        )

    def _admit(self, request: Request) -> bool:
        """The scheduler's question for a waiting request: is its LoRA adapter resident (made so
        where a slot is free or idle)?  An adapter whose file now fails to load ends the request
        with that error after the step is scheduled (`_adapter_failures`)."""
        if request.adapter is None:
            return True
        busy = {r.adapter for r in self.scheduler.running if r.adapter is not None}
        try:
            return self.adapters.make_resident(request.adapter, busy)
        except (ValueError, OSError) as error:  # ModelFileError is a ValueError
            name = self.adapters.name_of(request.adapter)
            self._adapter_failures[request.request_id] = f"LoRA adapter {name!r} could not be loaded: {error}"
            return False

    def _reclaim_adapter_pages(self) -> None:
        """Adapters share the KV cache's blocks: when the waiting request at the head of the queue
        (and one more block for each running request) needs more blocks than are free, idle
        adapters give theirs back, least recently used first."""
        scheduler, kv = self.scheduler, self.kv_cache
        if not scheduler.waiting:
            return
        head = scheduler.waiting[0]
        needed = kv.blocks_for_tokens(len(head.token_ids) + 1) * kv.num_groups + len(scheduler.running)
        if kv.num_free_blocks < needed:
            busy = {r.adapter for r in scheduler.running if r.adapter is not None} | {head.adapter}
            self.adapters.reclaim(needed - kv.num_free_blocks, busy)

    def _log_start(self, built: RankModel, tp: TensorParallel) -> None:
        config, c, num_blocks = self.config, built.model_config, built.num_blocks
        tokens = num_blocks * config.block_size
        logger.info(
            "model %s (%s on %s, %d layers, %s linears); %s %s KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB "
            "(%s); max model length %d -> %.2fx concurrency at full length",
            built.path.name,
            str(self.dtype).removeprefix("torch."),
            built.device,
            c.num_layers,
            self.linear_backend,
            self._layout_description(),
            str(self.kv_dtype).removeprefix("torch."),
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

    def _speculation(self, config: EngineConfig) -> Speculation | None:
        if config.speculative == "off":
            return None
        if config.tensor_parallel_size > 1 and config.speculative_row_cost is None:
            # The measurement runs steps on rank 0 alone, which the other ranks would not join.
            raise ValueError(
                "speculative decoding with tensor parallelism needs speculative_row_cost "
                "(--speculative-row-cost): measure it on one rank, where the engine logs it at start"
            )
        given = config.speculative_row_cost
        cost = StepCost(given) if given is not None else measure_step_cost(self.runner)
        logger.info(
            "speculative decoding: %s drafts, at most %d per request and step (a row costs %.3f of a step's "
            "base, plus %.2e per context token)%s",
            config.speculative,
            config.num_speculative_tokens,
            cost.row,
            cost.context_token,
            "" if config.speculative_exact else "; drafts may cross the kernels' row limits",
        )
        return Speculation.build(config.speculative, config.num_speculative_tokens, cost)

    @staticmethod
    def _lora_refusal(config: EngineConfig, built: RankModel) -> str:
        """Why this engine cannot run LoRA adapters ('' where it can)."""
        if not built.model.supports_lora:
            return f"the {built.model_config.architecture} architecture's layers take no adapters"
        if config.tensor_parallel_size > 1:
            return "tensor parallelism does not split adapters yet (tensor_parallel_size must be 1)"
        if config.speculative != "off":
            return "speculative decoding does not verify drafts under adapters yet (speculative must be off)"
        return ""

    def _draft_filter(self, request: Request, draft: list[int]) -> int:
        """How many leading draft tokens the request's grammar allows (all, unconstrained)."""
        try:
            return self.runner.structured.valid_prefix(request.request_id, draft)
        except Exception:  # the grammar's own fault shows (and ends the request) when it samples
            return 0

    def _layout_description(self) -> str:
        config = self.config
        if config.kv_layout == "contiguous":
            return f"contiguous (reserve {config.reserve}, no prefix caching)"
        return "paged (prefix caching on)" if config.enable_prefix_caching else "paged (prefix caching off)"

    # --- requests ----------------------------------------------------------------------

    @property
    def groups(self) -> dict[str, RequestGroup]:
        """The unfinished requests, by request id."""
        return self.table.groups

    @property
    def requests(self) -> dict[str, Request]:
        """The live sequences, by sequence id (a request's id when n=1)."""
        return self.table.sequences

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> str:
        """Queue a request (pagedllm/engine/intake.py checks it); with `params.n > 1` its samples
        fork from one computed prompt.  `lora`: the name of a loaded LoRA adapter to run it under."""
        adapter = None if lora is None else self.adapters.key_of(lora)
        return self.intake.add_request(prompt, params or SamplingParams(), request_id, adapter)

    # --- LoRA adapters (execution/lora_adapters.py) -------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Register the LoRA adapter (PEFT directory or GGUF file) at `path` as `name` (checked whole
        now, resident while `max_loras` allows, else read again when a request needs it); requests
        pick it by name."""
        if self.lora_refusal:
            raise ValueError(f"LoRA adapters cannot run here: {self.lora_refusal}")
        self.adapters.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; refused while a request runs under it."""
        key = self.adapters.key_of(name)
        users = sum(1 for r in self.table.sequences.values() if r.adapter == key)
        if users:
            raise ValueError(f"adapter {name!r} is in use by {users} unfinished request(s)")
        self.adapters.unload(name)

    def lora_adapters(self) -> list[dict]:
        """The registered adapters: name, path, whether resident, bytes."""
        return self.adapters.describe()

    @property
    def grammars(self) -> StructuredOutputs:
        """The grammar compiler, safe to call from any thread: `prepare(spec)` compiles a constraint
        and builds its first matcher, so that adding the request later costs a copy (a big schema
        takes seconds); `build_tokenizer()` readies the vocabulary for the first one."""
        return self.runner.structured

    # --- what the outside reads (pagedllm/engine/state.py), on the engine thread -------

    def on_worker_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` when a tensor-parallel worker dies (never without tensor parallelism)."""
        if self.workers is not None:
            self.workers.on_failure.append(callback)

    @property
    def worker_failure(self) -> BaseException | None:
        """Why a tensor-parallel worker died, if one did."""
        return self.workers.failure if self.workers is not None else None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_kv_blocks_used(self) -> int:
        return self.kv_cache.num_used_blocks

    def state(self) -> dict:
        """Counters and KV occupancy, as `/stats` reports them."""
        return engine_state(self)

    def kv_picture(self) -> dict:
        """Every block's state and the requests' block tables, for the dashboard."""
        return kv_picture(self)

    def drain_kv_events(self) -> list[tuple[bool, bytes]]:
        """Block keys the prefix cache stored (True) and evicted since the last call (with
        `record_kv_events`)."""
        return self.kv_cache.drain_events()

    def begin_run(self) -> RunCounters:
        """A benchmark run starts: peaks start over and the counters are read."""
        return begin_run(self)

    def run_report(self, before: RunCounters) -> dict:
        """What the engine did since `begin_run(...)` returned `before`."""
        return run_report(self, before)

    def kv_memory_rows(self) -> list[dict]:
        """The KV memory series sampled after every step since the last `begin_run`."""
        return self.memory.rows()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (all its samples) at once, freeing its blocks; None if it is unknown or done."""
        return self.output_processor.abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache's contents (no request may be running): the next prompts are
        computed in full, as on a fresh engine (a benchmark's runs of the same prompts)."""
        self.kv_cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the step loop -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, run the model, update the requests."""
        if self.adapters.pages is not None and self.adapters.resident:
            self._reclaim_adapter_pages()
        scheduled = self.scheduler.schedule()
        result = self._execute(scheduled) if not scheduled.is_empty else ModelRunnerOutput({}, {})
        outputs = self._update(scheduled, result) if result is not None else self._fail_step(scheduled)
        if self._adapter_failures:
            outputs += self._fail_adapter_requests()
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
        outputs = self.output_processor.process(scheduled, result)
        self.memory.record(self.scheduler, stats.steps, scheduled.admission_blocked_by == "memory")
        return outputs

    def _fail_adapter_requests(self) -> list[RequestOutput]:
        """End the requests whose adapter failed to load at admission, each with its error."""
        outputs = []
        for sequence_id, why in self._adapter_failures.items():
            group = self.table.group_of.get(sequence_id)
            if group is not None:
                self.output_processor.fail_group(group, why, "model")
                outputs.append(self.output_processor.output(group))
        self._adapter_failures.clear()
        return outputs

    def _fail_step(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Every request of a step whose forward pass failed ends with the error (the rule in
        output_processor.py); `MAX_FAILED_STEPS` failures in a row mean the engine cannot compute
        at all, and `_execute` raises EngineStepError."""
        self.stats.steps += 1
        return self.output_processor.fail_step(scheduled, self._step_error)

    def wait_all(self) -> list[RequestOutput]:
        """Run steps until every request is done; return the final outputs in finish order."""
        finished = []
        while self.has_unfinished_requests():
            finished.extend(o for o in self.step() if o.finished)
        return finished
