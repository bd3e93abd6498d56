"""Every attention path against the reference, and the reference against plain
attention over contiguous K/V, on random ragged batches."""

import math
import platform

import pytest
import torch

from pagedllm.layers.attention import (
    cpp_attention,
    reference_attention,
    torch_attention,
    write_kv,
)
from pagedllm.layers.attention_metadata import build_attention_metadata

FAST_PATHS = [torch_attention, cpp_attention]


def make_batch(seed, block_size, kv_heads, group, head_dim, shapes, dtype=torch.float32):
    """shapes: (context already cached, new tokens) per request.  Returns q, cache,
    meta, and each request's full contiguous K/V for an independent check."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = kv_heads * group
    blocks_needed = [-(-(ctx + new) // block_size) for ctx, new in shapes]
    num_blocks = sum(blocks_needed) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered physical blocks
    tables, contiguous, slots, qsl = [], [], [], [0]
    for (ctx, new), nb in zip(shapes, blocks_needed):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        k = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(ctx):  # earlier context already in the cache
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
        contiguous.append((k, v))
        qsl.append(qsl[-1] + new)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    new_k = torch.cat([k[ctx:] for (k, _), (ctx, _) in zip(contiguous, shapes)])
    new_v = torch.cat([v[ctx:] for (_, v), (ctx, _) in zip(contiguous, shapes)])
    slot_mapping = torch.tensor(slots)
    write_kv(cache, new_k, new_v, slot_mapping)
    seq_lens = [ctx + new for ctx, new in shapes]
    meta = build_attention_metadata(slot_mapping, qsl, seq_lens, block_tables)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype)
    return q, cache, meta, contiguous


def plain_attention(q, contiguous, shapes, group, window=0):
    """Attention on each request's contiguous K/V, masked by hand (causal, and the window when given)."""
    outs, row = [], 0
    for (k, v), (ctx, new) in zip(contiguous, shapes):
        qi = q[row : row + new].float().transpose(0, 1)
        kk = k.float().repeat_interleave(group, 1).transpose(0, 1)
        vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
        scores = qi @ kk.transpose(1, 2) / math.sqrt(q.shape[-1])
        mask = torch.ones(new, ctx + new, dtype=torch.bool).tril(ctx)
        if window:
            mask &= ~torch.ones(new, ctx + new, dtype=torch.bool).tril(ctx - window)
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append((scores.softmax(-1) @ vv).transpose(0, 1).reshape(new, -1))
        row += new
    return torch.cat(outs)


RAGGED = [(0, 1), (5, 1), (0, 17), (33, 1), (16, 16), (40, 9), (0, 64), (127, 1), (3, 1), (64, 1)]


@pytest.mark.parametrize("attention", FAST_PATHS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 128])
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1), (1, 8)])
def test_fast_paths_match_reference_float32(attention, block_size, kv_heads, group):
    q, cache, meta, contiguous = make_batch(block_size * 7 + group, block_size, kv_heads, group, 64, RAGGED)
    ref = reference_attention(q, cache, meta)
    torch.testing.assert_close(ref, plain_attention(q, contiguous, RAGGED, group), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention(q, cache, meta), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", FAST_PATHS)
def test_many_decodes_span_several_groups(attention):
    shapes = [(int(n), 1) for n in torch.randint(1, 300, (70,), generator=torch.Generator().manual_seed(3))]
    q, cache, meta, contiguous = make_batch(1, 16, 3, 3, 64, shapes)
    assert len(meta.decode_groups(cache)) > 1 and not meta.prefill_indices
    torch.testing.assert_close(attention(q, cache, meta), reference_attention(q, cache, meta), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", FAST_PATHS)
def test_fast_paths_match_reference_bfloat16(attention):
    q, cache, meta, _ = make_batch(5, 16, 3, 3, 64, RAGGED, dtype=torch.bfloat16)
    torch.testing.assert_close(
        attention(q, cache, meta).float(), reference_attention(q, cache, meta).float(), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_long_decodes_split_between_threads_match_the_reference(window, dtype):
    """With fewer decoding requests than threads, the C++ kernel cuts each context into parts
    that threads take apart, then merges them: contexts from one key to past a thousand, cut at
    and off tile edges, with a window starting mid-part."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for shapes in ([(1100, 1)], [(0, 1)], [(127, 1)], [(700, 1), (63, 1)], [(1023, 1)]):
        q, cache, meta, contiguous = make_batch(len(shapes) + window, 16, 3, 3, 64, shapes, dtype=dtype)
        expected = plain_attention(q, contiguous, shapes, 3, window)
        torch.testing.assert_close(cpp_attention(q, cache, meta, window).float(), expected, atol=tol, rtol=tol)


def as_half_cache(q, cache, meta, contiguous):
    """The batch with its K/V rounded to float16 (the cache and the contiguous copies alike), q float32."""
    return q, cache.half(), meta, [(k.half().float(), v.half().float()) for k, v in contiguous]


@pytest.mark.parametrize("attention", FAST_PATHS)
@pytest.mark.parametrize("head_dim,window", [(64, 0), (128, 16), (256, 0)])
def test_float16_cache_beside_float32_matches_plain_attention(attention, head_dim, window):
    """A float16 KV cache read by float32 queries: the keys and values are exactly the float16
    numbers, the math float32, so the result is plain attention on those numbers to float32's
    precision, prompts and decodes alike, a lone long decode's split parts included."""
    for seed, shapes in enumerate((RAGGED, [(1100, 1)], [(700, 1), (63, 1)])):
        batch = make_batch(seed + head_dim, 16, 3, 3, head_dim, shapes)
        q, cache, meta, contiguous = as_half_cache(*batch)
        assert cache.dtype == torch.float16 and q.dtype == torch.float32
        expected = plain_attention(q, contiguous, shapes, 3, window)
        torch.testing.assert_close(attention(q, cache, meta, window), expected, atol=1e-5, rtol=1e-5)


def test_cpp_kernel_builds_here():
    from pagedllm.layers.cpu_kernels import load_cpu_kernels

    assert load_cpu_kernels() is not None, "the C++ kernels should build on this machine (g++)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_kernels_take_many_heads(dtype):
    # 72 query heads over 8 KV heads (groups of 9: two register passes of 4 and one of 1 in decode).
    q, cache, meta, _ = make_batch(3, 16, 8, 9, 64, [(37, 1), (5, 1), (20, 7)], dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    expected = reference_attention(q, cache, meta).float()
    torch.testing.assert_close(cpp_attention(q, cache, meta).float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("attention", FAST_PATHS)
@pytest.mark.parametrize("head_dim", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_outside_every_context_never_reach_the_output(attention, head_dim, dtype):
    """Freed or never-written slots may hold anything, NaN included (a block's tail past
    its request's length, the padding block 0): no path may read them into a result."""
    if attention is cpp_attention and head_dim == 16:
        pytest.skip("the C++ kernels take head_dim 64, 128 or 256")
    block_size = 16
    q, cache, meta, _ = make_batch(2, block_size, 2, 2, head_dim, RAGGED, dtype=dtype)
    expected = reference_attention(q, cache, meta)
    in_context = torch.zeros(cache.shape[1] * block_size, dtype=torch.bool)
    for table, seq_len in zip(meta.block_tables.tolist(), meta.seq_lens):
        in_context[[table[p // block_size] * block_size + p % block_size for p in range(seq_len)]] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~in_context] = float("nan")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attention(q, cache, meta).float(), expected.float(), atol=tol, rtol=tol)


def _older_instruction_sets() -> list[str]:
    """-march targets this CPU can run that leave out some of its kernel paths."""
    if platform.machine() != "x86_64":
        return []
    from pagedllm.layers.cpu_kernels import cpu_flags

    return ["haswell"] + (["skylake-avx512"] if "avx512f" in cpu_flags().split() else [])


@pytest.mark.builds_own_kernels
@pytest.mark.parametrize("march", _older_instruction_sets())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_cpp_paths_match_the_reference(march, dtype, monkeypatch):
    """Built for AVX2 only (`haswell`: AVX2 intrinsics, or plain C++ loops) or AVX-512 without AVX512-BF16
    (`skylake-avx512`: bfloat16 converted to float32), the kernels take the paths those CPUs
    run; they must agree with the reference too."""
    import ctypes

    import pagedllm.layers.attention as attention_module
    from pagedllm.layers.cpu_kernels import CpuKernels, build_library

    plain = CpuKernels(ctypes.CDLL(str(build_library(march))))
    assert plain.packed_gemm_max_rows[torch.bfloat16] == 0  # no AVX512-BF16 in either build
    if dtype == torch.float32:  # the small-batch packed GEMM's plain (or AVX-512F) loop
        weight, x = torch.randn(37, 576), torch.randn(7, 576)
        y = plain.packed_gemm(x, plain.pack_panels(weight), 37)
        torch.testing.assert_close(y, x @ weight.t(), atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(attention_module, "load_cpu_kernels", lambda: plain)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for head_dim, window in ((64, 0), (128, 16), (256, 0)):
        q, cache, meta, _ = make_batch(7, 16, 3, 3, head_dim, RAGGED, dtype=dtype)
        expected = reference_attention(q, cache, meta, window).float()
        torch.testing.assert_close(cpp_attention(q, cache, meta, window).float(), expected, atol=tol, rtol=tol)
    # One long decode: its context split between threads, the parts merged.
    q, cache, meta, contiguous = make_batch(8, 16, 3, 3, 64, [(900, 1)], dtype=dtype)
    expected = plain_attention(q, contiguous, [(900, 1)], 3)
    torch.testing.assert_close(cpp_attention(q, cache, meta).float(), expected, atol=tol, rtol=tol)
    if dtype == torch.float32:  # a float16 cache: F16C conversions in these builds
        check_float16_cache(RAGGED + [(900, 1)])


def check_float16_cache(shapes, window=16):
    q, cache, meta, contiguous = as_half_cache(*make_batch(9, 16, 3, 3, 64, shapes))
    expected = plain_attention(q, contiguous, shapes, 3, window)
    torch.testing.assert_close(cpp_attention(q, cache, meta, window), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.builds_own_kernels
@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for x86-64-v2 (no F16C): x86 only")
def test_float16_cache_without_f16c(monkeypatch):
    """Built without F16C (x86-64-v2, as for CPUs or architectures without it), float16 keys and
    values convert in plain arithmetic: attention on them and the rotary write into the cache
    (float32 rounded to nearest even, subnormals, overflow to infinity) agree with torch."""
    import ctypes

    import pagedllm.layers.attention as attention_module
    from pagedllm.layers.cpu_kernels import CpuKernels, build_library

    plain = CpuKernels(ctypes.CDLL(str(build_library("x86-64-v2"))))
    monkeypatch.setattr(attention_module, "load_cpu_kernels", lambda: plain)
    check_float16_cache(RAGGED + [(300, 1)])
    # rotary_dim 0: k and v are copied, converted, so every float32 -> float16 case shows.
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 3e-6, 5.96e-8, 2.9e-8,
                           1e-9, 1.0009765625, 1.00048828125, 1.000732421875, 0.1, -0.3, float("inf")])  # fmt: skip
    cols = 64
    qkv = torch.randn(4, 3 * cols)
    qkv[:, cols:] = values.repeat(2 * cols * 4 // values.numel() + 1)[: 2 * cols * 4].view(4, 2 * cols)
    cache = torch.zeros(2, 2, 4, 1, cols, dtype=torch.float16)
    slots, positions = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    empty = torch.zeros(1, 0)
    plain.rope_write_kv(qkv, positions, empty, empty, cache, slots, 1, rotary_dim=0)
    written = cache.view(2, -1, cols)[:, :4].transpose(0, 1).reshape(4, 2 * cols)
    assert torch.equal(written, qkv[:, cols:].half())


@pytest.mark.builds_own_kernels
def test_amx_prefill_agrees_with_the_vdpbf16ps_path(monkeypatch):
    """Where the CPU has AMX-BF16, the bfloat16 prefill kernel runs on the tile unit; built for
    `cooperlake` (AVX512-BF16, no AMX) the same kernel takes its `vdpbf16ps` path.  Both agree with
    the reference and with each other, over head dims 64/128/256, windows, grouped heads, block
    sizes that split tiles, and prompts whose rows and keys end mid tile."""
    import ctypes

    import pagedllm.layers.attention as attention_module
    from pagedllm.layers.cpu_kernels import CpuKernels, build_library, cpu_flags, load_cpu_kernels

    native = load_cpu_kernels()
    if native is None or not native.amx_tiles or "avx512_bf16" not in cpu_flags().split():
        pytest.skip("no AMX-BF16 here: the tile path is not built")
    no_amx = CpuKernels(ctypes.CDLL(str(build_library("cooperlake"))))
    assert no_amx.native_bf16 and not no_amx.amx_tiles
    shapes = [(0, 1), (0, 7), (0, 33), (5, 12), (40, 70), (0, 200), (130, 1), (17, 95)]
    for seed, (head_dim, window, block_size, kv_heads, group) in enumerate(
        ((64, 0, 16, 3, 3), (64, 24, 8, 1, 8), (128, 0, 32, 2, 1), (256, 0, 16, 1, 4), (256, 50, 16, 1, 4))
    ):
        q, cache, meta, _ = make_batch(seed, block_size, kv_heads, group, head_dim, shapes, dtype=torch.bfloat16)
        expected = reference_attention(q, cache, meta, window).float()
        outputs = []
        for kernels in (native, no_amx):
            # every prompt through the C++ kernel (none to SDPA), so the two builds' kernels meet
            monkeypatch.setattr(attention_module, "load_cpu_kernels", lambda k=kernels: k)
            monkeypatch.setattr(attention_module, "sdpa_min_prompt", lambda dtype, k, head_dim: None)
            outputs.append(cpp_attention(q, cache, meta, window).float())
        for out in outputs:
            torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)


WINDOWED = [(0, 1), (5, 1), (0, 37), (33, 1), (16, 16), (40, 9), (0, 64), (127, 1), (70, 30), (64, 1), (200, 3)]


@pytest.mark.parametrize("attention", FAST_PATHS)
@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("block_size,kv_heads,group", [(16, 3, 3), (8, 1, 8), (32, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_reference_and_never_reads_older_slots(
    attention, window, block_size, kv_heads, group, dtype
):
    """Every path sees only the last `window` positions: equal to the reference and to a
    hand-masked contiguous attention, with NaN in every slot older than every window."""
    q, cache, meta, contiguous = make_batch(window + block_size, block_size, kv_heads, group, 64, WINDOWED, dtype)
    expected = reference_attention(q, cache, meta, window)
    torch.testing.assert_close(
        expected.float(),
        plain_attention(q, contiguous, WINDOWED, group, window).to(dtype).float(),
        atol=2e-2,
        rtol=2e-2,
    )
    assert not torch.allclose(expected.float(), reference_attention(q, cache, meta).float(), atol=1e-3)
    # Slots no query can see any more (older than the first new token's window) become NaN.
    visible = torch.zeros(cache.shape[1] * block_size, dtype=torch.bool)
    for table, seq_len, (ctx, _) in zip(meta.block_tables.tolist(), meta.seq_lens, WINDOWED):
        first = max(0, ctx - window + 1)
        visible[[table[p // block_size] * block_size + p % block_size for p in range(first, seq_len)]] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~visible] = float("nan")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attention(q, cache, meta, window).float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("attention", FAST_PATHS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_64_128_256(attention, head_dim, window, dtype):
    """The head sizes of SmolLM2 (64), Qwen3 (128) and Gemma 3 (256), GQA 1:3 and 1:4."""
    for kv_heads, group in ((3, 3), (1, 4)):
        q, cache, meta, _ = make_batch(head_dim + window, 16, kv_heads, group, head_dim, WINDOWED, dtype=dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        expected = reference_attention(q, cache, meta, window).float()
        torch.testing.assert_close(attention(q, cache, meta, window).float(), expected, atol=tol, rtol=tol)


def test_cpp_attention_is_chosen_for_every_supported_head_dim(caplog):
    from pagedllm.layers.attention import select_attention

    with caplog.at_level("WARNING", logger="pagedllm"):
        for head_dim in (64, 128, 256):
            assert select_attention("auto", head_dim) is cpp_attention
        assert not caplog.records
        assert select_attention("auto", 96) is torch_attention
    assert "pure-torch path" in caplog.text


@pytest.mark.parametrize("window", [0, 40, "longer than the prompts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prompts_through_sdpa_match_the_reference(window, dtype, monkeypatch):
    """`cpp_attention` sends whole prompts of at least `sdpa_min_prompt` tokens that no window cuts
    to SDPA (never, in bfloat16 with AVX512-BF16 but no AMX), the rest of the step to the C++
    kernels: a mixed step (a whole prompt over the threshold, one under it, a chunk over cached
    context, decodes) equals the reference, and the SDPA path was taken (or not, when the window
    cuts the prompt)."""
    import pagedllm.layers.attention as attention_module

    taken: list[list[int]] = []
    sdpa = attention_module._prefill_sdpa
    monkeypatch.setattr(attention_module, "_prefill_sdpa", lambda *a, **k: taken.append(list(a[5])) or sdpa(*a, **k))
    min_prompt = attention_module.sdpa_min_prompt(dtype, attention_module.load_cpu_kernels(), 64)
    assert min_prompt is None or 30 < min_prompt
    long = 1024 if min_prompt is None else min_prompt  # one prompt just at the threshold, one over it
    shapes = [(0, long + 76), (0, 30), (50, 40), (70, 1), (0, long), (300, 1)]
    if isinstance(window, str):
        window = long + 100
    q, cache, meta, _ = make_batch(11, 16, 3, 3, 64, shapes, dtype=dtype)
    expected = reference_attention(q, cache, meta, window).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cpp_attention(q, cache, meta, window).float(), expected, atol=tol, rtol=tol)
    assert taken == ([] if window == 40 or min_prompt is None else [[0, 4]])


def test_sdpa_min_prompt_per_dtype_and_cpu():
    """float32 (or bfloat16 computed in float32) hands long prompts to SDPA; bfloat16 with
    AVX512-BF16 keeps them in the C++ kernel, unless the CPU has AMX: then from 128 tokens where the
    kernel has no tiles (oneDNN's SDPA has), and where it has them from 4,096 (head dim 64) or
    2,048 (larger heads)."""
    from types import SimpleNamespace

    from pagedllm.layers import attention as a

    def cpu(native: bool, amx: bool, tiles: bool = False) -> SimpleNamespace:
        return SimpleNamespace(native_bf16=native, amx_bf16=amx, amx_tiles=tiles)

    assert a.sdpa_min_prompt(torch.float32, cpu(True, True, True), 64) == a.SDPA_MIN_PROMPT
    assert a.sdpa_min_prompt(torch.bfloat16, cpu(False, False), 64) == a.SDPA_MIN_PROMPT
    assert a.sdpa_min_prompt(torch.bfloat16, cpu(True, False), 64) is None
    assert a.sdpa_min_prompt(torch.bfloat16, cpu(True, True), 256) == a.SDPA_MIN_PROMPT_AMX == 128
    assert a.sdpa_min_prompt(torch.bfloat16, cpu(True, True, True), 64) == 4096
    assert a.sdpa_min_prompt(torch.bfloat16, cpu(True, True, True), 256) == 2048
