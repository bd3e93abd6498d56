"""The `pagedllm` command: generate, chat, bench."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from pagedllm.benchmarking.commands import add_bench_parser
from pagedllm.cli_args import (
    HelpFormatter,
    add_engine_args,
    add_sampling_args,
    engine_config,
    sampling_params,
)
from pagedllm.core.request import check_prompt_length


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.engine import LLMEngine

    if not args.prompt.strip():
        raise ValueError('the prompt is empty: pass the text to answer, e.g. pagedllm generate "Hello"')
    if not args.raw:
        check_chat_template(args.model)
    params = sampling_params(args)
    engine = LLMEngine(engine_config(args))
    if args.raw:
        prompt_ids = engine.tokenizer.encode(args.prompt)
    else:
        prompt_ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    check_prompt_length(len(prompt_ids), args.max_tokens, engine.max_model_len)  # what the server refuses
    engine.add_request(prompt_ids, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.delta, end="", flush=True)
            final = output
    print()
    if final is not None:
        print(f"[{len(final.token_ids)} tokens, finish reason: {final.finish_reason}]", file=sys.stderr)
    if final is not None and final.finish_reason == "error":
        print(f"pagedllm: error: the request failed: {final.error or 'see the log above'}", file=sys.stderr)
        return 1
    return 0


def check_chat_template(model: str | None) -> None:
    """A chat needs the model's template: a base model is told where plain text goes, before it loads."""
    from pagedllm.models.loader import has_chat_template, resolve_model_path
    from pagedllm.text.tokenizer import NO_CHAT_TEMPLATE

    path = resolve_model_path(model)
    if not has_chat_template(path):
        raise ValueError(NO_CHAT_TEMPLATE.format(name=model or path.name))


def cmd_chat(args: argparse.Namespace) -> int:

    from pagedllm.engine import LLMEngine

    check_chat_template(args.model)
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


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from pagedllm.config import parse_bytes
    from pagedllm.engine import LLMEngine
    from pagedllm.models.loader import read_model_config, resolve_model_path
    from pagedllm.serving.api_server import ServerSettings, build_app
    from pagedllm.serving.async_engine import AsyncLLMEngine
    from pagedllm.serving.service import ServingServer, bind_socket, exit_now
    from pagedllm.text.tokenizer import Tokenizer

    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            raise ValueError(f"two models given: {args.model_positional!r} and --model {args.model!r}; pass one")
        args.model = args.model_positional
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
    config = dataclasses.replace(engine_config(args), record_kv_events=args.kv_events)
    if args.data_parallel_size > 1 or args.ray_address is not None:
        from pagedllm.replicas.serve import serve_data_parallel

        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
        argv = args.argv[args.argv.index("serve") + 1 :]
        path = resolve_model_path(config.model)
        read_model_config(path)  # a bad file is refused here in one line, not inside every replica
        return serve_data_parallel(args, argv, config.block_size, path)
    settings = ServerSettings(
        served_model_name=args.served_model_name or served_model_name(config.model),
        api_key=args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None,
        max_body_bytes=parse_bytes(args.max_body_size),
        kv_events=args.kv_events,
        model_aliases=model_aliases(config.model, args.served_model_name),
        allow_unknown_fields=args.allow_unknown_fields,
        runtime_lora=args.allow_runtime_lora,
    )
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails in a moment
    engine = AsyncLLMEngine(LLMEngine(config), args.max_waiting)
    app = build_app(engine, Tokenizer(resolve_model_path(config.model)), settings)
    server = ServingServer(app, engine, args, sock)
    logging.getLogger("pagedllm").info(
        "serving %r on http://%s:%d/v1 (dashboard: /dashboard, metrics: /metrics)%s",
        settings.served_model_name,
        args.host,
        args.port,
        "; API key required" if settings.api_key else "",
    )
    # A dead tensor-parallel rank ends the server rather than leaving it half alive.
    engine.on_worker_failure(lambda error: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
    if engine.worker_failure is not None:
        print(f"pagedllm: error: {engine.worker_failure}", file=sys.stderr)
        exit_now(1)
    exit_now(0)
    return 0


def model_aliases(model: str | None, served_name: str | None) -> tuple[str, ...]:
    """A bundled model also answers to its short name (the one the CLI takes), unless renamed."""
    from pagedllm.models.loader import BUNDLED_MODELS, DEFAULT_MODEL

    if served_name is not None or (model is not None and model not in BUNDLED_MODELS):
        return ()
    return (model or DEFAULT_MODEL,)


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

    parser = argparse.ArgumentParser(
        prog="pagedllm",
        description="LLM inference with a paged KV cache",
        epilog="An error is one line on stderr and a nonzero exit; --debug (anywhere on the line) or "
        "PAGEDLLM_DEBUG=1 shows its traceback.",
    )
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
    p.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="ignore body fields this server does not know (default: a 400 naming the field, as OpenAI answers)",
    )
    p.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="offer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key): clients name "
        "adapter directories on this machine",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, seconds running requests may take to finish before they are aborted "
        "(a second signal exits at once)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="run this many engine replicas (on Ray) behind one endpoint; on one machine each gets "
        "cores / N of its cores",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="place the replicas on this Ray cluster (auto, or HOST:PORT) instead of this machine's child processes",
    )
    p.add_argument(
        "--router",
        default="prefix",
        choices=["prefix", "least-loaded", "round-robin"],
        help="how requests are spread over replicas: to the one holding the longest run of the prompt's "
        "blocks (load permitting), the least loaded, or in turn",
    )
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="serve GET /kv_events: the prefix cache's stored and evicted block keys (the data-parallel "
        "router reads them from each replica)",
    )
    add_engine_args(p, serving=True)
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

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug anywhere on the line (or PAGEDLLM_DEBUG=1): an error shows its traceback.
    debug = "--debug" in argv or os.environ.get("PAGEDLLM_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.log_level.upper() != "DEBUG":  # one line per HTTP call from the openai client is noise
        for noisy in ("httpx", "httpcore", "openai"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as error:  # bad settings, files or models: the user's to fix
        if debug:
            raise
        print(f"pagedllm: error: {one_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # anything else: still one line (the traceback with --debug)
        if debug:
            raise
        print(f"pagedllm: error: {type(error).__name__}: {one_line(error)} (--debug shows where)", file=sys.stderr)
        return 1


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
