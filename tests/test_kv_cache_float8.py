"""An 8-bit KV cache (`--kv-cache-dtype float8_e4m3`): float8 e4m3 keys and values beside float32
or bfloat16 activations, on the CPU's C++ attention kernels.  Written as torch rounds to
float8_e4m3fn (nearest even, saturated at +-448), read exactly; the attention math stays in
float32, so every path equals plain attention over the rounded keys and values."""

from __future__ import annotations

import ctypes
import math
import platform

import pytest
import torch
from conftest import assert_no_blocks_held

from pagedllm import SamplingParams
from pagedllm.execution.device import resolve_kv_cache_dtype
from pagedllm.layers.attention import cpp_attention
from pagedllm.layers.cpu_kernels import CpuKernels, build_library, load_cpu_kernels
from tests.test_attention import RAGGED, make_batch, plain_attention

F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("name", ["float8_e4m3", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_runs_beside_either_dtype_on_the_cpu_kernels_only(name, dtype):
    assert resolve_kv_cache_dtype(name, dtype, "cpu", cpp_attention=True) == F8
    with pytest.raises(ValueError, match="C\\+\\+ attention kernels only"):
        resolve_kv_cache_dtype(name, dtype, "cpu", cpp_attention=False)
    with pytest.raises(ValueError, match="on cuda:0"):
        resolve_kv_cache_dtype(name, dtype, "cuda:0", cpp_attention=False)
    assert resolve_kv_cache_dtype("auto", dtype, "cpu", cpp_attention=True) != F8  # only when asked for


def as_float8_cache(q, cache, meta, contiguous, dtype):
    """The batch with K/V rounded to float8 e4m3 (cache and contiguous copies alike), q in dtype.
    Values are scaled by 4 so that some reach past 448 (saturated) and some fall below 2^-6."""
    rounded = [((4 * k).to(F8).float(), (4 * v).to(F8).float()) for k, v in contiguous]
    return q.to(dtype), (4 * cache).to(F8), meta, rounded


def check_float8_cache(kernels_attention, dtype, head_dim, window, shapes, seed=0):
    q, cache, meta, contiguous = as_float8_cache(*make_batch(seed + head_dim, 16, 3, 3, head_dim, shapes), dtype)
    expected = plain_attention(q, contiguous, shapes, 3, window)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # values to ~20: float32 sums; bfloat16 rounds q and out
    torch.testing.assert_close(kernels_attention(q, cache, meta, window).float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,window", [(64, 0), (128, 16), (256, 0)])
def test_float8_cache_matches_plain_attention_on_the_rounded_values(dtype, head_dim, window):
    """Prompts and decodes, ragged, a lone long decode split between threads, two decodes."""
    for seed, shapes in enumerate((RAGGED, [(1100, 1)], [(700, 1), (63, 1)])):
        check_float8_cache(cpp_attention, dtype, head_dim, window, shapes, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_every_float8_key_exactly(dtype):
    """Each of the 254 non-NaN float8 bytes as a key, 16 keys a request (one block): q is c * e_0,
    c a power of two that keeps |c * k| <= 8, and key i's value e_i, so the output's first 16 dims
    are the softmax of c * k.  A key read wrongly (a subnormal taken as a normal, a lost sign, a
    scrambled dim) moves its weight by far more than bfloat16's rounding."""
    kernels = load_cpu_kernels()
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(F8).float().isnan()]
    codes = torch.cat([codes, codes[: (-codes.numel()) % 16]])  # whole requests of 16
    reqs, d = codes.numel() // 16, 64
    keys = codes.view(F8).float().reshape(reqs, 16)
    k_cache = torch.zeros(reqs, 16, 1, d, dtype=torch.uint8)
    k_cache[:, :, 0, 0] = codes.reshape(reqs, 16)
    v_cache = torch.zeros(reqs, 16, 1, d)
    v_cache[:, :, 0, :16] = torch.eye(16)
    scale = 2.0 ** torch.floor(torch.log2(8 / keys.abs().amax(1).clamp_min(2**-9)))
    q = torch.zeros(reqs, 1, d)
    q[:, 0, 0] = scale
    out = torch.zeros(reqs, 1, d, dtype=dtype)
    kernels.paged_decode_attention(
        q.to(dtype), k_cache.view(F8), v_cache.to(F8), out, torch.arange(reqs), torch.full((reqs,), 16),
        torch.arange(reqs).reshape(reqs, 1), 1.0,
    )  # fmt: skip
    expected = torch.softmax((keys.double() * scale.double().unsqueeze(1)), dim=1)
    torch.testing.assert_close(out[:, 0, :16].double(), expected, atol=4e-3, rtol=0)


def float8_write_cases() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties to even), values past the
    range, subnormals and below, signed zeros, and random ones."""
    values = torch.arange(256, dtype=torch.uint8).view(F8).float()
    values = values[~values.isnan()].sort().values
    extra = torch.tensor([500.0, -1e6, float("inf"), -float("inf"), 464.0, 447.0, 2**-10, 3 * 2**-10, -(2**-7), 1e-9])
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 20
    return torch.cat([values, (values[1:] + values[:-1]) / 2, extra, noise])


def check_float8_write(kernels: CpuKernels, dtype: torch.dtype) -> None:
    values = float8_write_cases().to(dtype)
    cols = 64
    rows = -(-values.numel() // cols)
    kv = torch.zeros(rows * cols, dtype=dtype)
    kv[: values.numel()] = values
    qkv = torch.cat([torch.randn(rows, cols).to(dtype), kv.view(rows, cols), kv.view(rows, cols).flip(1)], 1)
    cache = torch.zeros(2, rows, 1, 1, cols, dtype=F8)
    empty = torch.zeros(rows, 0)
    # rotary_dim 0: k and v are copied, converted, so every float -> float8 case shows.
    kernels.rope_write_kv(qkv, torch.zeros(rows, dtype=torch.int64), empty, empty, cache, torch.arange(rows), 1, 0)
    want = qkv[:, cols:].float().to(F8).view(torch.uint8).view(rows, 2, cols).transpose(0, 1)
    assert torch.equal(cache.view(torch.uint8).view(2, rows, cols), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_rounds_as_torch_does(dtype):
    check_float8_write(load_cpu_kernels(), dtype)


def _other_builds() -> list[str]:
    """Builds this CPU can run that take other conversion paths: AVX2 (`haswell`), AVX-512 without
    AVX512-BF16 (`skylake-avx512`), and no F16C (`x86-64-v2`, the plain C++ conversion)."""
    if platform.machine() != "x86_64":
        return []
    from pagedllm.layers.cpu_kernels import cpu_flags

    return ["haswell", "x86-64-v2"] + (["skylake-avx512"] if "avx512f" in cpu_flags().split() else [])


@pytest.mark.builds_own_kernels
@pytest.mark.parametrize("march", _other_builds())
def test_other_builds_read_and_write_float8_alike(march, monkeypatch):
    import pagedllm.layers.attention as attention_module

    plain = CpuKernels(ctypes.CDLL(str(build_library(march))))
    monkeypatch.setattr(attention_module, "load_cpu_kernels", lambda: plain)
    for dtype in (torch.float32, torch.bfloat16):
        check_float8_write(plain, dtype)
        check_float8_cache(cpp_attention, dtype, 64, 16, RAGGED + [(900, 1)])
        check_float8_cache(cpp_attention, dtype, 256, 0, [(40, 1), (3, 20)])


def test_a_float8_cache_holds_twice_the_tokens_of_a_16_bit_one(make_llm):
    small = make_llm(kv_cache_dtype="float8_e4m3", kv_cache_memory="64MiB")
    half = make_llm(kv_cache_dtype="float16", kv_cache_memory="64MiB")
    assert small.engine.runner.kv_caches[0].dtype == F8
    assert small.engine.kv_cache.num_blocks == 2 * half.engine.kv_cache.num_blocks
    assert small.engine.kv_block_bytes * 2 == half.engine.kv_block_bytes


def test_real_smollm2_perplexity_on_a_float8_cache_stays_within_a_few_percent(make_llm):
    """Keys and values rounded to 3 mantissa bits: over 1,000 tokens of real text (two sections of
    the Python reference, fed 16 tokens a step so that every step reads its context from the
    cache), SmolLM2's perplexity rises by about 1% against the float32 cache (the benchmark's
    8,184 tokens: docs in the README); a wrong conversion would multiply it."""
    import pydoc_data.topics

    from pagedllm.testing.hf_reference import negative_log_likelihood

    texts = sorted(pydoc_data.topics.topics.values(), key=len, reverse=True)[:2]
    nll = {}
    for kv in ("float32", "float8_e4m3"):
        llm = make_llm(kv_cache_dtype=kv, kv_cache_memory="64MiB")
        documents = [llm.tokenizer.encode(text)[:500] for text in texts]
        nll[kv] = sum(negative_log_likelihood(llm, ids, 16) for ids in documents) / sum(len(d) - 1 for d in documents)
    ratio = math.exp(nll["float8_e4m3"] - nll["float32"])
    assert 0.99 < ratio < 1.04, f"perplexity ratio {ratio:.4f}"


def test_forks_copy_float8_blocks_on_write(make_llm):
    """Parallel samples share the prompt's blocks and copy the last, partly filled one when they
    write (torch has no float8 index_put: the copy goes through the bytes): greedy forks all
    equal the request alone, and no block stays held."""
    llm = make_llm(kv_cache_dtype="float8_e4m3", kv_cache_memory="64MiB")
    prompt = list(range(1000, 1037))  # two full blocks and 5 tokens of a third
    alone = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    forked = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert [list(c.token_ids) for c in forked.outputs] == [list(alone.outputs[0].token_ids)] * 3
    assert_no_blocks_held(llm)
