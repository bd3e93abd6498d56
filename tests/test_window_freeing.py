"""Sliding-window layers give blocks back while a request runs (core/layer_groups.py and the
KV cache manager), and the engine's tokens do not change: pure-Python rules and a property test,
then tiny Gemma 3 and Mistral checkpoints with freeing on and off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.core.arith import cdiv
from pagedllm.core.kv_cache_manager import FREED, KVCacheManager
from pagedllm.core.layer_groups import group_layers
from pagedllm.testing.hf_reference import greedy, save_random_model

GEMMA_270M_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_gemma_270m_layers_make_one_full_and_five_sliding_groups_of_three():
    groups = group_layers(GEMMA_270M_WINDOWS)
    assert groups.group_size == 3 and groups.windows == (512, 512, 512, 512, 512, 0)
    assert [groups.layer_group[i] for i in (5, 11, 17)] == [5, 5, 5]  # the full layers
    assert [groups.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert sorted(zip(groups.layer_group, groups.layer_slot)) == [(g, s) for g in range(6) for s in range(3)]
    assert "1 full, 5 sliding with window 512" in groups.describe()


def test_models_without_a_mix_make_one_group():
    assert group_layers((0,) * 30).windows == (0,)  # llama: one block holds all 30 layers
    assert group_layers((4096,) * 8).windows == (4096,)  # mistral: every layer slides
    assert group_layers(GEMMA_270M_WINDOWS, window_freeing=False).windows == (0,)
    mixed = group_layers((20, 0, 0, 0))  # qwen2 with one windowed layer: groups of one layer
    assert mixed.windows == (20, 0, 0, 0) and mixed.group_size == 1


def test_a_sliding_group_gives_back_blocks_its_window_left_behind():
    # Two groups (full, window 6), blocks of 4 tokens: entries interleave (full, sliding) per block.
    kv = KVCacheManager(40, 4, group_windows=(0, 6))
    assert kv.allocate_slots("a", 9) is not None  # 3 blocks of tokens: 6 entries
    assert len(kv.block_table("a")) == 6 and kv.num_used_blocks == 6
    # Next position 9 sees keys 4..9: block 0 (positions 0-3) is out of every later window.
    kv.allocate_slots("a", 10, num_computed_tokens=9)
    table = kv.block_table("a")
    assert table[1] == FREED and FREED not in table[0::2] and kv.num_blocks_freed_by_window == 1
    kv.allocate_slots("a", 16, num_computed_tokens=15)  # keys 10..15 from now on: block 1 goes too
    assert table[3] == FREED and table[5] != FREED and kv.num_used_blocks == 4 + 2
    kv.free("a")
    assert kv.num_free_blocks == 40 and all(c == 0 for c in kv.pool.ref_counts)


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_group():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True, group_windows=(0, 5))
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    kv.allocate_slots("a", 21)
    kv.cache_full_blocks("a", prompt, 21)
    kv.allocate_slots("a", 22, num_computed_tokens=21)  # frees the sliding blocks of positions < 17
    hits = kv.find_cached_prefix(prompt + [7, 8])  # 23 tokens: up to 5 blocks may hit
    assert kv.cached_tokens(hits) == 20
    sliding = hits[1::2]
    # Computing from position 20: keys 16..20 are needed, so block 4 only; blocks 0-3 not taken.
    assert sliding[:4] == [FREED] * 4 and sliding[4] != FREED and FREED not in hits[0::2]
    assert kv.allocate_slots("b", 23, cached_blocks=hits) is not None
    assert kv.block_table("b")[:10] == hits


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 12),
    full_groups=st.integers(0, 2),
    ops=st.lists(
        st.tuples(st.sampled_from(["start", "grow", "fork", "free"]), st.integers(0, 4), st.integers(1, 9)),
        max_size=60,
    ),
)
def test_window_freeing_never_leaks_and_never_frees_a_block_a_window_reads(block_size, window, full_groups, ops):
    windows = (window,) * 2 + (0,) * full_groups
    num_groups = len(windows)
    kv = KVCacheManager(200, block_size, enable_prefix_caching=True, group_windows=windows)
    lengths: dict[str, int] = {}
    tokens = list(range(1000, 1200))
    for op, rid, amount in ops:
        request_id = f"r{rid}"
        if op == "start" and request_id not in lengths:
            hits = kv.find_cached_prefix(tokens[: amount + 1])
            cached = kv.cached_tokens(hits)
            if kv.allocate_slots(request_id, amount + 1, cached_blocks=hits) is not None:
                lengths[request_id] = amount + 1
                kv.cache_full_blocks(request_id, tokens, amount + 1)
            assert cached <= amount
        elif op == "grow" and request_id in lengths:  # a chunk of `amount` tokens after the computed ones
            done = lengths[request_id]
            if kv.allocate_slots(request_id, done + amount, num_computed_tokens=done) is not None:
                # Before the step writes: every position the chunk's queries see is held, in every group.
                table = kv.block_table(request_id)
                for g, w in enumerate(windows):
                    first = 0 if w == 0 else max(0, done - w + 1)
                    entries = table[g::num_groups]
                    assert all(entries[p // block_size] != FREED for p in range(first, done + amount))
                    held = sum(1 for b in entries[: cdiv(done, block_size)] if b != FREED)
                    if w:  # a sliding group holds only its window's blocks of what was computed
                        assert held <= cdiv(w - 1, block_size) + 1
                lengths[request_id] = done + amount
                kv.cache_full_blocks(request_id, tokens, done + amount)
        elif op == "fork" and request_id in lengths:
            child = f"{request_id}.{amount}"
            if child not in lengths:
                kv.fork(request_id, child)
                lengths[child] = lengths[request_id]
        elif op == "free" and request_id in lengths:
            kv.free(request_id)
            del lengths[request_id]

        held = [b for table in kv.block_tables.values() for b in table if b != FREED]
        for block in set(held):  # every held entry is a live block with one count per holder
            assert kv.pool.ref_counts[block] == held.count(block) and not kv.pool.is_free(block)
        assert len(set(held)) + kv.num_free_blocks == 200
    for request_id in list(lengths):
        kv.free(request_id)
    assert kv.num_free_blocks == 200 and all(c == 0 for c in kv.pool.ref_counts)


def test_the_scheduler_admits_a_request_by_its_window_not_its_length():
    kv = KVCacheManager(40, 4, group_windows=(0, 8, 8))
    # 100 tokens: 25 blocks in the full group, but a sliding group holds its window and one chunk.
    assert kv.max_blocks_held(100, max_chunk_tokens=16) == 25 + 2 * (cdiv(8 - 1 + 16, 4) + 1)
    assert kv.max_blocks_held(100) == 3 * 25  # a whole prompt as one chunk: every block at once


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    layers = 6 if request.param == "gemma3" else 2
    if request.param == "gemma3":  # 6 layers: 5 sliding and 1 full, groups of one layer
        save_random_model(path, "gemma3_text", **shape, num_hidden_layers=layers, sliding_window=16)
    else:
        save_random_model(path, "mistral", **shape, num_hidden_layers=layers, sliding_window=16)
    return path, layers


def run(checkpoint, window_freeing: bool) -> dict:
    path, layers = checkpoint
    # A cache of 200 tokens at full length in every layer (preemption when nothing is freed), and a
    # small token budget (chunks across the window edge).
    memory = 200 * layers * 2 * 64 * 2  # float16 K and V (auto beside float32)
    args = dict(dtype="float32", block_size=4, kv_cache_memory=memory, max_num_batched_tokens=24, max_model_len=128)
    with LLM(str(path), window_freeing=window_freeing, **args) as llm:
        gen = torch.Generator().manual_seed(1)
        shared = torch.randint(1000, 49152, (30,), generator=gen).tolist()
        prompts = [shared + torch.randint(1000, 49152, (n,), generator=gen).tolist() for n in (2, 9, 21, 40)]
        sampled = SamplingParams(n=3, temperature=0.9, seed=2, max_tokens=24)
        out = {
            "greedy": [o.token_ids for o in llm.generate(prompts, greedy(40))],
            "again": [o.token_ids for o in llm.generate(prompts[:2], greedy(8))],  # prefix hits
            "samples": [c.token_ids for c in llm.generate(prompts[1], sampled)[0].outputs],
            "beams": [h.token_ids for h in llm.beam_search([prompts[0]], beam_width=2, max_tokens=20)[0].outputs],
        }
        engine = llm.engine
        stats = {
            "freed": engine.kv_cache.num_blocks_freed_by_window,
            "preemptions": engine.scheduler.num_preemptions,
            "hits": engine.scheduler.prefix_cache_hit_tokens,
        }
        kv = engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
    return out, stats


def test_freeing_window_blocks_changes_no_token(windowed_checkpoint):
    kept, kept_stats = run(windowed_checkpoint, window_freeing=False)
    freed, freed_stats = run(windowed_checkpoint, window_freeing=True)
    assert kept_stats["freed"] == 0 and freed_stats["freed"] > 0
    assert kept_stats["preemptions"] > 0 and freed_stats["hits"] > 0
    assert freed == kept
