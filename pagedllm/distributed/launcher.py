"""Starting, watching and stopping the ranks of a tensor-parallel engine (rank 0's side).

Two ways to get N ranks:

- spawned (the default): the process that builds the engine is rank 0 and
  starts N-1 `python -m pagedllm.distributed.worker` processes on this machine.
  They meet at a TCPStore that rank 0 hosts; each builds its slice of the
  model, then says "ready" (or sends its error) through the store, so a
  worker that fails to start is reported by rank, never waited on; then all
  join one process group.
- external: a launcher such as `torchrun` starts every rank, on one machine
  or several, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, and
  `distributed_init_method` (`env://` or `tcp://host:port`) is handed to
  `init_process_group`.  Rank 0 becomes the engine; on the other ranks the
  `LLMEngine` constructor runs the worker loop and exits the process when
  rank 0 shuts down, so one script serves every rank.

Failure: gloo ends a collective whose peer died with "connection closed",
within the step; a thread on rank 0 also polls the spawned workers, so a
worker that dies between steps is logged at once and the next step raises
`WorkerDiedError` naming its rank.  Workers leave when rank 0's connection
closes, and poll their parent process, so a killed engine leaves no orphans.
The backend is gloo on the CPU.  On CUDA it is `cpu:gloo,cuda:nccl`: the
collectives of the forward pass (all-reduce, the logits' gather) run over NCCL
on each rank's own GPU (rank r on cuda:r), while the step messages, which are
host data, keep going over gloo.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.child_process import child_environment
from pagedllm.config import EngineConfig
from pagedllm.core.step_message import shutdown_message
from pagedllm.layers.tensor_parallel import TensorParallel

logger = logging.getLogger("pagedllm")

# Idle workers wait inside a broadcast for the next step, for as long as the engine is idle;
# a dead peer ends a collective through its closed connection, not through this timeout.
PROCESS_GROUP_TIMEOUT = timedelta(days=7)
STARTUP_TIMEOUT_S = 600.0  # a worker that neither reports ready nor fails within this is an error


def process_group_backend(config: EngineConfig) -> str:
    """gloo for CPU ranks; NCCL for the tensors of CUDA ranks, gloo for their host messages."""
    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot run another step."""


@dataclass(frozen=True)
class RankMemory:
    rank: int
    weight_bytes: int  # this rank's slice of the weights (packed copies included)
    kv_cache_bytes: int  # this rank's KV heads, every block
    rss_bytes: int  # the whole process, as the OS counts it


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def gather_rank_memory(tp: TensorParallel, mine: RankMemory) -> list[RankMemory]:
    """Every rank's figures, on rank 0 (others get []); a collective every rank calls once at start."""
    if tp.size == 1:
        return [mine]
    row = torch.tensor([mine.weight_bytes, mine.kv_cache_bytes, mine.rss_bytes], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(row, rows, dst=0)
    if rows is None:
        return []
    return [RankMemory(rank, *(int(v) for v in r.tolist())) for rank, r in enumerate(rows)]


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's torch threads: `num_threads`, else this machine's cores shared out (spawned ranks
    share one machine; under an external launcher set OMP_NUM_THREADS or num_threads)."""
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


def external_rank(config: EngineConfig) -> TensorParallel:
    """This process's rank under an external launcher (RANK, and WORLD_SIZE when set, from the environment)."""
    size = config.tensor_parallel_size
    if "RANK" not in os.environ:
        raise ValueError(
            f"distributed_init_method {config.distributed_init_method!r} needs RANK (and WORLD_SIZE) in the "
            "environment, as torchrun sets them; without a launcher, leave distributed_init_method unset"
        )
    rank = int(os.environ["RANK"])
    world = int(os.environ.get("WORLD_SIZE", size))
    if world != size:
        raise ValueError(f"WORLD_SIZE is {world} but tensor_parallel_size is {size}; they must match")
    if not 0 <= rank < size:
        raise ValueError(f"RANK {rank} is outside a tensor-parallel group of {size}")
    return TensorParallel(rank, size)


def start_ranks(config: EngineConfig) -> tuple[TensorParallel, WorkerGroup | None]:
    """This process's place in tensor parallelism, with the workers it started (rank 0 of a
    spawned group).  A process that a launcher (torchrun) started as a rank other than 0 becomes
    that rank's worker here: it serves rank 0's steps until they end, then the process exits, so
    this call never returns there."""
    if config.tensor_parallel_size == 1:
        return TensorParallel(), None
    tp = external_rank(config) if config.distributed_init_method else TensorParallel(0, config.tensor_parallel_size)
    if tp.rank != 0:
        from pagedllm.distributed.worker import run_worker

        run_worker(config, tp)
        raise SystemExit(0)
    workers = WorkerGroup(config)
    workers.start()
    return tp, workers


def init_external_group(config: EngineConfig, tp: TensorParallel) -> None:
    dist.init_process_group(
        process_group_backend(config),
        init_method=config.distributed_init_method,
        rank=tp.rank,
        world_size=tp.size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1 and on the process group."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp = TensorParallel(0, config.tensor_parallel_size)
        self.processes: dict[int, subprocess.Popen] = {}
        self.failure: WorkerDiedError | None = None
        self.on_failure: list[Callable[[WorkerDiedError], None]] = []  # called once, from the monitor thread
        self._store: dist.TCPStore | None = None
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._threads_before = torch.get_num_threads()

    # --- start -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawned mode: start the workers; they load their slices while rank 0 loads its own."""
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine already runs in this process; shut it down first")
        if self.config.distributed_init_method is not None:
            if self.config.num_threads:
                torch.set_num_threads(self.config.num_threads)
            return  # the launcher started the other ranks
        size = self.tp.size
        # Every rank is on this machine: the store listens on a socket bound to loopback (TCPStore
        # alone listens on every interface), and gloo's connections use the loopback interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(  # the store owns the socket from here (detach: never closed twice)
            "127.0.0.1", port, size, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
        )
        payload = json.dumps(asdict(self.config))
        for rank in range(1, size):
            command = [sys.executable, "-m", "pagedllm.distributed.worker", "--rank", str(rank)]
            command += ["--store", f"127.0.0.1:{port}", "--config", payload]
            self.processes[rank] = subprocess.Popen(command, env=child_environment())  # the same package
        torch.set_num_threads(threads_per_rank(self.config))

    def connect(self) -> None:
        """Wait for every spawned worker to be ready (or fail), then form the process group."""
        if self.config.distributed_init_method is not None:
            init_external_group(self.config, self.tp)
            return
        store = self._store
        pending = set(self.processes)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while pending:
                for rank in sorted(pending):
                    if store.check([f"error/{rank}"]):
                        raise WorkerDiedError(
                            f"tensor-parallel worker rank {rank} failed to start: {store.get(f'error/{rank}').decode()}"
                        )
                    if store.check([f"ready/{rank}"]):
                        pending.discard(rank)
                    elif (code := self.processes[rank].poll()) is not None:
                        raise WorkerDiedError(
                            f"tensor-parallel worker rank {rank} {describe_exit(code)} while starting"
                        )
                if time.monotonic() > deadline:
                    raise WorkerDiedError(
                        f"tensor-parallel workers {sorted(pending)} not ready after {STARTUP_TIMEOUT_S:.0f} s"
                    )
                time.sleep(0.05)
            dist.init_process_group(
                process_group_backend(self.config),
                store=store,
                rank=0,
                world_size=self.tp.size,
                timeout=PROCESS_GROUP_TIMEOUT,
            )
        except BaseException:
            self.shutdown(send=False)
            raise
        self._monitor = threading.Thread(target=self._watch, name="pagedllm-tp-monitor", daemon=True)
        self._monitor.start()

    # --- failure -----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for rank, process in self.processes.items():
                code = process.poll()
                if code is not None and not self._stopping.is_set():
                    error = self._record(WorkerDiedError(f"tensor-parallel worker rank {rank} {describe_exit(code)}"))
                    logger.error("%s; the engine cannot continue", error)
                    for callback in self.on_failure:
                        callback(error)
                    return

    def _record(self, error: WorkerDiedError) -> WorkerDiedError:
        with self._lock:
            if self.failure is None:
                self.failure = error
            return self.failure

    def check(self) -> None:
        """Raise the failure, if a worker has failed (called before each step)."""
        if self.failure is not None:
            raise self.failure

    def explain(self, error: BaseException) -> WorkerDiedError:
        """The error to raise for a failed collective: which rank died, when one did."""
        deadline = time.monotonic() + 3.0  # the dead process may not have been reaped yet
        while time.monotonic() < deadline:
            codes = {r: p.poll() for r, p in self.processes.items()}
            dead = {r: code for r, code in codes.items() if code is not None}
            if dead:
                ranks = ", ".join(f"rank {r} {describe_exit(code)}" for r, code in sorted(dead.items()))
                return self._record(WorkerDiedError(f"tensor-parallel worker {ranks}"))
            if not self.processes:
                break
            time.sleep(0.05)
        return self._record(WorkerDiedError(f"a tensor-parallel step failed on rank 0: {error}"))

    # --- stop --------------------------------------------------------------------------

    def shutdown(self, send: bool = True) -> None:
        """Tell the workers to stop (or, after a failure, terminate them), wait, kill stragglers, leave the group."""
        self._stopping.set()
        graceful = send and self.failure is None and dist.is_initialized()
        if graceful:
            try:
                self.tp.broadcast_ints(shutdown_message())
            except RuntimeError as error:
                logger.warning("could not tell the tensor-parallel workers to stop: %s", error)
                graceful = False
        for process in self.processes.values():
            if not graceful and process.poll() is None:
                process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
        torch.set_num_threads(self._threads_before)
