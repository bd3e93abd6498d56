"""`pagedllm serve` starts and stops like a service: a taken port fails at once, a signal
drains running streams and exits 0, a second signal exits at once and cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from pagedllm.testing.servers import free_port, wait_healthy

ARGS = ("--dtype", "float32", "--kv-cache-memory", "128MiB", "--log-level", "INFO")


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), *ARGS, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 180, process)
    return process, url


def stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed completion read on a thread; `result` gets its chunks' finish reason and count."""
    result: dict = {"chunks": 0, "finish_reason": None, "error": None}

    def read() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        result["chunks"] += 1
                        if '"finish_reason":"' in line.replace(" ", ""):
                            result["finish_reason"] = line
        except httpx.HTTPError as error:  # the server closing the connection at the end of the drain
            result["error"] = repr(error)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, result


def stop_after(process: subprocess.Popen) -> str:
    """Kill the server if a test left it running; its stderr."""
    if process.poll() is None:
        process.kill()
    return process.communicate()[1]


def wait_for_chunks(result: dict, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while result["chunks"] < count:
        assert time.monotonic() < deadline, f"the stream produced {result['chunks']} chunks"
        time.sleep(0.05)


def test_a_taken_port_is_a_one_line_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pagedllm", "serve", "--port", str(port), *ARGS],
            capture_output=True,
            text=True,
            timeout=120,
        )
        elapsed = time.monotonic() - start
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"pagedllm: error: cannot listen on 127.0.0.1:{port}: the port is already in use"]
    assert "model" not in done.stderr.lower()  # nothing was loaded
    assert elapsed < 60  # the import of torch and friends, no model load (which takes longer than this alone)


def test_sigterm_drains_a_running_stream_then_exits_zero():
    process, url = start_server("--shutdown-timeout", "60")
    try:
        thread, result = stream_in_background(url, 400)  # a few seconds: still running while the drain is probed
        wait_for_chunks(result, 5)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # Draining: still listening, so a load balancer's health check and a new request get a 503.
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "shutting down" in refused.text, refused.text
        thread.join(90)
        assert result["error"] is None and '"length"' in result["finish_reason"]  # it ran to its end
        assert process.wait(timeout=30) == 0
    finally:
        stderr = stop_after(process)
    assert "Traceback" not in stderr and "terminate called" not in stderr


def signal_during_a_long_stream(shutdown_timeout: str, signals: list[signal.Signals]) -> tuple[int, float, dict, str]:
    """A server streaming 2,000 tokens gets `signals` (0.5 s apart); (exit code, seconds from the
    last signal to the exit, the stream's result, the server's stderr)."""
    process, url = start_server("--shutdown-timeout", shutdown_timeout)
    try:
        thread, result = stream_in_background(url, 2000)
        wait_for_chunks(result, 5)
        for sig in signals[:-1]:
            process.send_signal(sig)
            time.sleep(0.5)
            assert process.poll() is None  # draining the stream
        start = time.monotonic()
        process.send_signal(signals[-1])
        code = process.wait(timeout=30)
        elapsed = time.monotonic() - start
        thread.join(10)
    finally:
        stderr = stop_after(process)
    return code, elapsed, result, stderr


def test_the_drain_timeout_aborts_what_is_left_and_frees_its_blocks():
    code, elapsed, result, stderr = signal_during_a_long_stream("1", [signal.SIGTERM])
    assert code == 0
    assert elapsed < 1 + 1  # the drain timeout plus a second
    assert result["finish_reason"] is None  # cut, not finished
    assert "aborted 1 unfinished requests; 0 KV blocks in use" in stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr


def test_a_second_sigint_exits_at_once_and_cleanly():
    code, elapsed, _, stderr = signal_during_a_long_stream("120", [signal.SIGINT, signal.SIGINT])
    assert code == 128 + signal.SIGINT
    assert elapsed < 2
    assert "SIGINT again: exiting now without draining" in stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr and "Aborted" not in stderr
