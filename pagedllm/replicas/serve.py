"""`pagedllm serve --data-parallel-size N`: N replicas (this machine's child processes, or on a
Ray cluster with --ray-address) and the front-end before them."""

from __future__ import annotations

import argparse
import logging
import os
import secrets

logger = logging.getLogger("pagedllm")

# Flags of `pagedllm serve` that belong to the front-end, not to each replica (with their values).
# The API key goes to each replica in its environment, not its command line (`ps` shows that).
_FRONTEND_FLAGS = {
    "--host": 1, "--port": 1, "--data-parallel-size": 1, "--ray-address": 1, "--router": 1, "--api-key": 1
}  # fmt: skip
_FRONTEND_SWITCHES = {"--kv-events"}


def replica_args(serve_argv: list[str]) -> list[str]:
    """The `pagedllm serve` arguments each replica gets: everything but the front-end's own flags."""
    out, skip = [], 0
    for arg in serve_argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _FRONTEND_FLAGS:
            skip = 0 if "=" in arg else _FRONTEND_FLAGS[name]
            continue
        if name in _FRONTEND_SWITCHES:
            continue
        out.append(arg)
    return out


def serve_data_parallel(args: argparse.Namespace, serve_argv: list[str], block_size: int, model_path) -> int:
    import uvicorn

    from pagedllm.config import parse_bytes
    from pagedllm.replicas.frontend import build_frontend
    from pagedllm.replicas.launcher import start_replicas
    from pagedllm.replicas.router import Router
    from pagedllm.text.tokenizer import Tokenizer

    n = args.data_parallel_size
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    replica_key = api_key or secrets.token_urlsafe(32)  # the replicas answer only the front-end
    if args.ray_address is None:
        logger.info("starting %d replicas as child processes, listening on 127.0.0.1", n)
    else:
        logger.info("starting %d replicas on the Ray cluster at %s, each on its node's address", n, args.ray_address)
    replicas = start_replicas(replica_args(serve_argv), n, args.ray_address, api_key=replica_key)
    try:
        router = Router(n, block_size, args.router)
        app = build_frontend(
            Tokenizer(model_path), router, replicas.resolve, api_key, max_body_bytes=parse_bytes(args.max_body_size),
            replica_key=replica_key,
        )  # fmt: skip
        logger.info(
            "serving %d replicas (%d cores each, router %s) on http://%s:%d/v1",
            n, replicas.cores, args.router, args.host, args.port,
        )  # fmt: skip
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        replicas.shutdown()
    return 0
