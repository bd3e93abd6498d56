"""The engine: requests in, a step loop (schedule, run, update), outputs out."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from pagedllm.attention import select_attention
from pagedllm.config import EngineConfig
from pagedllm.contiguous_kv import ContiguousKVCacheManager
from pagedllm.detokenizer import IncrementalDetokenizer
from pagedllm.kv_cache_manager import KVCacheManager
from pagedllm.kv_metrics import KVMemoryTracker
from pagedllm.model import LlamaModel
from pagedllm.model_loader import load_weights, resolve_model_path
from pagedllm.model_runner import ModelRunner, ModelRunnerOutput
from pagedllm.outputs import RequestOutput, TokenLogprob
from pagedllm.request import FinishReason, Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler, SchedulerOutput
from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")


def cpu_has_native_bf16() -> bool:
    """True where bfloat16 matmuls beat float32 (AVX512-BF16 or AMX); measured in docs/dtype.md."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@dataclass
class EngineStats:
    steps: int = 0
    peak_running: int = 0
    kv_peak_blocks_used: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = resolve_model_path(config.model)
        self.dtype = resolve_dtype(config.dtype)
        model_config, weights = load_weights(path)
        self.model_config = model_config
        self.tokenizer = Tokenizer(path)
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = model_config.eos_token_id
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings

        attention = select_attention(config.attention, model_config.head_dim, model_config.num_heads)
        model = LlamaModel(model_config, self.dtype, self.max_model_len, attention)
        model.load_hf_weights(weights)
        del weights

        c = model_config
        bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        num_blocks = config.kv_cache_memory // (bytes_per_token * config.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {config.kv_cache_memory} bytes holds no block of {config.block_size} tokens "
                f"({bytes_per_token * config.block_size} bytes each)"
            )
        if config.kv_layout == "contiguous":
            self.kv_cache = ContiguousKVCacheManager(num_blocks, config.block_size, self.max_model_len, config.reserve)
        else:
            self.kv_cache = KVCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.dtype, config.seed)
        tokens = num_blocks * config.block_size
        logger.info(
            "model %s (%s, %d layers); %s KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB; "
            "max model length %d -> %.2fx concurrency at full length",
            path.name,
            str(self.dtype).removeprefix("torch."),
            c.num_layers,
            config.kv_layout if config.kv_layout == "paged" else f"contiguous (reserve {config.reserve})",
            num_blocks,
            config.block_size,
            tokens,
            num_blocks * config.block_size * bytes_per_token / 2**30,
            self.max_model_len,
            tokens / self.max_model_len,
        )

        self.requests: dict[str, Request] = {}
        self._prompts: dict[str, str | None] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.memory = KVMemoryTracker()

    # --- requests ----------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self._check_prompt(token_ids)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, self.eos_token_id, self.max_model_len)
        self.scheduler.add_request(request)  # raises if it can never fit
        self.requests[request_id] = request
        self._prompts[request_id] = text
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        return request_id

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but the maximum model length is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.ABORT)
        return self._output(request, "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the step loop -----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, run the model, update the requests."""
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled) if not scheduled.is_empty else ModelRunnerOutput({}, {})
        return self._update(scheduled, result)

    def _update(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        stats = self.stats
        stats.steps += 1
        stats.peak_running = max(stats.peak_running, len(scheduled.scheduled))
        stats.kv_peak_blocks_used = max(stats.kv_peak_blocks_used, self.kv_cache.num_used_blocks)
        for request_id, logprob in result.logprobs.items():
            self.requests[request_id].logprobs.append(logprob)
        self.scheduler.update(scheduled, result.sampled)

        outputs = []
        for request_id in result.sampled:
            request = self.requests[request_id]
            detok = self._detokenizers[request_id]
            delta, hit_stop = detok.update(self._text_ids(request), request.finished)
            if hit_stop and not request.finished:
                self.scheduler.finish(request, FinishReason.STOP)
            outputs.append(self._output(request, delta))
        self.memory.record(self.scheduler, stats.steps, scheduled.admission_blocked_by == "memory")
        return outputs

    def _text_ids(self, request: Request) -> list[int]:
        """Output ids that make up the text: a final stop token is not part of it."""
        ids = request.output_token_ids
        if (
            request.finish_reason == FinishReason.STOP
            and ids
            and (ids[-1] in request.sampling_params.stop_token_ids or ids[-1] == self.eos_token_id)
        ):
            return ids[:-1]
        return ids

    def _output(self, request: Request, delta: str) -> RequestOutput:
        request_id = request.request_id
        text = self._detokenizers[request_id].text
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs = [
                TokenLogprob(token, lp, top) for token, (lp, top) in zip(request.output_token_ids, request.logprobs)
            ]
        output = RequestOutput(
            request_id=request_id,
            prompt=self._prompts[request_id],
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=request.output_token_ids,
            finished=request.finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            logprobs=logprobs,
            time_to_first_token=(request.first_token_time - request.arrival_time) if request.first_token_time else None,
            num_preemptions=request.num_preemptions,
            delta=delta,
        )
        if request.finished:
            self._forget(request_id)
        return output

    def _forget(self, request_id: str) -> None:
        del self.requests[request_id], self._prompts[request_id], self._detokenizers[request_id]
        self.runner.release(request_id)

    def wait_all(self) -> list[RequestOutput]:
        """Run steps until every request is done; return the final outputs in finish order."""
        finished = []
        while self.has_unfinished_requests():
            finished.extend(o for o in self.step() if o.finished)
        return finished
