"""Adaptive thread count: use only the cores other processes leave free.

Every parallel region of a step (each GEMM, each attention call: hundreds per
step) ends at a barrier, so one thread on a core that another process also
wants holds up all the others: the OS gives that core away for a whole time
slice, and the step waits.  On a 2-core machine with one busy-loop process
beside it, two threads ran at 30% of their quiet speed (28% in another run),
worse than one thread alone (docs/performance.md, `python benchmarks/contention.py`).

So the engine measures, about once a second, how much CPU time other processes
took on the cores this process may run on (`/proc/stat` for those cores, less
this process's own CPU time) and sets the thread count to the cores left
(rounded down, with a quarter-core of slack; at least 1, at most the thread
count the process started with: the cores it may use, or `OMP_NUM_THREADS`).
The decision is made between steps, on the thread that runs them, so torch's
and the C++ kernels' OpenMP regions follow it at once.  A window longer than three
intervals (no step ended within it: start-up, an idle server, one long step) is
dropped: it says little about now, and at start-up it holds the kernel compiler, a
child whose CPU time looked like another process's (a fresh start went to one
thread for its first second).  Pure Python
apart from the setter it is given; `num_threads` set by the user turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("pagedllm")

# A window longer than this many intervals (no step ran in between) is not used.
_STALE_INTERVALS = 3

# omp_pause_soft: the workers end; the next parallel region starts new ones.
_OMP_PAUSE_SOFT = 1

# /proc/stat counts in USER_HZ ticks (100 per second on Linux).
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def busy_seconds(cpus: list[int], stat_path: str = "/proc/stat") -> float | None:
    """CPU time spent not idle on these cores since boot (all processes), or None where
    /proc/stat cannot be read."""
    wanted = {f"cpu{c}" for c in cpus}
    total = 0
    try:
        with open(stat_path) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in wanted:
                    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
                    total += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError):
        return None
    return total / _TICKS_PER_SECOND


def release_openmp_workers() -> bool:
    """End the OpenMP worker threads that the calling thread's parallel regions left waiting.

    libgomp keeps one team of workers per thread that has run a parallel region, and when it
    manages more threads than there are cores it has every worker stop spinning at once at the
    end of a region and sleep instead, so each of the hundreds of regions in a step pays a
    wake-up.  The engine is built on the main thread and then stepped on a thread of its own
    (the server): with the main thread's team still alive, a 10-row decode step of SmolLM2 took
    42 ms on that thread against 25 ms on the main thread (2-core AMX Xeon, bfloat16).  Freeing
    the main thread's team (OpenMP 5's `omp_pause_resource_all`) gives the stepping thread back
    its speed.  True if the team was freed; False where torch's OpenMP is not libgomp or has no
    pause call (nothing is changed then)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause(_OMP_PAUSE_SOFT) == 0
    return False


def threads_for_free_cores(free_cores: float, max_threads: int) -> int:
    """The thread count for this many free cores: rounded down with a quarter-core of slack."""
    return max(1, min(max_threads, int(free_cores + 0.25)))


class AdaptiveThreads:
    """Call `after_step()` after every engine step; it resets the thread count when the
    cores other processes use have changed."""

    def __init__(
        self,
        set_threads: Callable[[int], None],
        interval_s: float = 1.0,
        cpus: list[int] | None = None,
        read_busy: Callable[[], float | None] | None = None,
        read_own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        max_threads: int | None = None,
    ) -> None:
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.max_threads = min(len(self.cpus), max_threads or len(self.cpus))
        self.threads = self.max_threads
        self._set_threads = set_threads
        self._interval = interval_s
        self._read_busy = read_busy or (lambda: busy_seconds(self.cpus))
        self._read_own, self._clock = read_own, clock
        self._last = self._sample()
        self.other_cores = 0.0  # cores other processes used over the last interval
        set_threads(self.threads)

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._read_busy(), self._read_own()

    def after_step(self) -> None:
        now = self._clock()
        if now - self._last[0] < self._interval:
            return
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        if busy0 is None or busy1 is None:
            return
        if t1 - t0 > _STALE_INTERVALS * self._interval:
            # No step ended for a while (start-up, an idle server, one long step): the window
            # says little about now, and it may hold this process's children (the kernel
            # compiler), which process_time does not count as ours.  Measure afresh from here.
            return
        # Others' CPU time = all busy time on our cores less our own (our threads may also run
        # elsewhere when the affinity is wider than the cores read; clamp at 0).
        self.other_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        threads = threads_for_free_cores(len(self.cpus) - self.other_cores, self.max_threads)
        if threads != self.threads:  # DEBUG: nothing for a user to act on, and it lands amid streamed text
            logger.debug(
                "threads %d -> %d: other processes used %.2f of %d cores over the last %.1f s",
                self.threads,
                threads,
                self.other_cores,
                len(self.cpus),
                t1 - t0,
            )
            self.threads = threads
            self._set_threads(threads)
