"""Shared fixtures.  Engines on the real model are costly to build, so the
dequantized weights are loaded once per session and engines are reused."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import gc
import os
import weakref

# Engines leave their KV caches to be committed as used (this process and the servers it starts):
# the suite holds many engines of the default 4 GiB at once.  tests/test_engine.py checks the default.
os.environ["PAGEDLLM_COMMIT_KV_CACHE"] = "0"

import pytest

import pagedllm.execution.rank_model
from pagedllm import LLM
from pagedllm.engine import LLMEngine
from pagedllm.models.loader import default_model_path
from pagedllm.testing.memory_watch import GIB, PeakMemoryWatch, parse_gib, tree_memory

_load_weights = pagedllm.execution.rank_model.load_weights
_cached_load = functools.cache(_load_weights)


def _load_shared(path, *args, **kwargs):
    """The default model's state dicts are kept for the session; any other model's (Gemma 3's
    float32 copy is over 1 GB) is loaded afresh, so it is freed with its engine."""
    if str(path) == str(default_model_path()):
        return _cached_load(path, *args, **kwargs)
    return _load_weights(path, *args, **kwargs)


@pytest.fixture(autouse=True, scope="session")
def _share_loaded_weights():
    """Every engine on the default model in the test session copies from one state dict."""
    pagedllm.execution.rank_model.load_weights = _load_shared
    yield
    pagedllm.execution.rank_model.load_weights = _load_weights


_engines_built: list[weakref.ref] = []  # the engines built during the running test
_build_engine = LLMEngine.__init__


def _tracked_init(self: LLMEngine, *args, **kwargs) -> None:
    _build_engine(self, *args, **kwargs)
    _engines_built.append(weakref.ref(self))


LLMEngine.__init__ = _tracked_init


@pytest.fixture(autouse=True)
def _no_blocks_held_after_the_test(request):
    """Every engine a test built (and the shared ones it used, checked by `make_llm`) holds no KV
    block and no request when the test ends.  `@pytest.mark.engine_left_broken` exempts a test
    whose engine is meant to end unusable (a killed worker, a forward pass that always fails)."""
    _engines_built.clear()
    yield
    if not request.node.get_closest_marker("engine_left_broken"):
        for ref in _engines_built:
            engine = ref()
            if engine is not None:
                assert_engine_holds_nothing(engine)
    _engines_built.clear()
    _keep_what_is_held_small()


# What this process may hold between tests: engines freed with their test but caught in a
# reference cycle wait for the cycle collector, which counts objects, not bytes, so a few
# engines' tensors could pile up for many tests; past this bound they are collected, then the
# shared engines dropped.  The suite's peak is this plus what the biggest test builds.
_HELD_BETWEEN_TESTS = 3 * 2**30
# Late in the suite what stays after a collection (modules, the transformers reference, the
# allocator's heap) can itself pass the bound; from there a collection runs again only once the
# process has grown this much past the least it held at a test's end since the last one (the
# least, not what the collection left: a module's fixtures, freed after its last test's end,
# are in that).  Collecting after every test instead cost ~1 s a test, the cycle collector
# walking the whole heap (270 tests, 268 s of a 26-minute suite), and dropped the shared engines
# that the next test built again.
_GROWTH_BEFORE_COLLECTING = 128 * 2**20
_least_held: int | None = None


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _keep_what_is_held_small() -> None:
    global _least_held
    held = _resident_bytes()
    if _least_held is not None:
        _least_held = min(_least_held, held)
    if held <= _HELD_BETWEEN_TESTS or (_least_held is not None and held <= _least_held + _GROWTH_BEFORE_COLLECTING):
        return
    gc.collect()
    if _resident_bytes() > _HELD_BETWEEN_TESTS:
        release_shared_engines()
    ctypes.CDLL(None).malloc_trim(0)  # freed heap back to the OS (the engines keep up to 1 GiB of it)
    _least_held = _resident_bytes()


def assert_engine_holds_nothing(engine: LLMEngine) -> None:
    kv = engine.kv_cache
    # Resident LoRA adapters' pages are held by the adapters, not by requests; they must be theirs.
    paged = engine.adapters._paged
    assert kv.num_page_blocks == sum(p.num_blocks for p in paged.values())
    assert kv.num_free_blocks + kv.num_page_blocks == kv.num_blocks, f"{kv.num_used_blocks} KV blocks still held"
    assert not kv.block_tables
    if hasattr(kv, "pool"):
        pages = {b for p in paged.values() for b in range(p.first_block, p.first_block + p.num_blocks)}
        assert all(count == (b in pages) for b, count in enumerate(kv.pool.ref_counts))
    else:
        assert kv.holes == [(0, kv.num_blocks)]  # contiguous: one hole again
    assert not engine.has_unfinished_requests()


def assert_no_blocks_held(llm: LLM) -> None:
    assert_engine_holds_nothing(llm.engine)


# At most this many shared engines stay alive: each holds about 1 GB (its weights' packed copies
# and the KV cache pages it touched), and a session that kept every one it built reached 23 GB,
# leaving the tests that start worker processes of their own too little memory.
_MAX_SHARED_ENGINES = 3
_shared_engines: collections.OrderedDict[tuple, LLM] = collections.OrderedDict()


def _llm(**kwargs) -> LLM:
    # The shared engines hold the GGUF dequantized and a float32 KV cache (as the transformers
    # reference does) unless a test asks for weights="native" or another cache dtype;
    # tests/test_quantized.py and tests/test_kv_cache_dtype.py check those paths against them.
    key = tuple(sorted(kwargs.items()))
    if key in _shared_engines:
        _shared_engines.move_to_end(key)
        return _shared_engines[key]
    while len(_shared_engines) >= _MAX_SHARED_ENGINES:
        _shared_engines.popitem(last=False)
    gc.collect()  # the evicted engine's tensors go before the new one allocates its own
    defaults = {"weights": "dequantized", "kv_cache_dtype": "float32"}
    llm = LLM(dtype="float32", **(defaults | kwargs))
    _shared_engines[key] = llm
    return llm


def release_shared_engines() -> None:
    """Drop the SmolLM2 engines `make_llm` keeps for later tests (each holds its weights, their
    packed copies and a KV cache): for a test that needs the machine's memory for itself."""
    _shared_engines.clear()
    gc.collect()


@contextlib.contextmanager
def llm_factory():
    """Yields make(**engine_args) -> a float32 SmolLM2 engine (weights dequantized and a float32 KV
    cache unless given), shared between tests with the same arguments; on exit, every KV block of
    those engines must be free."""
    used: list[weakref.ref] = []  # weak: a released shared engine is freed, not kept for this check

    def make(**kwargs) -> LLM:
        llm = _llm(**kwargs)
        used.append(weakref.ref(llm))
        return llm

    yield make
    for ref in used:
        if (llm := ref()) is not None:
            assert_no_blocks_held(llm)


@pytest.fixture
def make_llm():
    with llm_factory() as make:
        yield make


@pytest.fixture(scope="session")
def hf_model():
    """The transformers reference on the same GGUF weights, float32."""
    from pagedllm.testing.hf_reference import hf_model_from_gguf

    return hf_model_from_gguf(default_model_path())


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of two nodes, one CPU each (Ray's own multi-node test cluster); a module's
    tests share it, and the driver is disconnected when it goes."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


# The suite's memory bound: the pytest process and every process it starts, summed (PSS), must
# stay under PAGEDLLM_TEST_MEMORY_GIB (8 by default, what CI allows); above it the run fails.
_memory_watch = PeakMemoryWatch()


def pytest_sessionstart(session) -> None:
    _memory_watch.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _memory_watch.label = item.nodeid
    before = tree_memory(os.getpid())[0]
    yield
    log = os.environ.get("PAGEDLLM_TEST_MEMORY_LOG")  # a line a test: what it started with, its peak
    if log:
        with open(log, "a") as f:
            peak = _memory_watch.peak_by_label.get(item.nodeid, 0)
            f.write(f"{before / GIB:6.2f} {peak / GIB:6.2f} {item.nodeid}\n")


def pytest_sessionfinish(session, exitstatus) -> None:
    peak = _memory_watch.stop()
    bound = parse_gib(os.environ.get("PAGEDLLM_TEST_MEMORY_GIB", "8"))
    session.config._memory_report = (peak, bound)
    if peak.total_bytes > bound * GIB and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    peak, bound = config._memory_report
    own = PeakMemoryWatch.own_high_water_bytes()
    verdict = "over the bound: FAILED" if peak.total_bytes > bound * GIB else "within the bound"
    terminalreporter.write_line(
        f"peak memory {peak.total_bytes / GIB:.2f} GiB (PSS of pytest and its {peak.processes - 1} child "
        f"processes, sampled every {_memory_watch.interval} s; pytest's own peak RSS {own / GIB:.2f} GiB) "
        f"during {peak.label or 'collection'}: {verdict} of {bound:g} GiB"
    )
    for label, total in _memory_watch.largest(5):
        terminalreporter.write_line(f"  {total / GIB:6.2f} GiB  {label or 'collection'}")
