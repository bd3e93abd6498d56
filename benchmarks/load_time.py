"""How long a model takes to load: the engine built from the file (`LLM(model)`: header, checks,
weights, tokenizer, KV cache), timed in a fresh process after the imports, for one or more
checkouts of pagedllm alternated run by run (e.g. this one and an older one, to see what the
model-file checks cost).

    git worktree add bench-results/before <commit>
    python benchmarks/load_time.py --checkout . --checkout bench-results/before --model smollm2 gemma3-270m --repeats 5

Prints per checkout and model the median load time with its min and max, and the ratio of each
checkout's median to the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, sys, time
from pagedllm import LLM
from pagedllm.models.loader import resolve_model_path
path = resolve_model_path(sys.argv[1])
start = time.perf_counter()
llm = LLM(sys.argv[1], kv_cache_memory="256MiB")
print(json.dumps({"load_s": time.perf_counter() - start}))
"""


def load_once(checkout: Path, model: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "PAGEDLLM_COMMIT_KV_CACHE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, model], capture_output=True, text=True, env=env, cwd=checkout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{checkout} failed to load {model}:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["load_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", type=Path, required=True, help="a pagedllm checkout (repeat)")
    parser.add_argument("--model", nargs="+", default=["smollm2"], help="bundled names or paths")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from pagedllm.layers.cpu_kernels import cpu_summary

    print(f"CPU: {cpu_summary()}")
    for model in args.model:
        for checkout in args.checkout:  # warm: kernel builds and the tokenizer cache
            load_once(checkout, model)
        times: dict[Path, list[float]] = {c: [] for c in args.checkout}
        for _ in range(args.repeats):
            for checkout in args.checkout:
                times[checkout].append(load_once(checkout, model))
        first = statistics.median(times[args.checkout[0]])
        for checkout, runs in times.items():
            median = statistics.median(runs)
            print(
                f"{model} {checkout}: load {median:.3f} s (min {min(runs):.3f}, max {max(runs):.3f}, "
                f"{len(runs)} runs), {median / first:.3f}x the first checkout"
            )


if __name__ == "__main__":
    main()
