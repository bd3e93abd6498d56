"""How soon `pagedllm serve` answers, and what it holds: seconds from the command to the first
200 from /health, the server's resident memory then and `--settle` seconds later (once the KV
cache's background commit is done), and the answer to the quick start's question, over
`--runs` starts with warm caches (the C++ kernels and the tokenizer already built).

    python benchmarks/warm_start.py                      # the installed `pagedllm`
    python benchmarks/warm_start.py -- --kv-cache-memory 512MiB   # flags after -- go to serve
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import httpx

from pagedllm.testing.servers import free_port

QUESTION = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 32,
    "temperature": 0,
}


def resident_gib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 2**20


def one_start(serve_args: list[str], settle: float) -> dict:
    port = free_port()
    start = time.monotonic()
    command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), *serve_args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode} before answering")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.monotonic() - start
        at_ready = resident_gib(process.pid)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=QUESTION, timeout=120).json()
        time.sleep(settle)
        return {
            "ready_s": ready,
            "rss_at_ready_gib": at_ready,
            "rss_settled_gib": resident_gib(process.pid),
            "answer": reply["choices"][0]["message"]["content"],
        }
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settle", type=float, default=15.0, help="seconds to wait before the second reading")
    parser.add_argument("serve_args", nargs="*", help="flags for pagedllm serve (after --)")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        run = one_start(args.serve_args, args.settle)
        runs.append(run)
        print(
            f"run {i}: ready in {run['ready_s']:.2f} s, resident {run['rss_at_ready_gib']:.2f} GiB, "
            f"{run['rss_settled_gib']:.2f} GiB {args.settle:g} s later; answer {run['answer']!r}",
            flush=True,
        )
    ready = [run["ready_s"] for run in runs]
    print(f"ready: median {statistics.median(ready):.2f} s (min {min(ready):.2f}, max {max(ready):.2f})")


if __name__ == "__main__":
    main()
