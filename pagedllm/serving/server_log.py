"""What the server writes to its log while it runs: a line per finished request, and a
periodic line of throughput, queue and KV use (every `interval_s` while anything happens).

`ServerLog.observe_step` runs on the engine thread after every step, like the metrics.
Lines carry counts and timings, never prompts or outputs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedllm.core.outputs import RequestOutput
from pagedllm.engine import LLMEngine

logger = logging.getLogger("pagedllm.server")

STATS_INTERVAL_S = 10.0


@dataclass
class _Window:
    """Tokens since the last periodic line."""

    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0


class ServerLog:
    def __init__(self, interval_s: float = STATS_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._generated: dict[str, int] = {}  # request id -> tokens seen so far (all samples)
        self._first_seen: dict[str, float] = {}  # request id -> when its first output came
        self._window = _Window()

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput], step_seconds: float | None) -> None:
        now = time.monotonic()
        for output in outputs:
            num_tokens = sum(c.num_tokens for c in output.outputs)
            seen = self._generated.get(output.request_id)
            if seen is None:
                self._first_seen[output.request_id] = now - (output.time_to_first_token or 0.0)
                self._window.prompt_tokens += len(output.prompt_token_ids)
                seen = 0
            self._window.generated_tokens += num_tokens - seen
            self._generated[output.request_id] = num_tokens
            if output.finished:
                self._log_finished(output, num_tokens, now)
        if now - self._window.start >= self.interval_s and (
            self._window.generated_tokens or self._window.prompt_tokens or engine.has_unfinished_requests()
        ):
            self._log_stats(engine, now)

    def _log_finished(self, output: RequestOutput, num_tokens: int, now: float) -> None:
        del self._generated[output.request_id]
        started = self._first_seen.pop(output.request_id)
        self._window.finished += 1
        ttft = f"{output.time_to_first_token:.3f} s" if output.time_to_first_token is not None else "none"
        reasons = sorted({c.finish_reason or "unknown" for c in output.outputs})
        logger.info(
            "request %s finished (%s): %d prompt + %d generated tokens, time to first token %s, %.3f s in all",
            output.request_id,
            ",".join(reasons),
            len(output.prompt_token_ids),
            num_tokens,
            ttft,
            now - started,
        )

    def _log_stats(self, engine: LLMEngine, now: float) -> None:
        window, seconds = self._window, max(now - self._window.start, 1e-9)
        state = engine.state()
        kv = state["kv"]
        logger.info(
            "last %.0f s: %.1f generated tok/s, %.1f prompt tok/s, %d finished; running %d, waiting %d; "
            "KV cache %.1f%% used (%d of %d blocks, %d cached), prefix-cache hit rate %.1f%%, %d preemptions",
            seconds,
            window.generated_tokens / seconds,
            window.prompt_tokens / seconds,
            window.finished,
            state["running"],
            state["waiting"],
            100.0 * kv["used_blocks"] / kv["num_blocks"],
            kv["used_blocks"],
            kv["num_blocks"],
            kv["cached_blocks"],
            100.0 * state["prefix_cache_hit_rate"],
            state["preemptions"],
        )
        self._window = _Window(start=now)
