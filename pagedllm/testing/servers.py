"""Servers for tests, on free loopback ports: `pagedllm serve` as a subprocess (the
real command), or the same app in this process on a thread (to reach the engine)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key"


def listening_hosts(port: int) -> list[str]:
    """The IPv4 addresses a TCP socket listens on at `port` (from /proc/net/tcp; 0.0.0.0: all)."""
    hosts = []
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            local, state = line.split()[1], line.split()[3]
            ip, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                hosts.append(".".join(str(b) for b in reversed(bytes.fromhex(ip))))
    return hosts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    api_key: str | None
    pid: int | None = None  # the server's process (subprocess servers)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=30).json()

    def wait_until(self, predicate, timeout: float = 10.0) -> dict:
        """Poll /stats until predicate(stats) holds; return those stats (fail on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout} s; last stats: {stats}")
            time.sleep(0.05)


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server at {url} was not healthy within {timeout} s")


@contextlib.contextmanager
def serve_subprocess(*args: str, api_key: str | None = API_KEY, timeout: float = 180.0):
    """`python -m pagedllm serve ARGS` on a free port; stopped (and reaped) on exit."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), "--log-level", "WARNING", *args]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout, process)
        yield Server(url, api_key, process.pid)
    finally:
        stop_process(process, 30)


def stop_process(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; always reaped."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def serve_in_process(engine, max_waiting: int | None = None, api_key: str | None = None):
    """The app around `engine` (an LLMEngine) under uvicorn on a thread; yields (Server, AsyncLLMEngine)."""
    import uvicorn

    from pagedllm.models.loader import default_model_path
    from pagedllm.serving.api_server import ServerSettings, build_app
    from pagedllm.serving.async_engine import AsyncLLMEngine
    from pagedllm.text.tokenizer import Tokenizer

    async_engine = AsyncLLMEngine(engine, max_waiting)
    app = build_app(async_engine, Tokenizer(default_model_path()), ServerSettings(MODEL, api_key))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60)
        yield Server(url, api_key), async_engine
    finally:
        server.should_exit = True
        thread.join(30)
