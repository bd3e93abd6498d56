"""The `pagedllm` command: generate, chat, bench."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    """Engine flags; with `sweep`, --block-size takes a comma-separated list (bench)."""
    defaults = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF checkpoint directory (default: bundled SmolLM2)")
    g.add_argument("--dtype", default=defaults["dtype"].default, choices=["auto", "float32", "bfloat16"])
    if sweep:
        g.add_argument("--block-size", default=str(defaults["block_size"].default), help="one size or a list: 8,16,32")
    else:
        g.add_argument("--block-size", type=int, default=defaults["block_size"].default)
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
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument(
        "--reserve",
        default=defaults["reserve"].default,
        choices=["max-model-len", "request"],
        help="contiguous layout: reserve max-model-len slots per request, or prompt + max_tokens",
    )
    g.add_argument("--kv-cache-memory", default=defaults["kv_cache_memory"].default, help="e.g. 2GiB")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"].default)
    g.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"].default)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--attention", default=defaults["attention"].default, choices=["auto", "cpp", "torch", "triton", "reference"]
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
    g.add_argument("--log-level", default="INFO")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


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
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.engine import LLMEngine

    params = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request(prompt, params)
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
    from pagedllm.engine import LLMEngine

    params = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("pagedllm chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        engine.add_request(engine.tokenizer.apply_chat_template(messages), params)
        reply = ""
        while engine.has_unfinished_requests():
            for output in engine.step():
                print(output.delta, end="", flush=True)
                reply = output.text
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedllm.bench import load_workload, print_result, run_bench
    from pagedllm.bench_report import parse_list, parse_on_off, run_compare, settings_grid

    block_sizes = parse_list(args.block_size, int)
    layouts = parse_list(args.compare) if args.compare else [args.kv_layout]
    base = engine_config(args, block_size=block_sizes[0])
    requests = load_workload(args.workload, args.num_requests)
    caching = parse_on_off(args.prefix_caching) if args.prefix_caching else [args.enable_prefix_caching]
    settings = settings_grid(layouts, block_sizes, caching)
    if len(settings) > 1 or args.report_dir:
        result = run_compare(
            base,
            settings,
            requests,
            args.report_dir or "bench-report",
            ignore_eos=not args.respect_eos,
            workload_name=str(args.workload),
        )
        print(f"report written to {args.report_dir or 'bench-report'}/", file=sys.stderr)
    else:
        result = run_bench(base, requests, ignore_eos=not args.respect_eos)
    print_result(result, args.output)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from pagedllm.api_server import ServerSettings, build_app
    from pagedllm.async_engine import AsyncLLMEngine
    from pagedllm.config import parse_bytes
    from pagedllm.engine import LLMEngine
    from pagedllm.model_loader import resolve_model_path
    from pagedllm.tokenizer import Tokenizer

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

    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="LLM inference with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, dashboard)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or PAGEDLLM_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    p.add_argument("--max-waiting", type=int, default=1024, help="queue bound: more waiting requests get a 429")
    p.add_argument("--max-body-size", default="4MiB", help="larger request bodies get a 413")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="answer one prompt (chat template applied unless --raw)")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    p.add_argument("--system", default=None, help="system message")
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="offline throughput on a JSONL workload (all requests at once)")
    p.add_argument("--workload", required=True, help="JSONL: {id, prompt_token_ids, max_tokens} per line")
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
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
    add_engine_args(p, sweep=True)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"pagedllm: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
