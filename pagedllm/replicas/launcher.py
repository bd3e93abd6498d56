"""Engine replicas placed, watched and restarted by Ray (and the replica server both paths use).

Each replica is a Ray actor whose process runs `pagedllm serve` (with `--kv-events`) as its
child, on a port of its node, with `cores` threads.  The child is tied to the actor: it
gets SIGKILL when the actor's process dies (PR_SET_PDEATHSIG), and the actor exits when the
child does, so a replica lost either way is one dead actor, which Ray starts again
(`max_restarts=-1`) on a node with room; the front-end finds its new address through
`address()`.

This is the `--ray-address` path: on one machine the replicas are plain child processes of the
front-end instead (pagedllm/replicas/local.py), built from the same `ReplicaServer`.  On a
cluster each replica asks Ray for `cores` CPUs and runs that many threads; Ray picks the node.

Exposure: a replica listens on its node's address (the one Ray reports), which the front-end
must reach, and its /v1 routes require the front-end's key (its own API key, or a random one
when it has none), so a client cannot go around the front-end.

A replica's server runs the same pagedllm package as the actor that starts it
(pagedllm/child_process.py).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

from pagedllm.child_process import child_environment

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the replica's server process: SIGKILL when the actor that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_address() -> str:
    """An address other nodes can reach this one at (the loopback one on a single machine)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: this machine only
        return "127.0.0.1"


class ReplicaServer:
    """The body of a replica actor: `pagedllm serve` as a child process tied to this one.  A
    server that fails to start leaves the actor alive with `start_error()` saying why in one
    line (its own last error), so the launcher reports it instead of Ray restarting it."""

    def __init__(
        self, index: int, serve_args: list[str], cores: int, pin: list[int] | None, start_timeout: float,
        bind_host: str, api_key: str, exit_with_child: bool = True, wait: bool = True,
    ) -> None:  # fmt: skip
        """Starts the server; with `wait`, returns once it answers /health or has failed (else call
        `wait_until_ready`).  The server gets SIGKILL when the thread that started it ends, so
        that thread must live as long as the server should."""
        self.index, self.port = index, free_port()
        self.host = bind_host if bind_host != "0.0.0.0" else node_address()
        self.start_timeout = start_timeout
        self._start_error: str | None = None
        command = [sys.executable, "-m", "pagedllm", "serve", *serve_args, "--kv-events"]
        command += ["--host", self.host, "--port", str(self.port), "--num-threads", str(cores)]
        env = child_environment(PAGEDLLM_API_KEY=api_key)

        def prepare() -> None:
            _die_with_parent()
            if pin:
                os.sched_setaffinity(0, pin)

        self.process = subprocess.Popen(  # noqa: PLW1509 - preexec_fn is needed for PDEATHSIG
            command, preexec_fn=prepare, env=env, stderr=subprocess.PIPE, text=True, errors="replace"
        )
        self._last_lines: collections.deque[str] = collections.deque(maxlen=20)
        self._copier = threading.Thread(target=self._copy_stderr, daemon=True)
        self._copier.start()
        if wait:
            self.wait_until_ready()
            if exit_with_child and self._start_error is None:  # a Ray actor: it dies with its server
                threading.Thread(target=self._exit_with_child, daemon=True).start()

    def wait_until_ready(self) -> None:
        """Until the server answers /health; else `start_error()` says why it did not."""
        deadline = time.monotonic() + self.start_timeout
        while not self._healthy():
            if self.process.poll() is not None:
                self._copier.join(timeout=2.0)  # the server's last lines, up to its end of stderr
                self._start_error = (
                    f"replica {self.index}'s server exited with {self.process.returncode} while starting: "
                    f"{self._last_error()}"
                )
                return
            if time.monotonic() > deadline:
                self.process.kill()
                self._start_error = (
                    f"replica {self.index}'s server did not answer /health within {self.start_timeout:.0f} s"
                )
                return
            time.sleep(0.2)

    def _copy_stderr(self) -> None:
        for line in self.process.stderr:
            sys.stderr.write(line)
            if line.strip():
                self._last_lines.append(line.strip())

    def _last_error(self) -> str:
        """The server's own one-line error if it printed one, else its last line on stderr."""
        lines = list(self._last_lines)
        errors = [line for line in lines if line.startswith("pagedllm: error:")]
        return (errors or lines or ["(it printed nothing)"])[-1]

    def start_error(self) -> str | None:
        return self._start_error

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=1.0) as reply:
                return reply.status == 200
        except OSError:
            return False

    def _exit_with_child(self) -> None:
        self.process.wait()
        os._exit(1)  # the actor dies with its server: Ray restarts both

    def address(self) -> str:
        if self._start_error is not None:
            raise RuntimeError(self._start_error)
        return f"http://{self.host}:{self.port}"

    def server_pid(self) -> int:
        return self.process.pid


@dataclass
class ReplicaSet:
    """N replica actors; `resolve(i)` is replica i's address now (waiting while it restarts)."""

    actors: list
    cores: int

    async def resolve(self, index: int) -> str:
        return await self.actors[index].address.remote()

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def start_replicas(
    serve_args: list[str],
    num_replicas: int,
    ray_address: str | None = None,
    cores: int | None = None,
    start_timeout: float = 600.0,
    api_key: str | None = None,
):
    """Start `num_replicas` replicas and wait until each answers /health: on this machine as its
    own child processes (pagedllm/replicas/local.py; no Ray, nothing listening beyond 127.0.0.1),
    or on the Ray cluster at `ray_address`.  `cores` per replica (default: this machine's cores
    split evenly).  Their /v1 routes require `api_key` (the front-end sends it).  A replica that
    cannot start raises ValueError with its server's own last error."""
    if ray_address is None:
        from pagedllm.replicas.local import LocalReplicas

        return LocalReplicas(serve_args, num_replicas, cores, start_timeout, api_key or "")
    try:
        import ray
    except ImportError as error:
        raise ValueError("--data-parallel-size and --ray-address need Ray: pip install 'ray>=2.40'") from error

    machine_cores = len(os.sched_getaffinity(0))
    cores = cores or max(1, machine_cores // num_replicas)
    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=True)
    bind_host = "0.0.0.0"  # meaning the node's own address, as Ray reports it
    actor_class = ray.remote(num_cpus=cores, max_restarts=-1, max_task_retries=-1)(ReplicaServer)
    actors = [
        actor_class.remote(i, serve_args, cores, None, start_timeout, bind_host, api_key or "")
        for i in range(num_replicas)
    ]
    try:  # every replica up, or the first one's own error
        errors = ray.get([actor.start_error.remote() for actor in actors], timeout=start_timeout + 60)
    except ray.exceptions.GetTimeoutError as error:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        free = ray.available_resources().get("CPU", 0)
        raise ValueError(
            f"{num_replicas} replicas of {cores} CPUs were not all up within {start_timeout + 60:.0f} s "
            f"(Ray has {free:g} CPUs free: is the cluster big enough?)"
        ) from error
    failed = [error for error in errors if error is not None]
    if failed:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise ValueError(failed[0])
    return ReplicaSet(actors, cores)
