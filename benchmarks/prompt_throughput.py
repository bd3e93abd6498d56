"""Prompt throughput: a workload's prompts with one token out each, tokens/s of the steps.

    python benchmarks/prompt_throughput.py --model smollm2 [--weights auto] [--repeats 5]
    git worktree add ../before COMMIT
    python benchmarks/prompt_throughput.py --against ../before --repeats 5

Every prompt of `--workload` is submitted at once (greedy, one token out, prefix caching off so
each round computes every prompt, steps of up to the engine's default 4,096 prompt tokens);
a warm-up pass runs first in each process.  With `--against DIR` the same measurement runs
alternately on this checkout and on another checkout of pagedllm (an earlier commit, say),
each round in fresh processes, and the paired ratio (this / other) is reported: how a change
moved prompt throughput, measured side by side.  Results go to bench-results/ unless --output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def measure(model: str, weights: str, workload: str) -> dict:
    """One process's figure (run in the checkout whose pagedllm is importable)."""
    from pagedllm.benchmarking.datasets import load_workload
    from pagedllm.config import EngineConfig
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.engine import LLMEngine

    requests = load_workload(workload)
    engine = LLMEngine(EngineConfig(model=model, weights=weights, kv_cache_memory="4GiB", enable_prefix_caching=False))
    tokens = sum(len(r["prompt_token_ids"]) for r in requests)

    def run(tag: str) -> float:
        for r in requests:
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            engine.add_request(r["prompt_token_ids"], params, r["id"] + tag)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return tokens / (time.perf_counter() - start)

    run("-warmup")
    return {"prompt_tokens": tokens, "prompt_tokens_per_s": round(run("-timed"), 1)}


def in_process(tree: Path, args: argparse.Namespace) -> dict:
    """The measurement in a fresh process importing pagedllm from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, str(Path(__file__).resolve()), "--one", "--model", args.model]
    command += ["--weights", args.weights, "--workload", str(Path(args.workload).resolve())]
    result = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the run in {tree} failed:\n{result.stderr[-2000:]}")
    figure = json.loads(result.stdout.strip().splitlines()[-1])
    if not figure["pagedllm"].startswith(str(tree.resolve())):
        raise SystemExit(f"the run in {tree} imported pagedllm from {figure['pagedllm']}")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--workload", default="benchmarks/workloads/sharegpt-like-160.jsonl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", default=None, help="another pagedllm checkout to alternate with")
    parser.add_argument("--output", default="bench-results/prompt-throughput.json")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import pagedllm

        figure = measure(args.model, args.weights, args.workload)
        print(json.dumps({**figure, "pagedllm": str(Path(pagedllm.__file__).resolve().parent)}))
        return

    from pagedllm.benchmarking.compare import machine, paired_ratio, spread

    trees = {"this": HERE} | ({"against": Path(args.against).resolve()} if args.against else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for round_no in range(args.repeats):
        order = list(trees.items()) if round_no % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            runs[name].append(in_process(tree, args))
            print(f"round {round_no + 1}/{args.repeats}: {name} {runs[name][-1]['prompt_tokens_per_s']} prompt tok/s")
    report: dict = {"model": args.model, "weights": args.weights, "workload": args.workload, "machine": machine()}
    report["trees"] = {name: str(tree) for name, tree in trees.items()}
    report["prompt_tokens_per_s"] = {
        name: spread([run["prompt_tokens_per_s"] for run in values]) for name, values in runs.items()
    }
    if args.against:
        report["this_over_against"] = paired_ratio(runs["this"], runs["against"], "prompt_tokens_per_s")
    report["runs"] = runs
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
