"""Speculative decoding on and off, side by side: tokens/s, acceptance and accepted length.

    python benchmarks/speculative.py --repeats 3 --output docs/results/speculative.json

Workloads:

- `grounded` (input-grounded): a chat request asks to summarize, extract from, rewrite or
  quote a ~1,000-token passage of this repository's documentation (docs/*.md), EOS
  respected.  `--dataset FILE` replaces the passages with your own: JSONL lines with
  `"messages"` (a chat) or `"prompt"` (text), and optionally `"max_tokens"`.
- `random`, `sharegpt-like`: the repository's workload files (benchmarks/workloads/), random
  token ids, EOS ignored, as every other benchmark runs them.

For each workload, batch size (`--batch`: 1 runs `--single-requests` requests one after
another, alone; B > 1 submits B requests at once and checks that all B ran together) and
temperature (greedy, and 0.8 with a seed per request, so every setting draws the same tokens:
seeded draws depend on the token's index only), every setting (off, a control that is off
again, then each `--methods`) runs the same requests on one engine, whose drafter is swapped;
settings alternate within each repeat, in a rotating order.  The control's ratio to off is
what the machine's noise alone makes of a ratio: read the on/off ratios against it.  Each case
starts with one uncounted run, so that no setting pays for the first use of its shapes.  Reported
per case: output tokens/s over the wall time, decode tokens/s (a request's tokens after its
first over the time since its first, summed over requests), each as median (min-max) over
the repeats; the ratio on/off taken within each repeat, median (min-max); acceptance rate,
mean accepted length and draft tokens per step; and whether every request's tokens equal
the off engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from pagedllm.benchmarking.datasets import load_workload
from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.speculation import Speculation
from pagedllm.engine import LLMEngine
from pagedllm.layers.cpu_kernels import cpu_summary

ROOT = Path(__file__).resolve().parent.parent
INSTRUCTIONS = [
    "Summarize the following text in a few sentences.",
    "Extract every command, flag and number from the following text, one per line.",
    "Rewrite the following text in simpler words, keeping every fact.",
    "Quote the sentences of the following text that describe how it was measured.",
]
WORKLOAD_FILES = {"random": "random-128.jsonl", "sharegpt-like": "sharegpt-like-160.jsonl"}


def passages(tokenizer, num: int, length: int) -> list[str]:
    """`num` passages of about `length` tokens: paragraphs of docs/*.md, in file order."""
    out, current = [], []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for paragraph in path.read_text().split("\n\n"):
            current.append(paragraph)
            if len(tokenizer.encode("\n\n".join(current))) >= length:
                out.append("\n\n".join(current))
                current = []
                if len(out) == num:
                    return out
    if not out:
        raise ValueError("docs/*.md hold no passage")
    return out


def grounded_requests(tokenizer, num: int, max_tokens: int, dataset: str | None) -> list[dict]:
    if dataset:
        items = [json.loads(line) for line in Path(dataset).read_text().splitlines() if line.strip()]
        if not items:
            raise ValueError(f"{dataset} holds no request")
        chats = []
        for i, item in enumerate(items[:num]):
            if "messages" in item:
                ids = tokenizer.apply_chat_template(item["messages"])
            elif "prompt" in item:
                ids = tokenizer.encode(item["prompt"])
            else:
                raise ValueError(f"{dataset}:{i + 1}: a line needs 'messages' or 'prompt'")
            chats.append(
                {"id": f"grounded-{i}", "prompt_token_ids": ids, "max_tokens": item.get("max_tokens", max_tokens)}
            )
        return chats
    texts = passages(tokenizer, num, 1000)
    return [
        {
            "id": f"grounded-{i}",
            "prompt_token_ids": tokenizer.apply_chat_template(
                [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)] + "\n\n" + texts[i % len(texts)]}]
            ),
            "max_tokens": max_tokens,
        }
        for i in range(num)
    ]


def run(engine: LLMEngine, requests: list[dict], temperature: float, ignore_eos: bool, together: bool) -> dict:
    """Output tokens, wall time and decode time of `requests` (together, or one at a time)."""
    before = engine.begin_run()
    groups = [requests] if together else [[r] for r in requests]
    tokens: dict[str, list[int]] = {}
    wall = decode_time = 0.0
    decode_tokens = peak = 0
    for group in groups:
        start = time.perf_counter()
        first: dict[str, float] = {}
        for item in group:
            params = SamplingParams(
                temperature=temperature,
                seed=None if temperature == 0 else int(item["id"].rsplit("-", 1)[1]),
                max_tokens=item["max_tokens"],
                ignore_eos=ignore_eos,
            )
            engine.add_request(item["prompt_token_ids"], params, request_id=item["id"])
        while engine.has_unfinished_requests():
            peak = max(peak, len(engine.scheduler.running))
            for output in engine.step():
                now = time.perf_counter()
                count = output.outputs[0].num_tokens
                if count and output.request_id not in first:
                    first[output.request_id] = now
                if output.finished:
                    tokens[output.request_id] = list(output.outputs[0].token_ids)
                    decode_tokens += max(count - 1, 0)
                    decode_time += now - first.get(output.request_id, now)
        wall += time.perf_counter() - start
    output_tokens = sum(len(t) for t in tokens.values())
    return {
        "tokens": tokens,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "output_tok_s": output_tokens / wall,
        "decode_tok_s": decode_tokens / decode_time if decode_time else 0.0,
        "peak_running": peak,
        "speculation": engine.run_report(before)["speculation"],
    }


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workloads", nargs="+", default=["grounded", "random", "sharegpt-like"])
    parser.add_argument("--dataset", default=None, help="JSONL of grounded requests (see above)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix"])
    parser.add_argument("--single-requests", type=int, default=3, help="requests run one by one for batch 1")
    parser.add_argument("--max-tokens", type=int, default=192, help="grounded: the most tokens per reply")
    parser.add_argument("--random-max-tokens", type=int, default=128, help="random and sharegpt-like: output cap")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--no-control", dest="control", action="store_false", help="skip the second off run (the noise floor)"
    )
    args = parser.parse_args()

    # One engine for every setting, its drafter swapped per run (a fresh one each time, so the suffix
    # drafter's memory of earlier outputs never includes an earlier repeat's), so that every setting
    # runs on the same weights and KV cache memory.
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        speculative=args.methods[0],
        num_speculative_tokens=args.num_speculative_tokens,
    )
    engine = LLMEngine(config)
    cost = engine.speculation.cost
    # "control" is off again: its ratio to off is the noise floor of the on/off ratios beside it.
    names = ["off", *(["control"] if args.control else []), *args.methods]

    def use(name: str) -> LLMEngine:
        off = name in ("off", "control")
        spec = None if off else Speculation.build(name, args.num_speculative_tokens, cost)
        engine.speculation = engine.scheduler.speculation = spec
        engine.config.speculative = "off" if off else name
        engine.reset_prefix_cache()  # every run computes its prompts, as the first one did
        return engine

    tokenizer = engine.tokenizer
    result = {
        "cpu": cpu_summary(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "step_cost": dataclasses.asdict(cost),
        "draft_row_limits": list(engine.scheduler.draft_row_limits),
        "num_speculative_tokens": args.num_speculative_tokens,
        "repeats": args.repeats,
        "cases": [],
    }
    print(
        f"# {result['cpu']}, {result['dtype']}, step cost {result['step_cost']}, "
        f"draft row limits {result['draft_row_limits']}",
        flush=True,
    )
    for workload in args.workloads:
        most = max(max(args.batch), args.single_requests)
        if workload == "grounded":
            pool, ignore_eos = grounded_requests(tokenizer, most, args.max_tokens, args.dataset), False
        else:
            pool = load_workload(ROOT / "benchmarks" / "workloads" / WORKLOAD_FILES[workload], most)
            pool = [dict(r, max_tokens=min(r["max_tokens"], args.random_max_tokens)) for r in pool]
            ignore_eos = True
        for batch in args.batch:
            requests = pool[: args.single_requests] if batch == 1 else pool[:batch]
            for temperature in args.temperatures:
                runs: dict[str, list[dict]] = {n: [] for n in names}
                run(use("off"), requests, temperature, ignore_eos, together=batch > 1)  # warm-up, not counted
                for repeat in range(args.repeats):
                    for k in range(len(names)):
                        name = names[(repeat + k) % len(names)]
                        r = run(use(name), requests, temperature, ignore_eos, together=batch > 1)
                        if batch > 1 and r["peak_running"] != batch:
                            raise SystemExit(f"{name}: {r['peak_running']} requests ran together, not {batch}")
                        runs[name].append(r)
                case = {
                    "workload": workload,
                    "batch": batch,
                    "temperature": temperature,
                    "requests": len(requests),
                    "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
                }
                for name in names:
                    rs = runs[name]
                    entry = {
                        "output_tokens": rs[0]["output_tokens"],
                        "output_tok_s": summary([r["output_tok_s"] for r in rs]),
                        "decode_tok_s": summary([r["decode_tok_s"] for r in rs]),
                    }
                    if name != "off":
                        off = runs["off"]
                        entry["output_ratio"] = summary(
                            [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(rs, off)]
                        )
                        entry["decode_ratio"] = summary(
                            [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(rs, off)]
                        )
                        entry["identical_requests"] = sum(
                            rs[0]["tokens"][i] == off[0]["tokens"][i] for i in off[0]["tokens"]
                        )
                        if name != "control":
                            entry["speculation"] = rs[-1]["speculation"]
                    case[name] = entry
                result["cases"].append(case)
                off_median = case["off"]["output_tok_s"]["median"]
                line = f"{workload:14s} batch {batch:3d} T={temperature:.1f}: off {off_median:8.1f} tok/s"
                for name in names[1:]:
                    e = case[name]
                    ratio, decode = e["output_ratio"], e["decode_ratio"]
                    if name == "control":
                        line += f" | control x{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
                        continue
                    spec = e["speculation"]
                    line += (
                        f" | {name} x{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"
                        f" decode x{decode['median']:.2f} acc {spec['acceptance_rate']:.2f}"
                        f" len {spec['mean_accepted_length']:.2f} same {e['identical_requests']}/{len(requests)}"
                    )
                print(line, flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
