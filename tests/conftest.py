"""Shared fixtures.  Engines on the real model are costly to build, so the
dequantized weights are loaded once per session and engines are reused."""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch

import pagedllm.execution.rank_model
from pagedllm import LLM
from pagedllm.models.loader import default_model_path

_cached_load = functools.cache(pagedllm.execution.rank_model.load_weights)


@pytest.fixture(autouse=True, scope="session")
def _share_loaded_weights():
    """Every engine in the test session copies from one dequantized state dict."""
    original = pagedllm.execution.rank_model.load_weights
    pagedllm.execution.rank_model.load_weights = _cached_load
    yield
    pagedllm.execution.rank_model.load_weights = original


def assert_no_blocks_held(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_used_blocks} KV blocks still held"
    assert not kv.block_tables
    if hasattr(kv, "pool"):
        assert all(count == 0 for count in kv.pool.ref_counts)
    else:
        assert kv.holes == [(0, kv.num_blocks)]  # contiguous: one hole again
    assert not llm.engine.has_unfinished_requests()


@functools.cache
def _llm(**kwargs) -> LLM:
    return LLM(dtype="float32", **kwargs)


def release_shared_engines() -> None:
    """Drop the SmolLM2 engines `make_llm` keeps for later tests (each holds its weights, their
    packed copies and a KV cache): for a test that needs the machine's memory for itself."""
    _llm.cache_clear()
    gc.collect()


@contextlib.contextmanager
def llm_factory():
    """Yields make(**engine_args) -> a float32 SmolLM2 engine, shared between tests
    with the same arguments; on exit, every KV block of those engines must be free."""
    used: list[LLM] = []

    def make(**kwargs) -> LLM:
        llm = _llm(**kwargs)
        used.append(llm)
        return llm

    yield make
    for llm in used:
        assert_no_blocks_held(llm)


@pytest.fixture
def make_llm():
    with llm_factory() as make:
        yield make


@pytest.fixture(scope="session")
def hf_model():
    """The transformers reference on the same GGUF weights, float32."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
