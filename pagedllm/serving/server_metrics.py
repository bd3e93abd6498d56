"""What the server measures: Prometheus metrics and the dashboard's throughput window.

`ServerMetrics.observe_step` runs on the engine thread after every step
(prometheus-client objects are thread-safe); the HTTP side only renders.
Each server has its own registry, so several servers can live in one process.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from pagedllm.core.outputs import RequestOutput
from pagedllm.engine import LLMEngine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
THROUGHPUT_WINDOW_S = 60.0

disable_created_metrics()  # no `_created` timestamp series beside every counter


LORA_GAUGES = (
    ("registered", "pagedllm_lora_adapters_registered", "LoRA adapters registered"),
    ("resident", "pagedllm_lora_adapters_resident", "LoRA adapters resident in memory"),
    ("resident_bytes", "pagedllm_lora_resident_bytes", "Bytes the resident LoRA adapters hold"),
    ("resident_kv_blocks", "pagedllm_lora_resident_kv_blocks", "KV cache blocks the resident LoRA adapters hold"),
)


@dataclass
class _Progress:
    num_tokens: int = 0  # generated tokens seen so far, over all samples
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("pagedllm_requests_running", "Sequences scheduled in the running batch", registry=r)
        self.waiting = Gauge("pagedllm_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_blocks_total = Gauge("pagedllm_kv_blocks_total", "KV cache blocks", registry=r)
        self.kv_blocks_used = Gauge("pagedllm_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.kv_blocks_free = Gauge("pagedllm_kv_blocks_free", "KV blocks nobody holds (cached included)", registry=r)
        self.kv_blocks_cached = Gauge(
            "pagedllm_kv_blocks_cached", "KV blocks whose content the prefix cache can find", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "pagedllm_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens", registry=r
        )
        self.preemptions = Counter("pagedllm_preemptions", "Requests preempted (recomputed later)", registry=r)
        self.prompt_tokens = Counter("pagedllm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pagedllm_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "pagedllm_requests_finished", "Requests finished, by reason", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "pagedllm_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pagedllm_inter_token_latency_seconds",
            "Time between a request's consecutive tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.draft_tokens = Counter(
            "pagedllm_spec_draft_tokens", "Speculative decoding: draft tokens verified", registry=r
        )
        self.accepted_tokens = Counter(
            "pagedllm_spec_accepted_tokens", "Speculative decoding: draft tokens accepted", registry=r
        )
        self.acceptance_rate = Gauge(
            "pagedllm_spec_acceptance_rate", "Speculative decoding: accepted / verified draft tokens", registry=r
        )
        self.mean_accepted_length = Gauge(
            "pagedllm_spec_mean_accepted_length",
            "Speculative decoding: tokens a request emits per step in which it verifies drafts",
            registry=r,
        )
        self.draft_tokens_per_step = Gauge(
            "pagedllm_spec_draft_tokens_per_step", "Speculative decoding: draft tokens per decoding step", registry=r
        )
        # /stats' `lora` field -> its gauge
        self.lora_gauges = {field: Gauge(name, text, registry=r) for field, name, text in LORA_GAUGES}
        self.lora_evictions = Counter(
            "pagedllm_lora_evictions", "LoRA adapters evicted to make room for another", registry=r
        )
        self._lora_evictions_seen = 0
        self._progress: dict[str, _Progress] = {}
        self._preemptions_seen = 0
        self._drafts_seen = (0, 0)  # draft tokens, accepted tokens
        # (time, tokens generated in that step) for the last minute: the dashboard's throughput.
        self.recent_steps: deque[tuple[float, int]] = deque()

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput], step_seconds: float | None) -> None:
        now = time.monotonic()
        generated = 0
        for output in outputs:
            progress = self._progress.setdefault(output.request_id, _Progress())
            num_tokens = sum(c.num_tokens for c in output.outputs)
            new = num_tokens - progress.num_tokens
            if new > 0:
                if progress.last_token_time is None:
                    if output.time_to_first_token is not None:
                        self.ttft.observe(output.time_to_first_token)
                else:
                    gap = (now - progress.last_token_time) / new
                    for _ in range(new):
                        self.itl.observe(gap)
                progress.num_tokens, progress.last_token_time = num_tokens, now
                generated += new
            if output.finished:  # aborted ones included
                del self._progress[output.request_id]
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.finished.labels(finish_reason=output.finish_reason or "unknown").inc()
        self.generation_tokens.inc(generated)
        if step_seconds is not None:
            self.recent_steps.append((now, generated))
        while self.recent_steps and self.recent_steps[0][0] < now - THROUGHPUT_WINDOW_S:
            self.recent_steps.popleft()
        self.refresh_gauges(engine)

    def refresh_gauges(self, engine: LLMEngine) -> None:
        state = engine.state()  # the same figures /stats and the dashboard show
        kv = state["kv"]
        self.running.set(state["running"])
        self.waiting.set(state["waiting"])
        self.kv_blocks_total.set(kv["num_blocks"])
        self.kv_blocks_used.set(kv["used_blocks"])
        self.kv_blocks_free.set(kv["free_blocks"])
        self.kv_blocks_cached.set(kv["cached_blocks"])
        self.prefix_hit_rate.set(state["prefix_cache_hit_rate"])
        self.preemptions.inc(state["preemptions"] - self._preemptions_seen)
        self._preemptions_seen = state["preemptions"]
        lora = state["lora"]
        if lora is not None:
            for field, gauge in self.lora_gauges.items():
                gauge.set(lora[field])
            self.lora_evictions.inc(lora["evictions"] - self._lora_evictions_seen)
            self._lora_evictions_seen = lora["evictions"]
        spec = state["speculation"]
        if spec is not None:
            self.draft_tokens.inc(spec["draft_tokens"] - self._drafts_seen[0])
            self.accepted_tokens.inc(spec["accepted_tokens"] - self._drafts_seen[1])
            self._drafts_seen = (spec["draft_tokens"], spec["accepted_tokens"])
            self.acceptance_rate.set(spec["acceptance_rate"])
            self.mean_accepted_length.set(spec["mean_accepted_length"])
            self.draft_tokens_per_step.set(spec["draft_tokens_per_step"])

    def throughput(self, now: float | None = None, bucket_s: float = 1.0) -> list[int]:
        """Tokens generated in each of the last 60 one-second buckets, oldest first."""
        now = time.monotonic() if now is None else now
        buckets = [0] * int(THROUGHPUT_WINDOW_S / bucket_s)
        for t, tokens in self.recent_steps:
            age = int((now - t) / bucket_s)
            if 0 <= age < len(buckets):
                buckets[len(buckets) - 1 - age] += tokens
        return buckets

    def render(self) -> bytes:
        return generate_latest(self.registry)
