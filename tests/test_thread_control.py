"""The adaptive thread count, on made-up CPU-time readings (no real load needed)."""

from __future__ import annotations

import pytest

from pagedllm.execution.thread_control import AdaptiveThreads, busy_seconds, threads_for_free_cores


class FakeMachine:
    """A clock, the busy seconds of every process on our cores, and our own CPU time."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)


def make(machine: FakeMachine, cpus: int = 2, max_threads: int | None = None) -> tuple[AdaptiveThreads, list[int]]:
    calls: list[int] = []
    threads = AdaptiveThreads(
        calls.append,
        max_threads=max_threads,
        cpus=list(range(cpus)),
        read_busy=lambda: machine.busy,
        read_own=lambda: machine.own,
        clock=lambda: machine.now,
    )
    return threads, calls


@pytest.mark.parametrize(
    "free,max_threads,expected",
    [(2.0, 2, 2), (1.8, 2, 2), (1.7, 2, 1), (1.0, 2, 1), (0.0, 2, 1), (-1.0, 2, 1), (7.9, 8, 8), (9.0, 8, 8)],
)
def test_threads_for_free_cores(free: float, max_threads: int, expected: int) -> None:
    assert threads_for_free_cores(free, max_threads) == expected


def test_follows_the_cores_other_processes_take() -> None:
    machine = FakeMachine()
    threads, calls = make(machine)
    assert calls == [2]  # starts with every core
    machine.run(0.5, own_cores=2.0, other_cores=0.0)
    threads.after_step()
    assert threads.threads == 2 and calls == [2]  # under a second: not measured yet
    machine.run(0.6, own_cores=1.4, other_cores=0.6)  # a busy loop took part of a core
    threads.after_step()
    assert threads.threads == 1 and calls == [2, 1]
    assert threads.other_cores == pytest.approx(0.6 * 0.6 / 1.1)  # averaged over the whole 1.1 s
    machine.run(1.0, own_cores=1.0, other_cores=1.0)
    threads.after_step()
    assert calls == [2, 1]  # unchanged: no call
    machine.run(1.0, own_cores=1.0, other_cores=0.05)  # the busy loop ended
    threads.after_step()
    assert threads.threads == 2 and calls == [2, 1, 2]


def test_never_more_threads_than_the_process_started_with() -> None:
    machine = FakeMachine()
    threads, calls = make(machine, cpus=8, max_threads=4)  # e.g. OMP_NUM_THREADS=4 on 8 cores
    assert calls == [4]
    machine.run(1.0, own_cores=4.0, other_cores=2.0)  # 6 cores free: still 4 threads
    threads.after_step()
    assert threads.threads == 4 and calls == [4]
    machine.run(1.0, own_cores=4.0, other_cores=5.0)  # 3 free
    threads.after_step()
    assert threads.threads == 3 and calls == [4, 3]


def test_unreadable_proc_stat_keeps_the_count() -> None:
    machine = FakeMachine()
    calls: list[int] = []
    threads = AdaptiveThreads(calls.append, cpus=[0, 1], read_busy=lambda: None, clock=lambda: machine.now)
    machine.run(5.0, 1.0, 1.0)
    threads.after_step()
    assert threads.threads == 2 and calls == [2]


def test_busy_seconds_reads_only_the_given_cores(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  1000 0 1000 5000 0 0 0 0 0 0\n"
        "cpu0 100 5 50 900 20 1 2 3 0 0\n"
        "cpu1 200 0 100 800 0 0 0 0 0 0\n"
        "cpu2 999 0 999 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    ticks = (100 + 5 + 50 + 1 + 2 + 3) + (200 + 100)  # idle and iowait left out
    assert busy_seconds([0, 1], str(stat)) == pytest.approx(ticks / 100)
    assert busy_seconds([0], str(tmp_path / "missing")) is None


def test_a_window_without_steps_is_not_used() -> None:
    # Start-up (the kernel compiler is a child process: its CPU time looks like another
    # process's) or an idle server: the first window after it is dropped, not acted on.
    machine = FakeMachine()
    threads, calls = make(machine)
    machine.run(15.0, own_cores=0.5, other_cores=0.5)
    threads.after_step()
    assert threads.threads == 2 and calls == [2]
    machine.run(1.1, own_cores=2.0, other_cores=0.0)  # measured afresh from the last sample
    threads.after_step()
    assert threads.threads == 2 and threads.other_cores == 0.0
    machine.run(1.1, own_cores=1.0, other_cores=1.0)  # a busy loop within one window still counts
    threads.after_step()
    assert threads.threads == 1 and calls == [2, 1]


def test_releasing_the_openmp_workers_leaves_torch_computing_the_same():
    """torch's CPU build runs libgomp, which has `omp_pause_resource_all`: the call frees this
    thread's workers, and the next parallel region (here, on another thread too) starts new ones."""
    import threading

    import torch

    from pagedllm.execution.thread_control import release_openmp_workers

    a, b = torch.randn(256, 512), torch.randn(512, 384)
    before = a @ b
    assert release_openmp_workers() is True
    assert torch.equal(a @ b, before)
    results = []
    worker = threading.Thread(target=lambda: results.append(a @ b))
    worker.start()
    worker.join()
    assert torch.equal(results[0], before)
