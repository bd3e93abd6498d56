"""GGUF weights kept quantized (weights=native): the repacking, the C++ integer kernels, and the
real bundled models against their dequantized weights.

The kernel tests run under every CPU class in CI (tests/cpu_dependent.txt): AVX2 (maddubs, the
sign trick for 8-bit values), AVX-512 without VNNI, and the host's (VNNI, unsigned 8-bit)."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.cpu_kernels import load_cpu_kernels
from pagedllm.layers.quantized import (
    PackedWeight,
    QuantizedLinear,
    QuantizedWeight,
    _pack_values,
    onednn_blocked_layout,
    pack,
    quantized_embedding,
)
from pagedllm.models.gguf_weights import NATIVE_TYPES, dequantize_tensor, repack
from pagedllm.models.llama import fuse
from pagedllm.models.loader import gguf_tensor_bytes, load_weights, resolve_model_path
from pagedllm.testing.hf_reference import our_logits

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C++ kernels do not build here")

# Where each type keeps its float16 scales (d, and m or dmin), so random blocks get sane ones.
_HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                "Q5_K": [0, 2], "Q6_K": [208]}  # fmt: skip


def random_tensor(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes of `kind` blocks for a [rows, cols] tensor, with finite float16 scales."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    for offset in _HALF_FIELDS[kind]:
        raw[:, offset : offset + 2] = rng.normal(0, 0.05, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def activation_span(kind: str) -> int:
    """The values that share one activation step before a `kind` weight (the build decides for K types)."""
    return KERNELS.quant_k_activation_span if kind.endswith("_K") else 32


def quantized_rows(x: torch.Tensor, span: int = 32) -> torch.Tensor:
    """x as the kernels see it: each span rounded to 8-bit steps of its largest |value| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, span)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / step.clamp_min(1e-30)) * step).reshape(x.shape)


@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_repacked_values_equal_the_files(kind):
    raw = random_tensor(kind, 6, 512)
    expected = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(6, 512)
    weight = repack(raw, kind, 6, 512)
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert weight.source == kind
    # weights=dequantized takes this way too (models/gguf_weights.py: dequantize_tensor)
    assert np.array_equal(dequantize_tensor(raw, getattr(gguf.GGMLQuantizationType, kind), [6, 512]), expected)


def test_repack_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        repack(random_tensor("Q4_K", 1, 256), "Q4_K", 2, 128)
    with pytest.raises(ValueError, match="no native kernel"):
        repack(np.zeros((1, 20), np.uint8), "IQ4_NL", 1, 32)


@needs_kernels
@pytest.mark.parametrize("kind", NATIVE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_gemm_matches_the_reference(kind, dtype):
    weight = repack(random_tensor(kind, 70, 512, seed=1), kind, 70, 512)  # 70: a partial last panel
    packed = pack(weight, KERNELS.quant_panel_width, KERNELS.quant_unsigned8)
    dense = weight.dequantize()
    torch.manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 512).to(dtype)
        got = QuantizedLinear([packed], KERNELS, max_rows=64)(x).float()
        want = quantized_rows(x, activation_span(kind)) @ dense.T  # the same arithmetic in float64-free torch
        tolerance = 2e-5 if dtype == torch.float32 else 8e-3
        assert (got - want).abs().max() <= tolerance * want.abs().max(), (kind, rows)
        # and close to the float product: activation quantization costs well under 2%
        exact = x.float() @ dense.T
        assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_kernels
@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_the_kernels_pack_the_bytes_torch_packs(kind):
    weight = repack(random_tensor(kind, 70, 512, seed=3), kind, 70, 512)  # 70: a partial last panel
    panel = KERNELS.quant_panel_width
    fast = pack(weight, panel, KERNELS.quant_unsigned8, KERNELS)
    reference = pack(weight, panel, KERNELS.quant_unsigned8)
    assert fast.zero == reference.zero
    assert all(torch.equal(a, b) for a, b in zip(fast.tensors(), reference.tensors(), strict=True))
    if weight.bits == 8:  # the VNNI builds' q + 128, on any build
        flipped = KERNELS.pack_quantized_values(weight.qs, 70, 512, 8, True)
        assert torch.equal(flipped, _pack_values(weight, -(-70 // panel), panel, 512 // 32, True))
    with pytest.raises(ValueError, match="pack_quantized_values"):
        KERNELS.pack_quantized_values(weight.qs[:, :-1].contiguous(), 70, 512, weight.bits, False)
    with pytest.raises(ValueError, match="not the kernels' layout"):
        pack(weight, panel * 2, KERNELS.quant_unsigned8, KERNELS)


@needs_kernels
@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_integer_gemm_holds_at_the_largest_values(kind):
    # Every bit set: the largest values, sub-scales and high bits a file can hold, against the
    # largest quantized activations (all 127): the kernels' int16 and int32 sums must not wrap.
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.full((20 * 512 // block_values, block_bytes), 0xFF, np.uint8)
    for offset in _HALF_FIELDS[kind]:
        raw[:, offset : offset + 2] = np.full((raw.shape[0], 1), 0.01, np.float16).view(np.uint8)
    if kind == "Q6_K":  # its signed sub-scales (bytes 192..207) at their largest magnitude, -128
        raw[:, 192:208] = 0x80
    weight = repack(raw.reshape(20, -1), kind, 20, 512)
    packed = pack(weight, KERNELS.quant_panel_width, KERNELS.quant_unsigned8)
    dense = weight.dequantize()
    for x in (torch.ones(4, 512), -torch.ones(4, 512)):
        for rows in (1, 4):
            got = QuantizedLinear([packed], KERNELS, max_rows=64)(x[:rows])
            want = x[:rows] @ dense.T
            assert (got - want).abs().max() <= 2e-5 * want.abs().max(), (kind, rows)


@needs_kernels
@pytest.mark.parametrize("kind", NATIVE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_rows_and_transpose_are_exact(kind, dtype):
    weight = repack(random_tensor(kind, 40, 256, seed=2), kind, 40, 256)
    packed = pack(weight, KERNELS.quant_panel_width, KERNELS.quant_unsigned8)
    dense = weight.dequantize().to(dtype)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(quantized_embedding(packed, KERNELS, ids, dtype), dense[ids])
    assert torch.equal(QuantizedLinear([packed], KERNELS, max_rows=0).dense_transposed(dtype), dense.T)
    with pytest.raises(IndexError, match="out of range"):
        quantized_embedding(packed, KERNELS, torch.tensor([40]), dtype)


@pytest.mark.skipif(KERNELS is None or not KERNELS.quant_amx, reason="no AMX-BF16 tiles here")
@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_the_amx_tile_kernel_matches_the_dequantized_product(kind):
    # 70 columns: five panels, a chunk of four and one of a single, partial panel
    weight = repack(random_tensor(kind, 70, 512, seed=4), kind, 70, 512)
    packed = pack(weight, KERNELS.quant_panel_width, KERNELS.quant_unsigned8)
    dense = weight.dequantize(torch.bfloat16).float()  # the weights as the dequantized model holds them
    torch.manual_seed(0)
    for rows in (1, 16, 17, 32, 45, 70):  # whole passes of 32 rows, a lower half, a last pass of 1-16
        x = torch.randn(rows, 512).to(torch.bfloat16)
        out = torch.full((rows, 80), 5.0, dtype=torch.bfloat16)
        KERNELS.quant_amx_gemm(x, packed, out, col=3)
        want = x.float() @ dense.T
        assert (out[:, 3:73].float() - want).abs().max() <= 8e-3 * want.abs().max(), (kind, rows)
        assert bool((out[:, :3] == 5).all() and (out[:, 73:] == 5).all())  # other columns untouched
    linear = QuantizedLinear([packed], KERNELS, max_rows=4)
    assert linear.tile_max_rows >= 20
    x = torch.randn(20, 512).to(torch.bfloat16)
    want = x.float() @ dense.T
    assert (linear(x).float() - want).abs().max() <= 8e-3 * want.abs().max()
    with pytest.raises(TypeError, match="bfloat16"):
        KERNELS.quant_amx_gemm(x.float(), packed, torch.empty(20, 70))


@pytest.mark.skipif(KERNELS is None or not KERNELS.quant_amx, reason="no AMX-BF16 tiles here")
def test_a_large_tile_kernel_output_streamed_around_the_cache_is_the_same():
    # 64 rows x 32,768 columns of bfloat16 is 4 MiB, where the tile kernel writes its output with
    # streaming stores (an LM head's); 32 rows at a time it writes through the cache.  A row's
    # products do not depend on the rows beside it, so both must give the same bits.
    weight = repack(random_tensor("Q8_0", 32768, 64, seed=5), "Q8_0", 32768, 64)
    packed = pack(weight, KERNELS.quant_panel_width, KERNELS.quant_unsigned8)
    torch.manual_seed(0)
    x = torch.randn(64, 64).to(torch.bfloat16)

    def product(rows: torch.Tensor) -> torch.Tensor:
        out = torch.full((rows.shape[0], 32768), 5.0, dtype=torch.bfloat16)
        KERNELS.quant_amx_gemm(rows, packed, out)
        return out

    streamed = product(x)
    assert torch.equal(streamed, torch.cat([product(x[:32]), product(x[32:])]))
    want = x.float() @ weight.dequantize(torch.bfloat16).float().T
    assert (streamed.float() - want).abs().max() <= 8e-3 * want.abs().max()
    # at a column offset the rows do not start on cache lines: written through the cache instead
    wide = torch.full((64, 32768 + 3), 5.0, dtype=torch.bfloat16)
    KERNELS.quant_amx_gemm(x, packed, wide, col=3)
    assert torch.equal(wide[:, 3:], streamed) and bool((wide[:, :3] == 5).all())


@pytest.mark.skipif(
    KERNELS is None or not KERNELS.dequantize_blocked_bf16 or not onednn_blocked_layout(96, 512),
    reason="no AVX512-BF16 build or oneDNN packs bfloat16 weights in another layout here",
)
def test_many_rows_run_on_onednn_with_the_weight_dequantized_into_its_layout():
    kinds = ["Q4_1", "Q6_K", "Q5_0"]  # a fused projection: parts of 32, 32 and 32 rows
    weights = [repack(random_tensor(k, 32, 512, seed=5 + i), k, 32, 512) for i, k in enumerate(kinds)]
    parts = fuse(weights)
    packed = [pack(p, KERNELS.quant_panel_width, KERNELS.quant_unsigned8) for p in parts]
    linear = QuantizedLinear(packed, KERNELS, max_rows=0, tile_max_rows=0)
    assert linear.blocked
    dense = torch.cat([w.dequantize(torch.bfloat16) for w in weights])
    x = torch.randn(200, 512).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(dense, 128), None, "none", [], ""
    )
    assert torch.equal(linear(x), want)  # the same weights, the same GEMM: the same bits
    # A shape it cannot lay out (rows not a multiple of 32) takes the plain GEMM.
    odd_part = pack(repack(random_tensor("Q8_0", 48, 512), "Q8_0", 48, 512), 16, KERNELS.quant_unsigned8)
    odd = QuantizedLinear(packed[:1] + [odd_part], KERNELS, max_rows=0, tile_max_rows=0)
    assert not odd.blocked


@needs_kernels
def test_a_fused_projection_of_mixed_types_writes_each_parts_columns():
    kinds = ["Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
    weights = [repack(random_tensor(k, 24 + 8 * i, 256, seed=i), k, 24 + 8 * i, 256) for i, k in enumerate(kinds)]
    parts = fuse(weights)
    assert [p.source for p in parts] == ["Q5_0", "Q8_0", "Q4_K", "Q6_K"]  # the two Q5_0 stacked into one
    linear = QuantizedLinear([pack(p, KERNELS.quant_panel_width, KERNELS.quant_unsigned8) for p in parts], KERNELS, 8)
    full = torch.cat([w.dequantize() for w in weights])
    x = torch.randn(3, 256)
    want = torch.cat([quantized_rows(x, activation_span(p.source)) @ p.dequantize().T for p in parts], dim=1)
    assert (linear(x) - want).abs().max() <= 2e-5 * full.abs().max() * 256
    # Past max_rows: a float GEMM on the dequantized weight, the activations as they are.
    big = torch.randn(9, 256)
    expected = big @ full.T
    torch.testing.assert_close(linear(big), expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()))


@needs_kernels
def test_the_integer_path_gives_each_row_what_it_gives_that_row_alone():
    weight = repack(random_tensor("Q4_K", 100, 512, seed=3), "Q4_K", 100, 512)
    linear = QuantizedLinear([pack(weight, KERNELS.quant_panel_width, KERNELS.quant_unsigned8)], KERNELS, 1 << 30)
    x = torch.randn(11, 512)
    together = linear(x)
    assert all(torch.equal(together[i], linear(x[i : i + 1])[0]) for i in range(11))  # bit for bit
    # 2,051 rows of 512 outgrow the kernels' L2 budget: they run in blocks of rows, the last partial
    x = torch.randn(2051, 512).to(torch.bfloat16)
    together = linear(x)
    assert all(torch.equal(together[i], linear(x[i : i + 1])[0]) for i in (0, 255, 256, 1029, 2047, 2050))


@needs_kernels
def test_the_integer_peak_counts_every_threads_multiply_adds():
    # benchmarks/quantized_linear.py divides this count by the call's time: each of the pool's
    # threads does 12 chains of one vector of byte products a round
    threads = torch.get_num_threads()
    vector_bytes = KERNELS.quant_panel_width * 4
    assert KERNELS._peak(1000) == threads * 1000 * 12 * vector_bytes
    assert KERNELS.int8_multiply_add_peak(iterations=10_000, repeats=1) > 0


def test_quantized_weight_checks_its_shapes():
    half = torch.float16
    with pytest.raises(ValueError, match="no quantized layout"):
        QuantizedWeight(
            torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2, dtype=half), None, None, None, 5, 16, 0, "Q5_0"
        )
    with pytest.raises(ValueError, match="scales must be torch.float16"):
        QuantizedWeight(
            torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=half), None, None, None, 4, 32, 0, "Q4_0"
        )
    with pytest.raises(ValueError, match="scales must be torch.float16"):
        QuantizedWeight(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1), None, None, None, 4, 32, 0, "Q4_0")
    with pytest.raises(ValueError, match="sub-scales are given exactly"):
        QuantizedWeight(
            torch.zeros(2, 128, dtype=torch.uint8),
            torch.zeros(2, 1, dtype=half),
            None,
            None,
            None,
            4,
            32,
            0,
            "Q4_K",
            256,
        )


# --- the bundled models, native against dequantized -------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
]


@needs_kernels
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_resident_weights_take_no_more_than_the_files_tensors(model):
    path = resolve_model_path(model)
    _, weights = load_weights(path, keep_quantized=True)
    packed = {
        name: pack(w, KERNELS.quant_panel_width, KERNELS.quant_unsigned8)
        for name, w in weights.items()
        if isinstance(w, QuantizedWeight)
    }
    floats = sum(w.numel() * 4 for w in weights.values() if isinstance(w, torch.Tensor))
    resident = sum(p.nbytes for p in packed.values()) + floats
    assert all(isinstance(p, PackedWeight) for p in packed.values())
    assert resident <= 1.05 * gguf_tensor_bytes(path), resident / gguf_tensor_bytes(path)


@needs_kernels
def test_smollm2_native_agrees_with_its_dequantized_weights(make_llm, caplog):
    dequantized = make_llm()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        native = LLM(dtype="float32", weights="native", kv_cache_memory="256MiB")
    try:
        log = caplog.text
        assert "weights native: " in log and "Q4_1 on the 4-bit kernels" in log and "Q8_0 on the 8-bit kernels" in log
        assert native.engine.rank_memory[0].weight_bytes < dequantized.engine.rank_memory[0].weight_bytes / 3
        tok = native.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in PROMPTS]
        # Teacher-forced over each prompt: the activations' 8-bit rounding moves the logits a little.
        # The model's next-token choice stays the same at nearly every position (chat-template
        # positions are the uncertain ones), and the text's negative log-likelihood, the log of
        # its perplexity, within 2%.
        agree = total = 0
        nll = {"native": 0.0, "dequantized": 0.0}
        for ids in prompts:
            ours, reference = our_logits(native, ids), our_logits(dequantized, ids)
            agree += int((ours.argmax(-1) == reference.argmax(-1)).sum())
            total += len(ids)
            assert (ours - reference).abs().max() < 0.1 * reference.abs().max()
            targets = torch.tensor(ids[1:])
            for name, logits in (("native", ours), ("dequantized", reference)):
                nll[name] += float(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum"))
        assert agree / total >= 0.92, agree / total
        assert abs(nll["native"] / nll["dequantized"] - 1) < 0.02, nll
        # Greedy text can part ways where two tokens are nearly tied: on this 135M model the
        # first reply token of two of these prompts differs, and llama.cpp on the same file
        # (which quantizes activations the same way) takes the same turns as the native path.
        # The hash-table answer is one every path agrees on.
        out = native.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
        assert out.text.startswith("A hash table is a data structure"), out.text
        # Decode steps run all layers in one C++ call (on the quantized kernels), bit for bit as
        # the layer loop runs them.
        model = native.engine.runner.model
        fused, params = model.fused_decode, SamplingParams(temperature=0.0, max_tokens=20)
        assert fused is not None
        with_fused = [o.outputs[0].token_ids for o in native.generate(prompts, params)]
        model.fused_decode = None
        try:
            assert [o.outputs[0].token_ids for o in native.generate(prompts, params)] == with_fused
        finally:
            model.fused_decode = fused
    finally:
        native.engine.shutdown()


@needs_kernels
def test_the_server_runs_the_native_path_by_default():
    import openai

    from pagedllm.testing.servers import API_KEY, MODEL, serve_subprocess

    with serve_subprocess("--dtype", "float32", "--kv-cache-memory", "128MiB") as server:
        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Name the capital of France."}]
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert "Paris" in text
        stats = server.wait_until(lambda s: s["running"] == 0 and s["kv"]["used_blocks"] == 0)
        assert stats["weights"] == "native"


def test_native_weights_refuse_what_they_cannot_run(tmp_path):
    from pagedllm.testing.hf_reference import save_random_llama

    save_random_llama(tmp_path, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(tmp_path), weights="native")
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels"):
        LLM(weights="native", attention="torch", kv_cache_memory="64MiB")
    llm = LLM(str(tmp_path), kv_cache_memory="64MiB")  # auto: a checkpoint directory stays float
    assert llm.engine.runner.model.embed_packed is None
    llm.engine.shutdown()


def test_rows_dequantized_together_give_the_gguf_packages_values():
    """The loader hands consecutive rows to the `gguf` package as one (pagedllm/models/gguf_weights.py:
    dequantize_tensor): every tensor of the bundled file, and row counts of every parity, come out
    as the package gives them row by row."""
    import gguf
    import numpy as np

    from pagedllm.models.gguf_file import GGUFFile
    from pagedllm.models.gguf_weights import dequantize_tensor
    from pagedllm.models.loader import default_model_path

    for tensor in GGUFFile(default_model_path()).tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        assert np.array_equal(dequantize_tensor(tensor.data, tensor.tensor_type, shape), expected), tensor.name
    rng = np.random.default_rng(0)
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        for rows in (1, 7, 48, 96):
            values = rng.standard_normal((rows, 64)).astype(np.float32)
            data = gguf.quants.quantize(values, kind)
            expected = gguf.quants.dequantize(data, kind).reshape(rows, 64)
            assert np.array_equal(dequantize_tensor(data, kind, [rows, 64]), expected), (kind, rows)
