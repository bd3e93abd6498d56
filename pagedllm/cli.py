"""The `pagedllm` command: generate, chat, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from pagedllm.config import EngineConfig


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with each option's default added where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # on/off flags say it
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def add_engine_args(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    """Engine flags; with `sweep`, --block-size takes a comma-separated list (bench)."""
    defaults = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a bundled model (smollm2, gemma3-270m), a GGUF file or a Hugging Face checkpoint directory "
        "(default: smollm2)",
    )
    g.add_argument(
        "--dtype",
        default=defaults["dtype"].default,
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 where the CPU has native bf16 math (AVX512-BF16, AMX), else float32",
    )
    if sweep:
        g.add_argument("--block-size", default=str(defaults["block_size"].default), help="one size or a list: 8,16,32")
    else:
        g.add_argument("--block-size", type=int, default=defaults["block_size"].default, help="tokens per KV block")
    g.add_argument(
        "--kv-layout",
        default=defaults["kv_layout"].default,
        choices=["paged", "contiguous"],
        help="contiguous: the per-request reservation baseline (docs/paging.md)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=defaults["enable_prefix_caching"].default,
        help="reuse the KV of earlier prompts' full blocks (the default)",
    )
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help="turn it off")
    g.add_argument(
        "--reserve",
        default=defaults["reserve"].default,
        choices=["max-model-len", "request"],
        help="contiguous layout: reserve max-model-len slots per request, or prompt + max_tokens",
    )
    g.add_argument("--kv-cache-memory", default=defaults["kv_cache_memory"].default, help="e.g. 2GiB")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults["max_num_batched_tokens"].default,
        help="token budget of one step (prefill chunks + decodes)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=defaults["max_num_seqs"].default, help="most requests running at once"
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's, lowered to what the KV cache holds if smaller)",
    )
    g.add_argument(
        "--attention",
        default=defaults["attention"].default,
        choices=["auto", "cpp", "torch", "triton", "reference"],
        help="attention kernels; auto: triton on CUDA, else the C++ kernels where they build",
    )
    g.add_argument(
        "--linear",
        default=defaults["linear"].default,
        choices=["auto", "onednn", "torch"],
        help="GEMM backend of the projections: oneDNN with packed weights where it runs (auto), or F.linear",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks to split the model over (docs/parallel.md); spawns N-1 workers unless --distributed-init-method",
    )
    g.add_argument(
        "--distributed-init-method",
        default=None,
        help="join ranks started by a launcher: env:// (torchrun) or tcp://HOST:PORT",
    )
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="threads per rank (default: one per core that other processes leave free, measured every second)",
    )
    g.add_argument(
        "--no-adaptive-threads",
        dest="adaptive_threads",
        action="store_false",
        help="keep one thread per core even when other processes take cores",
    )
    g.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to P")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below P x the top probability (0: off)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output so far (-2 to 2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, per repeat in the output (-2 to 2)")
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="transformers' rule over prompt and output (1: off)"
    )
    g.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="TOKEN_ID=VALUE",
        help="add VALUE (-100 to 100) to a token's logit (repeatable)",
    )
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens")
    g.add_argument("--bad-word", action="append", default=[], help="a word never to generate (repeatable)")
    s = parser.add_argument_group("structured output (one of)")
    s.add_argument("--json-schema", default=None, help="the reply follows this JSON schema: a file, or the JSON itself")
    s.add_argument("--json-object", action="store_true", help="the reply is a JSON object")
    s.add_argument("--regex", default=None, help="the reply matches this regular expression")
    s.add_argument("--choice", action="append", default=None, help="the reply is one of these strings (repeatable)")
    s.add_argument("--grammar", default=None, help="the reply follows this grammar (Lark or GBNF): a file, or the text")


def engine_config(args: argparse.Namespace, block_size: int | None = None) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=block_size if block_size is not None else args.block_size,
        kv_layout=args.kv_layout,
        enable_prefix_caching=args.enable_prefix_caching,
        reserve=args.reserve,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        attention=args.attention,
        linear=args.linear,
        num_threads=args.num_threads,
        adaptive_threads=args.adaptive_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method,
    )


def sampling_params(args: argparse.Namespace):
    from pagedllm.core.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=parse_logit_bias(args.logit_bias),
        min_tokens=args.min_tokens,
        bad_words=args.bad_word,
        structured_output=structured_output(args),
    )


def structured_output(args: argparse.Namespace):
    """The --json-schema / --json-object / --regex / --choice / --grammar constraint, if any."""
    from pathlib import Path

    from pagedllm.core.sampling_params import StructuredOutput

    def text_or_file(value: str) -> str:
        path = Path(value)
        return path.read_text() if len(value) < 4096 and path.is_file() else value

    given = {
        "json_schema": text_or_file(args.json_schema) if args.json_schema else None,
        "json_object": args.json_object,
        "regex": args.regex,
        "choice": tuple(args.choice) if args.choice else None,
        "grammar": text_or_file(args.grammar) if args.grammar else None,
    }
    if not any(given.values()):
        return None
    return StructuredOutput(**given)


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """['42=-100', '7=5'] -> {42: -100.0, 7: 5.0}."""
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN_ID=VALUE, e.g. 42=-100; got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias takes TOKEN_ID=VALUE, e.g. 42=-100; got {item!r}")
    return bias


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.engine import LLMEngine

    if not args.prompt.strip():
        raise ValueError('the prompt is empty: pass the text to answer, e.g. pagedllm generate "Hello"')
    params = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    if args.raw:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    else:
        prompt_ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    check_max_tokens(len(prompt_ids), args.max_tokens, engine.max_model_len)
    engine.add_request(prompt_ids, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.delta, end="", flush=True)
            final = output
    print()
    if final is not None:
        print(f"[{len(final.token_ids)} tokens, finish reason: {final.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    import dataclasses

    from pagedllm.engine import LLMEngine

    params = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    if args.max_tokens >= engine.max_model_len:
        raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in {engine.max_model_len} tokens")
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("pagedllm chat: type a message; Ctrl-C stops a reply; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt_ids = engine.tokenizer.apply_chat_template(messages)
        room = engine.max_model_len - len(prompt_ids)
        if room < 1:
            print(
                f"[the conversation fills the {engine.max_model_len}-token context: start a new chat]", file=sys.stderr
            )
            break
        request_id = engine.add_request(prompt_ids, dataclasses.replace(params, max_tokens=min(args.max_tokens, room)))
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    print(output.delta, end="", flush=True)
                    reply = output.text
        except KeyboardInterrupt:  # stop this reply, keep the conversation
            engine.abort_request(request_id)
            print("\n[stopped]", end="", file=sys.stderr)
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


def check_max_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """The CLI refuses what the server refuses: a prompt plus max_tokens over the context length."""
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"--max-tokens {max_tokens} plus the prompt's {prompt_len} tokens is more than the maximum model length "
            f"of {max_model_len} tokens; pass --max-tokens {max(max_model_len - prompt_len, 1)} or less"
        )


def add_request_args(parser: argparse.ArgumentParser) -> None:
    """Where a benchmark's requests come from: a JSONL workload file or a synthetic dataset."""
    from pagedllm.benchmarking.datasets import DATASETS, DatasetSpec

    defaults = DatasetSpec.__dataclass_fields__
    g = parser.add_argument_group("requests (one of --workload or --dataset)")
    g.add_argument(
        "--workload",
        default=None,
        help='JSONL file, one request per line: {"id", "prompt_token_ids", "max_tokens"} (docs/benchmarks.md)',
    )
    g.add_argument("--dataset", default=None, choices=DATASETS, help="draw synthetic requests (docs/benchmarks.md)")
    g.add_argument(
        "--num-prompts",
        "--num-requests",
        dest="num_prompts",
        type=int,
        default=None,
        help="requests to draw (dataset; default 100), or the first N of a workload",
    )
    g.add_argument("--input-len", type=int, default=defaults["input_len"].default, help="dataset: prompt length")
    g.add_argument("--output-len", type=int, default=defaults["output_len"].default, help="dataset: output length")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=defaults["range_ratio"].default,
        help="dataset random/shared-prefix: lengths uniform in len x [1-r, 1+r]",
    )
    g.add_argument("--prefix-len", type=int, default=defaults["prefix_len"].default, help="dataset shared-prefix")
    g.add_argument("--num-prefixes", type=int, default=defaults["num_prefixes"].default, help="dataset shared-prefix")
    g.add_argument("--seed", type=int, default=0, help="seeds the dataset (and bench serve's arrival times)")
    g.add_argument("--save-workload", default=None, help="also write the requests as a JSONL workload file")


def bench_requests(args: argparse.Namespace, vocab_size: Callable[[], int]) -> tuple[list[dict], str]:
    """The requests the flags name, and a name for them; `vocab_size` is asked only for a dataset."""
    from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset, load_workload, save_workload

    if (args.workload is None) == (args.dataset is None):
        raise ValueError("pass either --workload FILE or --dataset random|shared-prefix|sharegpt-like")
    if args.workload is not None:
        requests, name = load_workload(args.workload, args.num_prompts), str(args.workload)
    else:
        spec = DatasetSpec(
            name=args.dataset,
            num_prompts=100 if args.num_prompts is None else args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            prefix_len=args.prefix_len,
            num_prefixes=args.num_prefixes,
            seed=args.seed,
        )
        requests, name = generate_dataset(spec, vocab_size()), spec.describe()
    if args.save_workload:
        save_workload(requests, args.save_workload)
    return requests, name


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedllm.benchmarking.report import run_compare
    from pagedllm.benchmarking.settings import parse_list, parse_on_off, settings_grid
    from pagedllm.benchmarking.throughput import print_result, run_bench
    from pagedllm.models.loader import read_model_config, resolve_model_path

    block_sizes = parse_list(args.block_size, int)
    layouts = parse_list(args.compare) if args.compare else [args.kv_layout]
    base = engine_config(args, block_size=block_sizes[0])
    requests, workload_name = bench_requests(args, lambda: read_model_config(resolve_model_path(args.model)).vocab_size)
    caching = parse_on_off(args.prefix_caching) if args.prefix_caching else [args.enable_prefix_caching]
    settings = settings_grid(layouts, block_sizes, caching)
    if len(settings) > 1 or args.report_dir:
        result = run_compare(
            base,
            settings,
            requests,
            args.report_dir or "bench-report",
            ignore_eos=not args.respect_eos,
            workload_name=workload_name,
        )
        print(f"report written to {args.report_dir or 'bench-report'}/", file=sys.stderr)
    else:
        result = {"workload": workload_name, **run_bench(base, requests, ignore_eos=not args.respect_eos)}
    print_result(result, args.output)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from pagedllm.benchmarking.serve import parse_goodput, replay, server_vocab_size, wait_until_ready
    from pagedllm.benchmarking.throughput import print_result

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    slos = parse_goodput(args.goodput)
    url = args.url.rstrip("/")
    wait_until_ready(url, args.api_key, args.ready_timeout)
    requests, workload_name = bench_requests(args, lambda: server_vocab_size(url, args.api_key))
    if any(r.get("n", 1) != 1 or r.get("temperature", 0.0) != 0.0 for r in requests):
        raise ValueError("bench serve replays greedy single-sample requests (no n or temperature in the workload)")
    result = asyncio.run(
        replay(url, requests, args.request_rate, args.seed, args.served_model, args.max_concurrency, slos, args.api_key)
    )
    print_result({"workload": workload_name, "url": url, **result}, args.output)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from pagedllm.config import parse_bytes
    from pagedllm.engine import LLMEngine
    from pagedllm.models.loader import resolve_model_path
    from pagedllm.serving.api_server import ServerSettings, build_app
    from pagedllm.serving.async_engine import AsyncLLMEngine
    from pagedllm.text.tokenizer import Tokenizer

    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            raise ValueError(f"two models given: {args.model_positional!r} and --model {args.model!r}; pass one")
        args.model = args.model_positional
    config = engine_config(args)
    settings = ServerSettings(
        served_model_name=args.served_model_name or served_model_name(config.model),
        api_key=args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None,
        max_body_bytes=parse_bytes(args.max_body_size),
    )
    engine = AsyncLLMEngine(LLMEngine(config), args.max_waiting)
    app = build_app(engine, Tokenizer(resolve_model_path(config.model)), settings)
    logging.getLogger("pagedllm").info(
        "serving %r on http://%s:%d/v1 (dashboard: /dashboard, metrics: /metrics)%s",
        settings.served_model_name,
        args.host,
        args.port,
        "; API key required" if settings.api_key else "",
    )
    log_level = args.log_level.lower()
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level, access_log=args.access_log)
    )
    workers = engine.engine.workers
    if workers is not None:  # a dead tensor-parallel rank ends the server rather than leaving it half alive
        workers.on_failure.append(lambda error: setattr(server, "should_exit", True))
    server.run()
    if workers is not None and workers.failure is not None:
        print(f"pagedllm: error: {workers.failure}", file=sys.stderr)
        return 1
    return 0


def served_model_name(model: str | None) -> str:
    """The name clients pass as `model`: the bundled model's name, else the file's or folder's name."""
    from pathlib import Path

    from pagedllm.models.loader import BUNDLED_MODELS, DEFAULT_MODEL

    if model is None or model in BUNDLED_MODELS:
        return BUNDLED_MODELS[model or DEFAULT_MODEL].name
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def build_parser() -> argparse.ArgumentParser:
    from pagedllm import __version__

    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference with a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, dashboard)",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as --model (either spelling)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or PAGEDLLM_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    p.add_argument("--max-waiting", type=int, default=1024, help="queue bound: more waiting requests get a 429")
    p.add_argument("--max-body-size", default="4MiB", help="larger request bodies get a 413")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "generate", help="answer one prompt (chat template applied unless --raw)", formatter_class=HelpFormatter
    )
    p.add_argument("prompt", help="the text to answer")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat, streaming tokens as they come", formatter_class=HelpFormatter)
    p.add_argument("--system", default=None, help="system message")
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "bench",
        help="offline throughput on a workload or dataset (all requests at once); 'bench serve': online latency",
        formatter_class=HelpFormatter,
        description="Offline throughput: submit every request at once, run to completion, print a JSON summary. "
        "'pagedllm bench serve --url URL' measures a running server instead.",
    )
    add_request_args(p)
    p.add_argument("--output", default=None, help="also write the JSON result here")
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: ignore it)")
    p.add_argument(
        "--compare",
        default=None,
        help="KV layouts to run one after another, e.g. paged,contiguous (combined with every --block-size)",
    )
    p.add_argument(
        "--prefix-caching",
        default=None,
        help="on, off, or on,off to run both (combined with --compare and --block-size)",
    )
    p.add_argument(
        "--report-dir",
        default=None,
        help="folder for summary.json, per-step series and plots (default bench-report when several settings run)",
    )
    bench_modes = p.add_subparsers(dest="bench_mode", metavar="{serve}")
    q = bench_modes.add_parser(
        "serve",
        help="online latency and throughput against a running OpenAI-compatible server",
        formatter_class=HelpFormatter,
        description="Replay requests against a running server (pagedllm serve, vllm serve, ...) as streamed "
        "completions at a Poisson request rate; print TTFT, inter-token, per-token and end-to-end latency "
        "percentiles, throughput and goodput as JSON.",
    )
    q.add_argument("--url", required=True, help="the server's /v1 base, e.g. http://127.0.0.1:8000/v1")
    q.add_argument("--served-model", default=None, help="the model name to send (default: the first /v1/models lists)")
    q.add_argument("--api-key", default="unused", help="sent as 'Authorization: Bearer KEY'")
    q.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (inf: all at once)"
    )
    q.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for the server to answer /v1/models"
    )
    q.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    q.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs a request must meet to count as good: ttft, tpot and/or e2el in milliseconds, e.g. ttft:500 tpot:50",
    )
    q.add_argument("--output", default=None, help="also write the JSON result here")
    q.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_request_args(q)
    q.set_defaults(func=cmd_bench_serve)
    add_engine_args(p, sweep=True)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.log_level.upper() != "DEBUG":  # one line per HTTP call from the openai client is noise
        for noisy in ("httpx", "httpcore", "openai"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"pagedllm: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
