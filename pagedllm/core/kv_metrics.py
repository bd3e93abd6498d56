"""How well the KV cache is used, sampled after every engine step.

Pure Python.  Definitions, in KV slots (one slot holds one token's K and V in
every layer of a block; with layer groups, in every layer of one group):

- tokens: slots that hold a computed token of a running request (a block
  shared by several requests counts once);
- allocated: slots given to requests (paged: their blocks, each counted once
  however many requests share it; contiguous: their whole reservations);
- unshared: the slots the same tables would take if no block were shared
  (prefix caching and forks make allocated smaller than this);
- shared: slots in blocks that more than one running request holds;
- utilization = tokens / allocated;
- internal waste = allocated - tokens: space inside a request's own blocks or
  reservation that holds nothing (yet);
- external fragmentation: free slots the request at the head of the queue
  cannot use (contiguous: holes shorter than its reservation; paged: always 0).

Summaries average over the memory-bound (saturated) steps, those in which a
waiting request could not be admitted for lack of KV memory (or a preemption
had just made room for a running one); a run that never saturates averages
over every step with a running request.  Steps limited only by the token
budget or `max_num_seqs` are not saturated in this sense.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, fields

from pagedllm.core.kv_cache_manager import FREED
from pagedllm.core.scheduler import Scheduler


@dataclass(frozen=True)
class KVMemorySample:
    step: int
    time_s: float  # since the tracker was last reset
    running: int
    waiting: int
    tokens: int
    allocated: int
    unshared: int
    shared: int
    capacity: int
    external_fragmentation: int
    memory_bound: bool = False  # a waiting request could not be admitted for lack of KV memory this step

    @property
    def utilization(self) -> float:
        return self.tokens / self.allocated if self.allocated else 0.0

    @property
    def internal_waste(self) -> int:
        return self.allocated - self.tokens


def sample_memory(scheduler: Scheduler, step: int, time_s: float, memory_bound: bool = False) -> KVMemorySample:
    kv = scheduler.kv_cache
    bs = kv.block_size
    head = scheduler.waiting[0].max_total_tokens if scheduler.waiting else None
    # Set operations over whole tables (C loops): this runs after every step, over every
    # running request's blocks (thousands at a large batch).
    full_blocks: set[int] = set()  # blocks some request has filled
    partial: dict[int, int] = {}  # a request's last, part-filled block -> its tokens (the most any holder has)
    unshared = 0
    seen: set[int] = set()
    shared: set[int] = set()
    groups = kv.num_groups
    for request in scheduler.running:
        table = kv.block_table(request.request_id)
        unshared += len(table) - table.count(FREED)
        shared.update(seen.intersection(table))
        seen.update(table)
        full, rest = divmod(request.num_computed_tokens, bs)
        full_blocks.update(table[: full * groups])
        if rest:
            for block in table[full * groups : (full + 1) * groups]:
                partial[block] = max(partial.get(block, 0), rest)
    full_blocks.discard(FREED)  # a sliding group's entries whose blocks went back to the pool
    shared.discard(FREED)
    partial.pop(FREED, None)
    tokens = len(full_blocks) * bs + sum(n for block, n in partial.items() if block not in full_blocks)
    return KVMemorySample(
        step=step,
        time_s=time_s,
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        tokens=tokens,
        allocated=kv.num_allocated_slots(),
        unshared=unshared * bs,
        shared=len(shared) * bs,
        capacity=kv.num_tokens_capacity,
        external_fragmentation=kv.external_fragmentation_slots(head),
        memory_bound=memory_bound,
    )


class KVMemoryTracker:
    """Keeps the latest `max_samples` step samples and summarizes them."""

    def __init__(self, max_samples: int = 100_000) -> None:
        self.samples: deque[KVMemorySample] = deque(maxlen=max_samples)
        self._start = time.perf_counter()
        self._fragmentation_waits_at_reset = 0

    def reset(self, scheduler: Scheduler) -> None:
        self.samples.clear()
        self._start = time.perf_counter()
        self._fragmentation_waits_at_reset = scheduler.kv_cache.num_fragmentation_waits

    def record(self, scheduler: Scheduler, step: int, memory_bound: bool = False) -> KVMemorySample:
        sample = sample_memory(scheduler, step, time.perf_counter() - self._start, memory_bound)
        self.samples.append(sample)
        return sample

    def summary(self, scheduler: Scheduler) -> dict[str, float | int]:
        active = [s for s in self.samples if s.running]
        saturated = [s for s in active if s.memory_bound] or active
        waits = scheduler.kv_cache.num_fragmentation_waits - self._fragmentation_waits_at_reset
        if not active:
            return {"external_fragmentation_waits": waits}

        def mean(values: list[float]) -> float:
            return round(sum(values) / len(values), 4) if values else 0.0

        return {
            "kv_utilization_mean": mean([s.utilization for s in saturated]),
            "kv_utilization_peak": round(max(s.utilization for s in active), 4),
            "internal_waste_mean": mean([s.internal_waste / s.allocated for s in saturated if s.allocated]),
            "internal_waste_slots_mean": round(mean([s.internal_waste for s in saturated]), 1),
            "kv_tokens_mean": round(mean([s.tokens for s in saturated]), 1),
            "kv_tokens_peak": max(s.tokens for s in active),
            "kv_allocated_peak": max(s.allocated for s in active),
            "kv_unshared_peak": max(s.unshared for s in active),
            "kv_shared_peak": max(s.shared for s in active),
            "kv_capacity": active[0].capacity,
            "external_fragmentation_mean": mean([s.external_fragmentation / s.capacity for s in saturated]),
            "external_fragmentation_waits": waits,
            "running_mean": round(mean([s.running for s in saturated]), 2),
            "saturated_steps": len([s for s in active if s.memory_bound]),
        }

    def rows(self) -> list[dict[str, float | int]]:
        """The per-step series, one dict per step, derived columns included."""
        return [
            asdict(s)
            | {
                "utilization": round(s.utilization, 4),
                "internal_waste": s.internal_waste,
                "memory_bound": int(s.memory_bound),
            }
            for s in self.samples
        ]


SAMPLE_COLUMNS = [f.name for f in fields(KVMemorySample)] + ["utilization", "internal_waste"]
