"""What structured outputs cost: the same requests constrained by a JSON schema and not, side by side.

    python benchmarks/structured_output.py --output docs/results/structured-output.json

1. Constrained: 32 chat requests at once, each with a JSON schema (an object with a
   string, an integer, an enum and an array of up to 6 objects), temperature 0.8,
   seeded.  Every reply is checked against the schema.
2. Unconstrained: the same prompts and seeds, each with max_tokens set to the token
   count its constrained run produced and EOS ignored, so both runs generate exactly
   the same number of tokens per request.
It reports output tok/s of both and their ratio, and the time spent filling and
applying grammar masks (measured around the call, over the whole run).  A third part
times the two grammar engines on PyPI on one step's masks for 32 rows of that schema
(llguidance, which pagedllm uses, and xgrammar when installed: one matcher at a time,
and through its BatchGrammarMatcher).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarking.throughput import print_result
from pagedllm.core.sampling_params import StructuredOutput
from pagedllm.layers.cpu_kernels import cpu_summary

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
        "projects": {
            "type": "array",
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {"title": {"type": "string", "maxLength": 30}, "year": {"type": "integer"}},
                "required": ["title", "year"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "role", "projects"],
    "additionalProperties": False,
}
TOPICS = ["a scientist", "a chef", "a pilot", "a painter", "a gardener", "a poet", "a sailor", "a judge"]


class MaskTimer:
    """Wraps the engine's grammar masks to add up the time they take."""

    def __init__(self, structured) -> None:
        self.seconds, self.calls, self.rows = 0.0, 0, 0
        original = structured.apply_masks

        def timed(logits, sequence_ids):
            start = time.perf_counter()
            result = original(logits, sequence_ids)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self.rows += sum(sid in structured.matchers for sid in sequence_ids)
            return result

        structured.apply_masks = timed


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return outputs, time.perf_counter() - start


def engine_masks(llm: LLM, rows: int) -> dict:
    """One step's masks for `rows` fresh matchers of SCHEMA, per grammar engine (median of 20)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    vocab = llm.engine.model_config.vocab_size
    hf = llm.engine.tokenizer.hf
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(rows)]
    logits = torch.randn(rows, vocab)
    bitmask = llt.allocate_token_bitmask(rows, vocab)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            llt.fill_next_token_bitmask(m, bitmask, i)
        llt.apply_token_bitmask_inplace(logits, bitmask)
        times.append(time.perf_counter() - start)
    result = {"llguidance_ms": round(1000 * sorted(times)[10], 3)}
    try:
        import xgrammar as xgr
    except ImportError:
        return result
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    xmatchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    xmask = xgr.allocate_token_bitmask(rows, vocab)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        for i, m in enumerate(xmatchers):
            m.fill_next_token_bitmask(xmask, i)
        xgr.apply_token_bitmask_inplace(logits, xmask)
        times.append(time.perf_counter() - start)
    result["xgrammar_ms"] = round(1000 * sorted(times)[10], 3)
    batch = xgr.BatchGrammarMatcher()  # xgrammar's batched path (its own threads), as its docs recommend
    times = []
    for _ in range(20):
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(xmatchers, xmask)
        xgr.apply_token_bitmask_inplace(logits, xmask)
        times.append(time.perf_counter() - start)
    result["xgrammar_batched_ms"] = round(1000 * sorted(times)[10], 3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", default="bench-results/structured-output.json")
    args = parser.parse_args()
    import jsonschema

    llm = LLM(dtype=args.dtype, kv_cache_memory="1GiB")
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}])
        for i in range(args.requests)
    ]
    constrained = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=256, structured_output=StructuredOutput(json_schema=SCHEMA))
        for i in range(args.requests)
    ]
    llm.generate(prompts[:2], constrained[:2])  # warm: kernels, the grammar tokenizer
    timer = MaskTimer(llm.engine.runner.structured)
    outputs, constrained_s = run(llm, prompts, constrained)
    valid = 0
    for output in outputs:
        try:
            jsonschema.validate(json.loads(output.text), SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    lengths = [len(o.token_ids) for o in outputs]
    plain = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    plain_outputs, plain_s = run(llm, prompts, plain)
    assert [len(o.token_ids) for o in plain_outputs] == lengths
    tokens = sum(lengths)
    result = {
        "cpu": cpu_summary(),
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "requests": args.requests,
        "output_tokens": tokens,
        "valid_replies": valid,
        "finished_stop": sum(o.finish_reason == "stop" for o in outputs),
        "constrained_output_tokens_per_s": round(tokens / constrained_s, 2),
        "unconstrained_output_tokens_per_s": round(tokens / plain_s, 2),
        "constrained_over_unconstrained": round(plain_s / constrained_s, 3),
        "mask_seconds": round(timer.seconds, 3),
        "mask_share_of_constrained_run": round(timer.seconds / constrained_s, 4),
        "mask_calls": timer.calls,
        "mask_ms_per_constrained_row": round(1000 * timer.seconds / max(timer.rows, 1), 4),
        "one_step_masks_32_rows": engine_masks(llm, 32),
    }
    print_result(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
