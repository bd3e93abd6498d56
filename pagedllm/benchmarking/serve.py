"""Online benchmark: replay requests against an OpenAI-compatible server, as clients would.

Every request is a streamed `/v1/completions` call with token-id prompts, greedy, EOS
ignored, sent at `request_rate` requests/s (Poisson arrivals from a seed; `inf`: all at
once), at most `max_concurrency` in flight when set.  Per request it measures the time to
first token (TTFT), the gaps between its chunks (inter-token latency, ITL: each chunk
carries one step's text), the time per output token after the first (TPOT) and the
end-to-end latency.  Goodput counts the requests that met every SLO given (e.g.
`ttft:500 tpot:50`, in milliseconds) per second.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import dataclass, field

SLO_METRICS = ("ttft", "tpot", "e2el")

logger = logging.getLogger("pagedllm")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: expected METRIC:MILLISECONDS, e.g. ttft:500") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be positive")
        slos[name] = ms / 1000
    return slos


@dataclass
class RequestTiming:
    ttft: float | None = None
    e2el: float = 0.0
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def meets(self, slos: dict[str, float]) -> bool:
        if self.error is not None:
            return False
        values = {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.e2el}
        return all(values[name] is None or values[name] <= limit for name, limit in slos.items())


def percentiles(values: list[float], name: str) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {
        f"{name}_mean_s": round(statistics.fmean(ordered), 4),
        f"{name}_p50_s": at(0.5),
        f"{name}_p90_s": at(0.9),
        f"{name}_p99_s": at(0.99),
    }


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate, from 0; all zero when rate is inf."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return times


async def replay(
    base_url: str,
    requests: list[dict],
    rate: float,
    seed: int = 0,
    model: str | None = None,
    max_concurrency: int | None = None,
    slos: dict[str, float] | None = None,
    api_key: str = "bench",
) -> dict:
    """Send every request at its arrival time; returns throughput, latency percentiles, goodput."""
    import openai

    slos = slos or {}
    timings = [RequestTiming() for _ in requests]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(client: openai.AsyncOpenAI, item: dict, delay: float, timing: RequestTiming) -> None:
        await asyncio.sleep(delay)
        if limit is not None:
            await limit.acquire()
        sent = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=model,
                prompt=item["prompt_token_ids"],
                max_tokens=item["max_tokens"],
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            last = None
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    timing.output_tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].text:
                    if last is None:
                        timing.ttft = now - sent
                    else:
                        timing.gaps.append(now - last)
                    last = now
        except openai.APIError as error:
            timing.error = f"{type(error).__name__}: {error}"
        finally:
            timing.e2el = time.perf_counter() - sent
            if limit is not None:
                limit.release()

    if model is None:
        model = await served_model(base_url, api_key)
    delays = arrival_times(len(requests), rate, seed)
    start = time.perf_counter()
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600) as client:
        await asyncio.gather(*(one(client, r, d, t) for r, d, t in zip(requests, delays, timings)))
    wall = time.perf_counter() - start
    done = [t for t in timings if t.error is None]
    tokens = sum(t.output_tokens for t in done)
    result = {
        "model": model,
        "requests": len(requests),
        "completed": len(done),
        "failed": len(requests) - len(done),
        "request_rate": "inf" if rate == float("inf") else rate,
        "max_concurrency": max_concurrency,
        "wall_s": round(wall, 3),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2),
        "requests_per_s": round(len(done) / wall, 3),
        **percentiles([t.ttft for t in done if t.ttft is not None], "ttft"),
        **percentiles([g for t in done for g in t.gaps], "itl"),
        **percentiles([t.tpot for t in done if t.tpot is not None], "tpot"),
        **percentiles([t.e2el for t in done], "e2el"),
    }
    if slos:
        good = sum(t.meets(slos) for t in timings)
        result["goodput_slos_ms"] = {name: round(limit * 1000, 3) for name, limit in slos.items()}
        result["good_requests"] = good
        result["goodput_requests_per_s"] = round(good / wall, 3)
    errors = [t.error for t in timings if t.error is not None]
    if errors:
        result["first_error"] = errors[0]
    return result


async def served_model(base_url: str, api_key: str) -> str:
    """The first model the server lists (what a client would pick when told nothing)."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as client:
        models = await client.models.list()
    if not models.data:
        raise ValueError(f"{base_url}/models lists no model")
    return models.data[0].id


DEFAULT_VOCAB_SIZE = 32000  # the smallest common vocabulary (llama 2, mistral): its ids are valid almost everywhere


def wait_until_ready(base_url: str, api_key: str, timeout_s: float) -> None:
    """Poll /models until the server answers (it may still be loading its model)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
            if response.status_code == 200:
                return
            problem = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code in (401, 403, 404):
                raise ValueError(f"{base_url}/models answered {problem}")
        except httpx.TransportError as error:
            problem = f"{type(error).__name__}: {error}"
        if time.monotonic() > deadline:
            raise ValueError(f"the server at {base_url} did not answer within {timeout_s:.0f} s ({problem})")
        time.sleep(1.0)


def server_vocab_size(base_url: str, api_key: str) -> int:
    """The vocabulary size a server reports in /v1/models (pagedllm does; others may not)."""
    import httpx

    response = httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    response.raise_for_status()
    data = response.json().get("data") or [{}]
    size = data[0].get("vocab_size")
    if not isinstance(size, int) or size < 2:
        logger.warning("the server does not report its vocabulary size: drawing token ids below %d", DEFAULT_VOCAB_SIZE)
        return DEFAULT_VOCAB_SIZE
    return size
