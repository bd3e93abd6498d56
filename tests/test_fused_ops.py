"""The fused C++ elementwise ops against the same math in separate torch ops."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.cpu_kernels import load_cpu_kernels
from pagedllm.layers.fused_ops import CppOps, TorchOps, select_ops
from pagedllm.layers.rotary import Rotary

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def cpp() -> CppOps:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C++ kernels should build on this machine (g++)"
    return CppOps(kernels)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: only summation order differs; bfloat16: a last-bit rounding difference at most.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the threshold where threads join
def test_add_rms_norm(cpp: CppOps, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, 576, generator=gen).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    res_cpp, res_torch = residual.clone(), residual.clone()
    out_cpp = cpp.add_rms_norm(delta, res_cpp, weight, 1e-5)
    out_torch = TorchOps().add_rms_norm(delta, res_torch, weight, 1e-5)
    assert torch.equal(res_cpp, res_torch), "the residual sum is rounded exactly as torch rounds it"
    close(out_cpp, out_torch, dtype)
    # Without a delta the residual is left as it is.
    close(cpp.add_rms_norm(None, res_cpp, weight, 1e-5), out_torch, dtype)
    assert torch.equal(res_cpp, res_torch)


# (activations, KV cache): the model's dtype, or a float16 cache beside float32.
CACHE_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)]


@pytest.mark.parametrize("dtype,kv_dtype", CACHE_DTYPES, ids=["f32", "bf16", "f32-f16kv"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (2, 2, 8)])
@pytest.mark.parametrize("rotated", ["all", "half", "none"])  # partial rotary (Phi-4-mini), NoPE layers (SmolLM3)
def test_rope_write_kv(
    cpp: CppOps, dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, rotated: str
) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    tokens, num_blocks, block_size = 37, 12, 4
    rotary_dim = {"all": head_dim, "half": head_dim // 2, "none": 0}[rotated]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=kv_dtype) for _ in "ab"]
    rotary = Rotary(head_dim, 10000.0, 512, dtype, rotary_dim=rotary_dim).for_step(positions)
    q_cpp = cpp.rope_write_kv(qkv, rotary, caches[0], slots, heads)
    q_torch = TorchOps().rope_write_kv(qkv, rotary, caches[1], slots, heads)
    close(q_cpp, q_torch, dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert torch.equal(q_cpp[..., rotary_dim:], q[..., rotary_dim:]), "dims past the rotary ones pass through"
    if rotary_dim:
        assert not torch.equal(q_cpp[..., :rotary_dim], q[..., :rotary_dim])
    flat = [c.view(2, -1, kv_heads, head_dim) for c in caches]
    if kv_dtype == torch.float16:  # k rotated in float32, then rounded once to float16 (a last-bit difference)
        torch.testing.assert_close(flat[0][:, slots].float(), flat[1][:, slots].float(), atol=2e-3, rtol=1e-3)
    else:
        close(flat[0][:, slots], flat[1][:, slots], dtype)
    assert torch.equal(flat[0][1, slots], flat[1][1, slots]), "v is copied (rounded to the cache's dtype), not computed"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert flat[0][:, untouched].isnan().all(), "only the given slots are written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul(cpp: CppOps, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 6).to(dtype)  # SiLU's tails included
    close(cpp.silu_mul(gate_up), TorchOps().silu_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_gelu_tanh_mul(cpp: CppOps, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 2048, generator=gen) * 6).to(dtype)  # both tails, and near 0
    gate_up[0, :8] = torch.tensor([0.0, 1e-6, -1e-6, 1e-3, -9.0, 9.0, 40.0, -40.0])
    close(cpp.gelu_tanh_mul(gate_up), TorchOps().gelu_tanh_mul(gate_up), dtype)


def test_select_ops() -> None:
    assert select_ops("torch", torch.float32).name == "torch"
    assert select_ops("auto", torch.float16).name == "torch"  # the C++ ops run float32 and bfloat16 only
    assert select_ops("auto", torch.bfloat16).name == "cpp"
    with pytest.raises(ValueError, match="ops must be"):
        select_ops("fast", torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        select_ops("cpp", torch.float16)


@pytest.mark.parametrize("rows", [1, 2, 3, 12, 13, 32, 33])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (37, 50), (576, 1536), (32, 1)])
def test_packed_gemm_and_the_linear_that_routes_to_it(cpp: CppOps, rows: int, out_features: int, in_features: int):
    from pagedllm.layers.linear import Linear

    gen = torch.Generator().manual_seed(out_features + rows)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    x = torch.randn(rows, in_features, generator=gen)
    expected = x @ weight.t()
    linear = Linear(weight, "onednn", cpp.small_batch)
    assert linear.small_max_rows == cpp.small_batch.packed_gemm_max_rows[torch.float32] in (4, 32)
    torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)
    packed = cpp.small_batch.pack_panels(weight)
    assert packed.shape == (-(-out_features // 32), in_features, 32)
    torch.testing.assert_close(cpp.small_batch.packed_gemm(x, packed, out_features), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not hold"):
        cpp.small_batch.packed_gemm(x, packed, out_features + 32)
    assert linear(x[:0]).shape == (0, out_features)  # an empty call returns an empty result


@pytest.mark.parametrize("rows", [1, 2, 3, 12, 13, 32, 33, 600])  # 600: past the limit, to oneDNN
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (37, 64), (576, 1536), (33, 2)])
def test_bfloat16_packed_gemm_and_the_linear_that_routes_to_it(cpp: CppOps, rows: int, out_features, in_features):
    from pagedllm.layers.linear import Linear

    kernels = cpp.small_batch
    if not kernels.packed_gemm_max_rows[torch.bfloat16]:
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            kernels.packed_gemm(torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(1, 16, 64, dtype=torch.bfloat16), 4)
        assert Linear(torch.ones(4, 32, dtype=torch.bfloat16), "torch", kernels).small_weight is None
        pytest.skip("the bfloat16 packed GEMM runs only where the CPU has AVX512-BF16")
    gen = torch.Generator().manual_seed(out_features + rows)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    expected = (x.float() @ weight.float().t()).to(torch.bfloat16).float()
    linear = Linear(weight, "onednn", kernels)
    # The kernel takes any row count; the linears route to it up to 512 rows, or 2 where oneDNN
    # has AMX (measured faster from 4 rows there).
    from pagedllm.layers.cpu_kernels import AMX_BF16_PACKED_MAX_ROWS, cpu_flags

    routed = AMX_BF16_PACKED_MAX_ROWS if "amx_bf16" in cpu_flags().split() else 512
    assert linear.small_max_rows == kernels.packed_gemm_max_rows[torch.bfloat16] == routed
    # Accumulated in float32 either way (rounded to bfloat16 once: one last-bit difference at most).
    tol = {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(linear(x).float(), expected, **tol)
    packed = kernels.pack_panels(weight)
    assert packed.shape == (-(-out_features // 32), in_features // 2, 64)
    torch.testing.assert_close(kernels.packed_gemm(x, packed, out_features).float(), expected, **tol)
    with pytest.raises(ValueError, match="does not hold"):
        kernels.packed_gemm(x, packed.float(), out_features)
    assert linear(x[:0]).shape == (0, out_features)
    with pytest.raises(ValueError, match="even inner size"):
        kernels.pack_panels(torch.ones(4, 5, dtype=torch.bfloat16))
    # An odd inner size stays with oneDNN.
    assert Linear(torch.ones(4, 5, dtype=torch.bfloat16), "onednn", kernels).small_weight is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 16), (5, 33), (128, 49152), (300, 1000)])
def test_argmax_rows_matches_torch(cpp: CppOps, shape: tuple[int, int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=gen).to(dtype)
    assert torch.equal(cpp.kernels.argmax_rows(x), x.float().argmax(dim=-1))
    # Ties: the first index of the largest value, as torch.argmax (rows of few distinct values).
    ties = torch.randint(0, 3, shape, generator=gen).to(dtype)
    assert torch.equal(cpp.kernels.argmax_rows(ties), ties.float().argmax(dim=-1))
    # The largest value in each lane position in turn, and a maximum repeated in several lanes.
    for where in range(min(shape[1], 20)):
        y = torch.zeros(shape, dtype=dtype)
        y[:, where] = 1
        y[:, shape[1] - 1 - where] = 1
        assert torch.equal(cpp.kernels.argmax_rows(y), y.float().argmax(dim=-1))


def test_argmax_rows_nan_and_infinities_as_torch() -> None:
    kernels = load_cpu_kernels()
    x = torch.randn(7, 100)
    x[0, 50] = float("nan")  # in the vector part
    x[1, 3], x[1, 90] = float("nan"), float("nan")  # the first of two
    x[2, 99] = float("nan")  # in the tail past the last 16 lanes
    x[3] = float("-inf")
    x[4, 70] = x[4, 80] = float("inf")
    x[5, 0] = float("nan")
    short = torch.tensor([[1.0, float("nan"), 5.0], [float("nan"), 1.0, 2.0], [2.0, 9.0, 9.0]])
    for t in (x, short, x.bfloat16(), short.bfloat16()):
        assert torch.equal(kernels.argmax_rows(t), t.float().argmax(dim=-1))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernels.argmax_rows(x.half())
    with pytest.raises(ValueError, match="cols >= 1"):
        kernels.argmax_rows(torch.empty(2, 0))
    assert kernels.argmax_rows(torch.empty(0, 5)).shape == (0,)
