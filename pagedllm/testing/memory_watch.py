"""The peak memory of a process and every process it starts, sampled from /proc.

The test suite's bound (8 GiB by default) is a bound on the machine's memory, so it counts the
pytest process and its descendants together: servers, replicas, tensor-parallel ranks, Ray's own
processes.  Each process counts its proportional set size (PSS: a page shared by n processes counts
1/n in each), so a model file mapped by a server and its parent is not counted twice.  The sum is
sampled every `interval` seconds; a spike shorter than that can be missed, so the pytest process's
own high-water mark (`ru_maxrss`, exact) is reported beside it as a lower bound."""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class MemorySample:
    total_bytes: int  # PSS summed over the process tree
    processes: int
    label: str  # what was running (a test's id) when the sample was taken


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the process ended between listdir and open
        # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant of it."""
    children = _children_by_parent()
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, ()))
    return tree


def proportional_set_size(pid: int) -> int:
    """PSS of one process in bytes (0 if it ended or cannot be read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def tree_memory(root: int) -> tuple[int, int]:
    """(summed PSS in bytes, number of processes) of `root`'s process tree."""
    pids = process_tree(root)
    return sum(proportional_set_size(pid) for pid in pids), len(pids)


class PeakMemoryWatch:
    """Samples `tree_memory(os.getpid())` on a daemon thread until `stop()`; `peak` is the largest
    sample, labelled with `label` as it was when that sample was taken."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.label = ""
        self.peak = MemorySample(0, 0, "")
        self.peak_by_label: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory-watch", daemon=True)

    def start(self) -> PeakMemoryWatch:
        self._thread.start()
        return self

    def largest(self, count: int) -> list[tuple[str, int]]:
        """The `count` labels with the largest peaks, largest first."""
        return sorted(self.peak_by_label.items(), key=lambda item: -item[1])[:count]

    def stop(self) -> MemorySample:
        self._stop.set()
        self._thread.join()
        return self.peak

    def _run(self) -> None:
        root = os.getpid()
        while not self._stop.is_set():
            total, count = tree_memory(root)
            label = self.label
            if total > self.peak.total_bytes:
                self.peak = MemorySample(total, count, label)
            if total > self.peak_by_label.get(label, 0):
                self.peak_by_label[label] = total
            self._stop.wait(self.interval)

    @staticmethod
    def own_high_water_bytes() -> int:
        """This process's exact peak resident set (Linux reports kilobytes)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def parse_gib(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"a memory bound must be a positive number of GiB, not {text!r}")
    return value


def _main() -> None:  # `python -m pagedllm.testing.memory_watch PID`: one sample, for a person
    import sys

    pid = int(sys.argv[1]) if len(sys.argv) > 1 else os.getpid()
    total, count = tree_memory(pid)
    print(f"{total / GIB:.2f} GiB PSS in {count} processes under pid {pid} at {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    _main()
