"""Offline throughput: submit a whole workload at once, run to completion, report."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine


def print_result(result: dict, output: str | Path | None = None) -> None:
    """Print a result as JSON, and write the same text to `output` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")


def run_bench(config: EngineConfig, requests: list[dict], ignore_eos: bool = True) -> dict:
    with LLMEngine(config) as engine:
        return run_on_engine(engine, requests, ignore_eos)


def run_on_engine(engine: LLMEngine, requests: list[dict], ignore_eos: bool = True, desc: str = "bench") -> dict:
    start = time.perf_counter()
    for item in requests:
        params = SamplingParams(
            n=item.get("n", 1),
            temperature=item.get("temperature", 0.0),
            seed=item.get("seed"),
            max_tokens=item["max_tokens"],
            ignore_eos=ignore_eos,
        )
        engine.add_request(item["prompt_token_ids"], params, request_id=item["id"], lora=item.get("lora"))
    before = engine.begin_run()
    output_tokens = 0
    ttfts = []
    errors: list[str] = []
    with tqdm(total=len(requests), desc=desc, unit="req") as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    output_tokens += sum(c.num_tokens for c in output.outputs)
                    ttfts.append(output.time_to_first_token or 0.0)
                    if output.finish_reason == "error":
                        errors.append(output.error or "unknown error")
                    bar.update(1)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    ttfts.sort()
    return {
        "wall_s": round(wall, 3),
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall, 2),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 2),
        "ttft_median_s": round(ttfts[len(ttfts) // 2], 3),
        # Requests a fault ended (`pagedllm bench` exits 1 when there are any).
        "failed_requests": len(errors),
        **({"first_error": errors[0]} if errors else {}),
        **engine.run_report(before),
    }


def warmup_requests(requests: list[dict], count: int = 4, max_tokens: int = 16) -> list[dict]:
    """What every engine in a comparison runs, untimed, after it starts: the first `count`
    prompts reversed (so the timed run finds none of them in a prefix cache), `max_tokens` each."""
    return [
        {"id": f"warm-up-{i}", "prompt_token_ids": r["prompt_token_ids"][::-1], "max_tokens": max_tokens}
        for i, r in enumerate(requests[:count])
    ]


def start_and_run(config: EngineConfig, requests: list[dict], warmup: list[dict]) -> dict:
    """Start an engine (timed: `startup_s`), run `warmup` untimed, then the workload (timed)."""
    begin = time.perf_counter()
    with LLMEngine(config) as engine:
        startup = time.perf_counter() - begin
        if warmup:
            run_on_engine(engine, warmup, desc="warm-up")
        return {"startup_s": round(startup, 2)} | run_on_engine(engine, requests)


def run_in_subprocess(config: EngineConfig, requests: list[dict], warmup: list[dict]) -> dict:
    """`start_and_run` in a fresh python process, as a peer engine's run is: every start pays
    the same (kernels load from their cache, weights from the page cache)."""
    settings = {"config": dataclasses.asdict(config), "requests": requests, "warmup": warmup}
    command = [sys.executable, "-m", "pagedllm.benchmarking.throughput"]
    proc = subprocess.run(command, input=json.dumps(settings), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"pagedllm run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


if __name__ == "__main__":  # the child of run_in_subprocess: settings on stdin, one RESULT line out
    given = json.loads(sys.stdin.read())
    result = start_and_run(EngineConfig(**given["config"]), given["requests"], given["warmup"])
    print("RESULT " + json.dumps(result))
