"""A tensor-parallel worker: ranks 1..N-1.  It builds its slice of the model and KV
cache, then runs each step rank 0 broadcasts, until rank 0 says stop.

`python -m pagedllm.distributed.worker --rank R --store HOST:PORT --config JSON` is how
rank 0 spawns one (pagedllm/distributed/launcher.py); under an external launcher the
`LLMEngine` constructor calls `run_worker` on ranks other than 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.core.step_message import WorkerBlockTables
from pagedllm.distributed.launcher import (
    PROCESS_GROUP_TIMEOUT,
    RankMemory,
    gather_rank_memory,
    init_external_group,
    process_group_backend,
    rss_bytes,
    threads_per_rank,
)
from pagedllm.execution.model_runner import ModelRunner
from pagedllm.execution.rank_model import build_rank_model
from pagedllm.layers.tensor_parallel import TensorParallel

logger = logging.getLogger("pagedllm")


def serve_steps(runner: ModelRunner) -> int:
    """Run every step rank 0 broadcasts, keeping the block tables from its increments; return the step count."""
    tables = WorkerBlockTables()
    steps = 0
    while (plan := tables.apply(runner.tp.broadcast_ints(None))) is not None:
        runner.run(plan.chunks, plan.block_copies)
        steps += 1
    return steps


def run_worker(config: EngineConfig, tp: TensorParallel, store: dist.TCPStore | None = None) -> None:
    """Build this rank, join the group (through rank 0's store when spawned, else the launcher's
    init method), report memory, serve steps, leave."""

    try:
        built = build_rank_model(config, tp)
        runner = ModelRunner.for_rank(built, config)
    except Exception as error:
        if store is not None:
            store.set(f"error/{tp.rank}", f"{type(error).__name__}: {error}")
        raise
    if store is not None:
        store.set(f"ready/{tp.rank}", "1")
        dist.init_process_group(
            process_group_backend(config), store=store, rank=tp.rank, world_size=tp.size, timeout=PROCESS_GROUP_TIMEOUT
        )
    else:
        init_external_group(config, tp)
    gather_rank_memory(tp, RankMemory(tp.rank, built.model.weight_bytes(), runner.kv_cache_bytes, rss_bytes()))
    try:
        steps = serve_steps(runner)
    except RuntimeError as error:  # rank 0 went away without saying stop
        raise SystemExit(f"pagedllm tensor-parallel rank {tp.rank}: lost rank 0 ({error})") from None
    logger.debug("rank %d ran %d steps", tp.rank, steps)
    dist.destroy_process_group()


def exit_with_parent() -> None:
    """Spawned workers end when the process that spawned them is gone (killed, crashed), not only when told."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.distributed.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = parser.parse_args(argv)
    exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s pagedllm rank {args.rank}: %(message)s")
    config = EngineConfig(**json.loads(args.config))
    torch.set_num_threads(threads_per_rank(config))
    host, _, port = args.store.rpartition(":")
    store = dist.TCPStore(host, int(port), config.tensor_parallel_size, is_master=False)
    run_worker(config, TensorParallel(args.rank, config.tensor_parallel_size), store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
