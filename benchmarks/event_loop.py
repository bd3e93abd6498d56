"""Does a heavy request stall other streams?  8 streams decode while another client posts a
200 KB prompt, then a 1 MB JSON schema (a new one each round); the 8 streams'
inter-token gaps are compared with a normal step's.  A first round warms the server up
and is not reported.

    python benchmarks/event_loop.py [--streams 8] [--rounds 3] [--out bench-results/event-loop.json]

Starts `pagedllm serve` (SmolLM2, the default dtype) on a free port.  For each heavy
kind, in each round, the 8 streams start together; once every stream has sent 20
tokens, the heavy body is posted (and answered: the prompt is over the context
length, a 400 after tokenizing; the schema request generates 4 tokens under its
grammar).  A "normal step" is the median gap of the quiet phase before the post; the
figure is the largest gap of any of the 8 streams while the heavy request is being
prepared and answered, as a multiple of that median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def heavy_prompt() -> dict:
    words = "the quick brown fox jumps over the lazy dog and keeps running far away "
    text = (words * (200_000 // len(words) + 1))[:200_000]
    return {"path": "/v1/completions", "body": {"prompt": text, "max_tokens": 4}}


def heavy_schema(round_index: int) -> dict:
    # 1,000 required string fields with 1,000-character descriptions: 1 MB of JSON that the grammar
    # engine accepts (4,000 optional fields go past its parser limits, a 400 before any step).
    # Field names differ by round: every round's schema is new to the server (nothing cached).
    properties = {f"r{round_index}_field_{i}": {"type": "string", "description": "x" * 1000} for i in range(1000)}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    body = {
        "messages": [{"role": "user", "content": "Fill in the form."}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}},
    }
    return {"path": "/v1/chat/completions", "body": body}


async def stream(client: httpx.AsyncClient, times: list[float], max_tokens: int) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


async def one_round(url: str, streams: int, heavy: dict, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        times: list[list[float]] = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(stream(client, t, max_tokens)) for t in times]
        while min(len(t) for t in times) < 20:
            await asyncio.sleep(0.01)
        # Encoded beforehand: serializing 1 MB here would stall this client's own loop, whose
        # timestamps of the 8 streams are what is measured.
        content = heavy["content"]
        posted = time.perf_counter()
        response = await client.post(heavy["path"], content=content, headers={"content-type": "application/json"})
        answered = time.perf_counter()
        await asyncio.gather(*tasks)
    quiet, busy = [], []
    for t in times:
        for a, b in zip(t, t[1:]):
            if b <= posted:
                quiet.append(b - a)
            elif a <= answered:  # a gap that overlaps the heavy request's life
                busy.append(b - a)
    normal = statistics.median(quiet)
    return {
        "status": response.status_code,
        "heavy_seconds": answered - posted,
        "normal_step_ms": normal * 1e3,
        "max_gap_ms": max(busy) * 1e3,
        "max_gap_over_normal": max(busy) / normal,
        "gaps_measured": len(busy),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens each of the streams generates")
    parser.add_argument("--out", default="bench-results/event-loop.json")
    parser.add_argument("serve_args", nargs="*", help="more `pagedllm serve` arguments (after --)")
    args = parser.parse_args()

    port = free_port()
    command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--log-level", "WARNING"]
    server = subprocess.Popen([*command, *args.serve_args], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        results: dict[str, list[dict]] = {"prompt_200kb": [], "schema_1mb": []}
        for round_index in range(-1, args.rounds):  # the two kinds alternated; round -1 warms up, unreported
            for kind, heavy in (("prompt_200kb", heavy_prompt()), ("schema_1mb", heavy_schema(round_index))):
                heavy["content"] = json.dumps(heavy["body"]).encode()
                result = asyncio.run(one_round(url, args.streams, heavy, args.max_tokens))
                print(kind, "warm-up" if round_index < 0 else "", json.dumps(result), flush=True)
                if round_index >= 0:
                    results[kind].append(result)
        summary = {}
        for kind, runs in results.items():
            ratios = sorted(r["max_gap_over_normal"] for r in runs)
            summary[kind] = {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}
            print(
                f"{kind}: largest gap / normal step: median {summary[kind]['median']:.2f}x "
                f"(min {ratios[0]:.2f}x, max {ratios[-1]:.2f}x) over {len(runs)} rounds"
            )
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"streams": args.streams, "summary": summary, "runs": results}, indent=1))
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
