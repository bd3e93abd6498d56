"""The engine on a CUDA GPU (skipped without one; `benchmarks/gpu_check.py` runs these there).

Tiny random checkpoints built here (llama with untied head, qwen2 with QKV biases, gemma3 with
a sliding window shorter than the prompts): greedy tokens identical to transformers on the
same GPU in float32; CUDA graphs give the eager path's tokens, with prefix hits, chunked
prefill, preemption, n>1 forks and beam search; every block is freed; the KV cache is sized
from gpu_memory_utilization."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.testing.hf_reference import greedy, hf_greedy, save_random_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    initializer_range=0.05,
)
MODELS = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    # 6 layers: 5 sliding and 1 full, so 6 layer groups whose sliding blocks are freed as requests run
    "gemma3": ("gemma3_text", dict(sliding_window=24, num_hidden_layers=6)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    model_type, extra = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(path, model_type, **{**SHAPE, **extra})
    return path, hf


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 90, (count,), generator=gen).tolist()
    return [torch.randint(100, 49152, (n,), generator=gen).tolist() for n in lengths]


def engine(path, **kwargs) -> LLM:
    args = dict(device="cuda", dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)
    return LLM(str(path), **{**args, **kwargs})


def close(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables, "KV blocks still held"
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_greedy_tokens_match_transformers_on_the_gpu(checkpoint):
    path, hf = checkpoint
    hf = hf.to("cuda", torch.float32)
    batch = prompts(6)
    expected = [hf_greedy(hf, p, 16) for p in batch]
    for eager in (True, False):
        llm = engine(path, enforce_eager=eager)
        assert llm.engine.device == "cuda:0"
        alone = [llm.generate([p], greedy(16))[0].token_ids for p in batch]
        together = [o.token_ids for o in llm.generate(batch, greedy(16))]
        assert alone == expected and together == expected, f"enforce_eager={eager}"
        if not eager:
            assert llm.engine.runner.graphs.replays > 0
        close(llm)
    hf.to("cpu")


def run_features(path, enforce_eager: bool) -> dict:
    # A cache too small for all requests at once (preemption), a small token budget (chunked prefill).
    llm = engine(
        path,
        enforce_eager=enforce_eager,
        kv_cache_memory="2MiB",
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=8,
    )
    shared = prompts(1, seed=5)[0][:40]
    batch = [shared + p[:30] for p in prompts(20, seed=6)]
    out = {
        "greedy": [o.token_ids for o in llm.generate(batch, greedy(24))],
        "samples": [
            c.token_ids
            for c in llm.generate(batch[0], SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=12))[0].outputs
        ],
        "beams": [h.token_ids for h in llm.beam_search([batch[1]], beam_width=3, max_tokens=8)[0].outputs],
        "preemptions": llm.engine.scheduler.num_preemptions,
        "hits": llm.engine.scheduler.prefix_cache_hit_tokens,
        "replays": llm.engine.runner.graphs.replays if llm.engine.runner.graphs else 0,
    }
    close(llm)
    return out


def test_cuda_graphs_give_the_eager_tokens(checkpoint):
    path, _ = checkpoint
    eager = run_features(path, enforce_eager=True)
    graphs = run_features(path, enforce_eager=False)
    assert eager["preemptions"] > 0 and eager["hits"] > 0
    assert graphs["replays"] > 0 and eager["replays"] == 0
    for key in ("greedy", "samples", "beams"):
        assert graphs[key] == eager[key], key


def test_the_kv_cache_is_sized_from_gpu_memory_utilization(checkpoint, caplog):
    path, _ = checkpoint
    total = torch.cuda.get_device_properties(0).total_memory
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(str(path), device="cuda", gpu_memory_utilization=0.3, max_model_len=1024)
    kv_bytes = llm.engine.runner.kv_cache_bytes
    assert 0.15 * total < kv_bytes < 0.3 * total
    assert any("GPU memory:" in r.message and "KV cache" in r.message for r in caplog.records)
    assert llm.engine.dtype == torch.bfloat16  # auto on CUDA
    assert len(llm.generate(prompts(2), greedy(4))) == 2
    close(llm)


def test_attention_that_only_runs_on_the_cpu_is_refused_on_cuda(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="runs on the CPU; on CUDA use attention='auto' or 'triton'"):
        engine(path, attention="cpp")
