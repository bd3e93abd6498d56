"""The CUDA path's pieces that need no GPU: device choice and its errors, the GPU memory plan
on given numbers, the decode-graph ladder and padding, and the step inputs a graph reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, EngineConfig
from pagedllm.core.step_message import ChunkPlan
from pagedllm.execution.cuda_graphs import GraphLayout, graph_batch_sizes, padded_batch_size
from pagedllm.execution.device import resolve_device, resolve_dtype
from pagedllm.execution.startup_checks import plan_gpu_memory

GiB = 2**30


def test_auto_is_cuda_only_where_torch_sees_a_gpu():
    assert resolve_device("auto", False, 0, None) == "cpu"
    assert resolve_device("auto", True, 2, "13.0") == "cuda:0"
    assert resolve_device("cpu", True, 2, "13.0") == "cpu"
    assert resolve_device("cuda", True, 2, "13.0") == "cuda:0"
    assert resolve_device("cuda:1", True, 2, "13.0") == "cuda:1"


def test_a_gpu_that_is_not_there_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device='cuda' needs a CUDA GPU, but this torch is a CPU-only build"):
        resolve_device("cuda", False, 0, None)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        resolve_device("cuda:0", False, 0, "13.0")
    with pytest.raises(ValueError, match=r"sees 2 CUDA device\(s\), numbered 0 to 1"):
        resolve_device("cuda:2", True, 2, "13.0")
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        resolve_device("cuda:x", True, 2, "13.0")
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        EngineConfig(device="gpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_llm_on_cuda_without_a_gpu_fails_before_loading_anything():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        LLM(device="cuda")


def test_dtype_auto_is_bfloat16_on_cuda():
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("float32", "cuda:0") == torch.float32


def test_the_kv_cache_gets_the_budget_less_everything_else():
    plan = plan_gpu_memory(
        total=140 * GiB,
        utilization=0.9,
        in_use_at_start=1 * GiB,
        weights=2 * GiB,
        peak_activations=3 * GiB,
        cuda_graphs=GiB // 2,
    )
    assert plan.budget == int(140 * GiB * 0.9)
    assert plan.kv_cache == plan.budget - 1 * GiB - 2 * GiB - 3 * GiB - GiB // 2
    text = plan.describe()
    assert "126.0 GiB of 140.0 GiB (90%" in text and "KV cache 119.5 GiB" in text


def test_nothing_left_for_the_kv_cache_names_the_setting_that_helps():
    # 10 GiB at 0.5 is 5 GiB; 6 GiB are needed: 0.6 of the device would do.
    with pytest.raises(ValueError, match=r"no GPU memory is left for the KV cache.*--gpu-memory-utilization to 0\.61"):
        plan_gpu_memory(10 * GiB, 0.5, 1 * GiB, 3 * GiB, 2 * GiB, 0)
    # Even the whole device would not do: other processes hold it.
    with pytest.raises(ValueError, match="free the GPU"):
        plan_gpu_memory(10 * GiB, 0.9, 8 * GiB, 3 * GiB, 2 * GiB, 0)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        plan_gpu_memory(10 * GiB, 0, 0, 0, 0, 0)


def test_graph_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(10_000)[-1] == 512  # larger decode steps run eagerly
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_a_step_pads_to_the_smallest_graph_that_holds_it():
    sizes = graph_batch_sizes(256)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 255, 256)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 256, 256,
    ]  # fmt: skip
    assert padded_batch_size(257, sizes) is None
    for n in range(1, 257):  # never more than 15 padding rows past 8
        padded = padded_batch_size(n, sizes)
        assert padded >= n and (padded - n < 16 if n > 8 else padded <= 2 * n)


def test_graph_inputs_are_the_steps_and_padding_reads_nothing():
    layout = GraphLayout(batch=4, max_blocks=3)
    host = np.full(layout.size + 5, -7, dtype=np.int64)  # stale values from an earlier step
    block_size, padding_block = 4, 24
    chunks = [ChunkPlan(0, 5, [11], [7, 2], 1, 5), ChunkPlan(1, 0, [12], [5], 1, 1)]
    layout.fill(host[: layout.size], chunks, block_size, padding_block)
    ids, positions, seq_lens, slots, tables = layout.split(host)
    assert ids.tolist() == [11, 12, 0, 0]
    assert positions.tolist() == [5, 0, 0, 0]
    pad = padding_block * block_size
    assert slots.tolist() == [[2 * 4 + 1, 5 * 4 + 0, pad, pad]]  # position 5: block 2, offset 1
    assert seq_lens.tolist() == [6, 1, 0, 0]  # padding rows have no context: attention reads no key
    assert tables.tolist() == [[[7, 2, 24], [5, 24, 24], [24, 24, 24], [24, 24, 24]]]
    assert host[layout.size :].tolist() == [-7] * 5  # nothing written past the graph's inputs


def test_graph_inputs_with_layer_groups_split_the_interleaved_table():
    """Two groups: a table holds each block's two entries side by side; a freed one (-1) is padding."""
    layout = GraphLayout(batch=2, max_blocks=3, groups=2)
    host = np.zeros(layout.size, dtype=np.int64)
    chunks = [ChunkPlan(0, 9, [11], [-1, 4, 6, 8, 3, 1], 1, 9)]  # blocks 0-2: (full, sliding) entries
    layout.fill(host, chunks, 4, 24)
    _, _, seq_lens, slots, tables = layout.split(host)
    assert tables[:, 0].tolist() == [[24, 6, 3], [4, 8, 1]]  # group 0 had block 0 freed
    assert slots[:, 0].tolist() == [3 * 4 + 1, 1 * 4 + 1]  # position 9: block 2, offset 1, in each group
    assert slots[:, 1].tolist() == [24 * 4, 24 * 4]


def test_cpu_class_hides_newer_flags_and_picks_the_dtype(monkeypatch):
    """PAGEDLLM_CPU_CLASS makes pagedllm choose as on an older CPU: AVX2 hides every AVX-512 and
    AMX flag (so `auto` is float32), avx512 hides bfloat16 and AMX; an unknown class is refused,
    and so is a class this CPU lacks the instructions of (its kernels could not run here)."""
    import pytest

    from pagedllm.layers.cpu_kernels import cpu_flags

    monkeypatch.setenv("PAGEDLLM_CPU_CLASS", "avx2")
    flags = set(cpu_flags().split())
    assert not {f for f in flags if f.startswith(("avx512", "amx"))}
    assert resolve_dtype("auto") == torch.float32
    has_avx512 = "avx512f" in flags or "avx512f" in open("/proc/cpuinfo").read()
    monkeypatch.setenv("PAGEDLLM_CPU_CLASS", "avx512")
    if has_avx512:
        assert not {"avx512_bf16", "amx_bf16"} & set(cpu_flags().split())
        assert resolve_dtype("auto") == torch.float32
    else:
        with pytest.raises(ValueError, match="lacks avx512f"):
            cpu_flags()
    monkeypatch.setenv("PAGEDLLM_CPU_CLASS", "sse2")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_CLASS"):
        cpu_flags()


def test_a_class_hides_exactly_the_flags_its_run_leaves_out(monkeypatch):
    """`hidden_cpu_flags` is what `.ci/run` reads to skip a class that is the CPU's own: the
    visible and hidden flags together are the CPU's, and no flag is both."""
    from pagedllm.layers.cpu_kernels import _proc_cpu_flags, cpu_flags, hidden_cpu_flags

    monkeypatch.setenv("PAGEDLLM_CPU_CLASS", "native")
    assert hidden_cpu_flags() == []
    monkeypatch.setenv("PAGEDLLM_CPU_CLASS", "avx2")
    hidden, visible = set(hidden_cpu_flags()), set(cpu_flags().split())
    assert hidden | visible == set(_proc_cpu_flags()) and not hidden & visible
    assert ("avx512f" in hidden) == ("avx512f" in _proc_cpu_flags())
