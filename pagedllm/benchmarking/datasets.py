"""Benchmark requests: JSONL workload files, and synthetic datasets drawn from a seed.

A request is a dict `{"id", "prompt_token_ids", "max_tokens"}` (optionally `n`,
`temperature`, `seed`), the same shape as a line of a workload file.  Prompts
are random token ids: what a benchmark of the engine needs is their lengths,
not their meaning.  Ids are drawn from `[first_id, vocab_size)`, skipping the
first ids of the vocabulary, where tokenizers keep their special tokens.

Datasets (every length drawn independently per request):

- `random`: prompt length uniform in `input_len × [1 - r, 1 + r]`, output length
  uniform in `output_len × [1 - r, 1 + r]`, `r` = `range_ratio` (0: fixed lengths).
- `shared-prefix`: each prompt is one of `num_prefixes` shared prefixes of
  `prefix_len` tokens, then a unique tail drawn like `random`'s prompt; output
  like `random`'s.  This is what prefix caching is for.
- `sharegpt-like`: log-normal lengths with a heavy tail, as in conversations
  collected from chat users (ShareGPT): prompt and output lengths with means
  `input_len` and `output_len` before clipping, spread sigma 1.0 and 0.8, clipped to
  [4, 4 × mean].
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "shared-prefix", "sharegpt-like")


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 384
    num_prefixes: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        for field in ("num_prompts", "input_len", "output_len", "prefix_len", "num_prefixes"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be at least 1, got {getattr(self, field)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")

    def describe(self) -> str:
        extra = (
            f", prefix_len={self.prefix_len}, num_prefixes={self.num_prefixes}" if self.name == "shared-prefix" else ""
        )
        return (
            f"{self.name}(num_prompts={self.num_prompts}, input_len={self.input_len}, output_len={self.output_len}, "
            f"range_ratio={self.range_ratio}{extra}, seed={self.seed})"
        )


def generate_dataset(spec: DatasetSpec, vocab_size: int) -> list[dict]:
    rng = random.Random(spec.seed)
    first_id = min(1000, vocab_size // 10)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(first_id, vocab_size) for _ in range(n)]

    def uniform(mean: int) -> int:
        low, high = round(mean * (1 - spec.range_ratio)), round(mean * (1 + spec.range_ratio))
        return max(1, rng.randint(low, high))

    def lognormal(mean: int, sigma: float) -> int:
        mu = math.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
        return int(min(max(rng.lognormvariate(mu, sigma), 4), 4 * mean))

    prefixes = [tokens(spec.prefix_len) for _ in range(spec.num_prefixes)] if spec.name == "shared-prefix" else []
    requests = []
    for i in range(spec.num_prompts):
        if spec.name == "random":
            prompt, output = tokens(uniform(spec.input_len)), uniform(spec.output_len)
        elif spec.name == "shared-prefix":
            prompt, output = rng.choice(prefixes) + tokens(uniform(spec.input_len)), uniform(spec.output_len)
        else:
            prompt, output = tokens(lognormal(spec.input_len, 1.0)), lognormal(spec.output_len, 0.8)
        requests.append({"id": f"{spec.name}-{i}", "prompt_token_ids": prompt, "max_tokens": output})
    return requests


def load_workload(path: str | Path, num_requests: int | None = None) -> list[dict]:
    """A JSONL workload: one request per line, `{"id", "prompt_token_ids", "max_tokens"}` and
    optionally `n` (samples), `temperature` (default 0, greedy) and `seed`."""
    requests = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                requests.append(
                    {
                        "id": str(item["id"]),
                        "prompt_token_ids": list(item["prompt_token_ids"]),
                        "max_tokens": int(item["max_tokens"]),
                        "n": int(item.get("n", 1)),
                        "temperature": float(item.get("temperature", 0.0)),
                        "seed": None if item.get("seed") is None else int(item["seed"]),
                    }
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{line_no}: not a workload line ({error})") from None
    if num_requests is not None:
        if num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {num_requests}")
        requests = requests[:num_requests]
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def save_workload(requests: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for item in requests:
            f.write(json.dumps(item) + "\n")


def summarize(requests: list[dict]) -> dict:
    prompt = [len(r["prompt_token_ids"]) for r in requests]
    output = [r["max_tokens"] for r in requests]
    return {
        "requests": len(requests),
        "prompt_tokens": sum(prompt),
        "output_tokens": sum(output),
        "prompt_len_min_max": [min(prompt), max(prompt)],
        "output_len_min_max": [min(output), max(output)],
    }
