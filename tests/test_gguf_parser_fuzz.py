"""The GGUF header parser and the checks after it, on random bytes and on random patches and cuts
of a small valid file: each either reads a model or raises a ModelFileError, never another
exception, whatever the bytes say."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.errors import ModelFileError
from pagedllm.models.gguf_config import check_gguf
from pagedllm.models.gguf_file import GGUFFile

HIDDEN, HEADS, VOCAB, INTER = 64, 4, 8, 96


def _small_gguf(path: Path) -> bytes:
    """A one-layer llama GGUF with a tiny vocabulary, in float32 and Q8_0."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(2)
    writer.add_context_length(128)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rng = np.random.default_rng(0)
    d = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (2 * d, HIDDEN),
        "blk.0.attn_v.weight": (2 * d, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (INTER, HIDDEN),
        "blk.0.ffn_up.weight": (INTER, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTER),
    }
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.ffn_up.weight":
            quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> bytes:
    raw = _small_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf")
    return raw


def _read(raw: bytes, path: Path) -> None:
    path.write_bytes(raw)
    try:
        reader = GGUFFile(path)
        check_gguf(reader, path)
    except ModelFileError as error:
        assert "\n" not in str(error)


def test_the_small_file_reads(base, tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(base)
    config = check_gguf(GGUFFile(path), path)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (1, HIDDEN, VOCAB)


_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(tmp_path, data):
    _read(b"GGUF\x03\x00\x00\x00" + data, tmp_path / "random.gguf")
    _read(data, tmp_path / "random.gguf")


@_FUZZ
@given(st.data())
def test_random_patches_and_cuts(base, tmp_path, data):
    raw = bytearray(base)
    # Mostly in the header, where the counts, lengths and offsets are.
    header_end = min(len(raw), 4096)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, header_end - 1))
        patch = data.draw(st.binary(min_size=1, max_size=8))
        raw[at : at + len(patch)] = patch
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    _read(bytes(raw), tmp_path / "patched.gguf")
