"""`pagedllm serve` as a service: the port bound before the model loads, and a stop that drains.

- The listening address is bound first, so a taken port is a one-line error (exit code 2)
  in a moment, not after the model has loaded.  It is bound, not listened on: a client that
  connects while the model loads is refused, not left waiting.
- The first SIGINT or SIGTERM starts a drain: the server keeps listening, refuses new
  requests (503) and answers /health with 503 `{"status": "draining"}` (a load balancer
  sees it leave), lets running requests finish for up to `--shutdown-timeout` seconds, then
  aborts what is left (a stream still open ends with a 503 error event, "the server shut
  down before this request finished").  Once no request is open it stops listening, frees
  the blocks, stops the engine thread and exits 0.  The process then ends at once (`os._exit`): tearing down
  the interpreter's modules takes a second and does nothing a stopped server needs.
- A second signal exits at once: one line on stderr, exit code 128 + the signal's number
  (130 for SIGINT, 143 for SIGTERM), no traceback and no C++ teardown (`os._exit`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from pagedllm.serving.async_engine import AsyncLLMEngine

logger = logging.getLogger("pagedllm")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_now(code: int) -> None:
    """End the process with `code` once the server has stopped: logs flushed, no interpreter teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening; ValueError (exit code 2) if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        reason = "the port is already in use" if error.errno == errno.EADDRINUSE else error.strerror
        raise ValueError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


class ServingServer(uvicorn.Server):
    """uvicorn's server with the stop described above."""

    def __init__(self, app: Any, engine: AsyncLLMEngine, args: argparse.Namespace, sock: socket.socket) -> None:
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=args.access_log,
            timeout_graceful_shutdown=5,  # by then every request has ended (`_drain`): replies being written
        )
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = args.shutdown_timeout
        self.sock = sock
        self.draining_since: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn raises the caught signal again once it has stopped, which turns a clean stop into
        # a KeyboardInterrupt traceback (or a death by SIGTERM): a stop asked for is a success here.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining_since is not None or self.should_exit:
            os.write(2, f"pagedllm: {signal.Signals(sig).name} again: exiting now without draining\n".encode())
            os._exit(128 + sig)
        self.draining_since = time.monotonic()
        self.engine.start_draining()
        threading.Thread(target=self._drain, name="pagedllm-drain", daemon=True).start()
        logger.warning(
            "%s: no new requests; running ones have %.0f s to finish, then are aborted "
            "(send the signal again to exit at once)",
            signal.Signals(sig).name,
            self.shutdown_timeout,
        )

    def _drain(self) -> None:
        """Until every open request has ended (or the deadline ended them), the server still answers:
        503 to new requests and to /health.  Then uvicorn stops as on any exit."""
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine.num_open_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.engine.num_open_requests:  # each stream closes by itself with the abort's error event
            self.engine.end_open_requests("the server shut down before this request finished")
            settle = time.monotonic() + 1.0
            while self.engine.num_open_requests and time.monotonic() < settle:
                time.sleep(0.05)
        self.should_exit = True
