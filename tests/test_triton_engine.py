"""The whole engine with the Triton attention kernel, run on CPU tensors by Triton's interpreter:
a tiny random llama (head_dim 64) and a tiny Gemma 3 (sliding windows) give the C++ path's
greedy tokens with prefix hits, chunked prefill, forced preemption, n>1 forks and beam search,
and every block is free afterwards.  (The GPU path itself needs a GPU; this proves the engine
drives the kernel correctly.)"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels on the CPU

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.testing.hf_reference import greedy, save_random_model  # noqa: E402

SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=256,
    initializer_range=0.1,
)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        save_random_model(path, "llama", **SHAPE, tie_word_embeddings=False)
    else:
        save_random_model(path, "gemma3_text", **{**SHAPE, "num_hidden_layers": 2}, sliding_window=12)
    return path


def run(path, attention: str, **engine) -> dict:
    # A cache too small for the four requests together: some are preempted and recomputed.
    # A float32 KV cache for both kernels (the C++ ones would take float16 by default).
    args = dict(dtype="float32", kv_cache_dtype="float32", block_size=8, max_num_batched_tokens=24, attention=attention)
    args |= engine
    with LLM(str(path), **args) as llm:
        gen = torch.Generator().manual_seed(3)
        shared = torch.randint(1000, 49152, (17,), generator=gen).tolist()
        prompts = [shared + torch.randint(1000, 49152, (n,), generator=gen).tolist() for n in (3, 9, 20)]
        prompts.append(shared)  # a whole-prompt prefix hit on the first request's blocks
        # n=3 forks that draw different tokens.  top_k=2: the two kernels sum in different orders, and
        # a draw over the whole vocabulary flipped where it landed within that noise (outputs 1e-5
        # apart) of a step of the cumulative distribution; over two tokens there is one such step.
        forks = SamplingParams(n=3, temperature=0.9, top_k=2, seed=4, max_tokens=8)
        out = {
            "greedy": [o.token_ids for o in llm.generate(prompts, greedy(12))],
            "samples": [c.token_ids for c in llm.generate(prompts[0], forks)[0].outputs],
            "beams": [h.token_ids for h in llm.beam_search([prompts[1]], beam_width=3, max_tokens=6)[0].outputs],
            "preemptions": llm.engine.scheduler.num_preemptions,
            "hits": llm.engine.scheduler.prefix_cache_hit_tokens,
        }
        assert len({tuple(s) for s in out["samples"]}) > 1, "the forks should draw different tokens"
        kv = llm.engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
    return out


def test_the_triton_kernel_drives_the_engine_like_the_cpp_kernels(checkpoint):
    # Blocks of 8 tokens, float32, K and V: 12 for llama; 8 for Gemma 3, whose sliding layers give
    # blocks back (so the four requests still run out of room and one is preempted).
    blocks = 8 if checkpoint.name.startswith("gemma3") else 12
    memory = f"{blocks * 8 * 2 * SHAPE['num_hidden_layers'] * 64 * 4}"
    cpp = run(checkpoint, "cpp", kv_cache_memory=memory)
    triton = run(checkpoint, "triton", kv_cache_memory=memory)
    assert cpp["preemptions"] > 0 and cpp["hits"] > 0
    assert triton == cpp


def test_decode_graph_inputs_and_padding_give_the_eager_tokens(checkpoint):
    """The decode-graph bookkeeping (the ladder, padded rows, the shared input buffer, fork rows)
    on the CPU: "replay" re-runs the forward pass over the graph's static inputs."""
    from pagedllm.execution.cuda_graphs import DecodeGraphs, EagerCapture

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1000, 49152, (n,), generator=gen).tolist() for n in (5, 9, 14)]
    # A small cache: the test needs a few blocks, not the default 4 GiB of the machine's memory.
    args = dict(dtype="float32", block_size=8, attention="triton", max_model_len=64, kv_cache_memory="64MiB")
    with LLM(str(checkpoint), **args) as llm:
        eager = [o.token_ids for o in llm.generate(prompts, greedy(6))]
        forks = llm.generate(prompts[0], SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=4))[0].outputs
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(runner, max_num_seqs=4, max_model_len=64, capture=EagerCapture())
        assert runner.graphs.sizes == [1, 2, 4]
        graphed = [o.token_ids for o in llm.generate(prompts, greedy(6))]  # 3 decodes padded to 4
        graphed_forks = llm.generate(prompts[0], SamplingParams(n=2, temperature=0.9, seed=4, max_tokens=4))[0]
        assert runner.graphs.replays > 0
        kv = llm.engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
    assert graphed == eager
    assert [c.token_ids for c in graphed_forks.outputs] == [c.token_ids for c in forks]
