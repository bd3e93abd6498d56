"""Replicas on this machine without Ray: each replica's `pagedllm serve` is a child process of
the front-end, listening on 127.0.0.1 only, pinned to its own cores, and started again (on a
new port) when it dies.  Nothing but the front-end listens beyond loopback.

A child is tied to the front-end (PR_SET_PDEATHSIG: it gets SIGKILL when the front-end dies),
and a watcher thread restarts a child that exits; while it restarts, `resolve` fails, so the
front-end's poll marks the replica down, and takes it back at its new address once it answers.
"""

from __future__ import annotations

import logging
import os
import threading

from pagedllm.replicas.launcher import ReplicaServer

logger = logging.getLogger("pagedllm")

WATCH_INTERVAL_S = 0.5
RETRY_AFTER_FAILURE_S = 10.0  # a replica that cannot start is tried again this much later


class LocalReplicas:
    """N replica servers as child processes; the same interface as the Ray replica set."""

    def __init__(
        self, serve_args: list[str], num_replicas: int, cores: int | None, start_timeout: float, api_key: str
    ) -> None:
        all_cores = sorted(os.sched_getaffinity(0))
        self.cores = cores or max(1, len(all_cores) // num_replicas)
        self._pins = [
            all_cores[i * self.cores : (i + 1) * self.cores] if (i + 1) * self.cores <= len(all_cores) else None
            for i in range(num_replicas)
        ]
        self._args = (serve_args, start_timeout, api_key)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        # Started from this thread (the server's main one, alive as long as they should be: a child
        # gets SIGKILL when the thread that started it ends), then waited for side by side.
        self.servers: list[ReplicaServer | None] = [self._start(i, wait=False) for i in range(num_replicas)]
        for server in self.servers:
            server.wait_until_ready()
        failed = [server.start_error() for server in self.servers if server.start_error() is not None]
        if failed:
            self.shutdown()
            raise ValueError(failed[0])
        self._watcher = threading.Thread(target=self._watch, name="pagedllm-replicas", daemon=True)
        self._watcher.start()

    def _start(self, index: int, wait: bool = True) -> ReplicaServer:
        serve_args, start_timeout, api_key = self._args
        return ReplicaServer(
            index, serve_args, self.cores, self._pins[index], start_timeout, "127.0.0.1", api_key,
            exit_with_child=False, wait=wait,
        )  # fmt: skip

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for index, server in enumerate(self.servers):
                if server is None or server.process.poll() is None or self._stopping.is_set():
                    continue
                logger.warning(
                    "replica %d's server exited with %s; starting it again", index, server.process.returncode
                )
                with self._lock:
                    self.servers[index] = None
                restarted = self._start(index)  # from this thread, which lives as long as the front-end
                with self._lock:
                    self.servers[index] = restarted
                if restarted.start_error() is not None:
                    logger.error("replica %d could not start again: %s", index, restarted.start_error())
                    self._stopping.wait(RETRY_AFTER_FAILURE_S)

    async def resolve(self, index: int) -> str:
        with self._lock:
            server = self.servers[index]
        if server is None or server.process.poll() is not None:
            raise RuntimeError(f"replica {index} is restarting")
        return server.address()

    def shutdown(self) -> None:
        self._stopping.set()
        for server in self.servers:
            if server is not None and server.process.poll() is None:
                server.process.terminate()
        for server in self.servers:
            if server is not None:
                try:
                    server.process.wait(timeout=30)
                except Exception:  # noqa: BLE001 - it is killed instead
                    server.process.kill()
