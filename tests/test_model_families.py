"""RoPE variants and the architectures built on the llama layers, on tiny random-weight
checkpoints that transformers builds (in float32): linear, dynamic NTK, llama3 and YaRN
scaling on llama; Phi-3 with LongRoPE, partial rotary and its fused projections; SmolLM3 with
a NoPE layer; Granite's multipliers; Qwen3-MoE with a dense layer among the MoE ones.

The prompts run past every scaling threshold (the original length of llama3, YaRN and
LongRoPE, the model length of dynamic NTK), and some cross it while decoding, where
LongRoPE and dynamic NTK change frequencies per token.  Greedy tokens equal transformers',
batched with chunked prefill and alone with prefix-cache hits; logits within 1e-4."""

import numpy as np
import pytest
import torch

from pagedllm import LLM
from pagedllm.layers.rotary import RopeScaling, dynamic_frequencies, inverse_frequencies
from pagedllm.models.hf_config import config_from_hf_dict
from pagedllm.testing.hf_reference import greedy, hf_greedy, hf_logits, our_logits, save_random_model
from tests.test_architectures import SHAPE as ARCHITECTURE_SHAPE

SHAPE = {**ARCHITECTURE_SHAPE, "max_position_embeddings": 128}  # short, so that prompts pass every threshold
LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0 + 0.05 * i for i in range(16)],  # phi3 below rotates 32 of 64 dims: 16 pairs
    long_factor=[1.0 + 0.4 * i for i in range(16)],
)
CASES = {
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": 64}),
    # The model length is 48: the 70-token prompt is past it, the 40-token one crosses it decoding.
    "llama-dynamic": (
        "llama",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 48},
    ),
    "llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),  # fmt: skip
    "llama-yarn": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    # LongRoPE past an original length of 32 (the 17-token prompt crosses it decoding), half the
    # head rotating (Phi-4-mini), q/k/v and gate/up stored fused.
    "phi3-longrope-partial": (
        "phi3",
        {"rope_scaling": LONGROPE, "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5},
    ),
    "smollm3-nope": ("smollm3", {"num_hidden_layers": 4, "pad_token_id": None}),  # layer 3 has no rotary
    "granite": (
        "granite",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.05, "logits_scaling": 4.0},
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, extra = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    shape = {k: v for k, v in SHAPE.items() if not (model_type == "phi3" and k == "head_dim")}
    model = save_random_model(path, model_type, **{**shape, **extra})
    return request.param, path, model


def test_greedy_and_logits_match_transformers(checkpoint):
    name, path, hf_model = checkpoint
    # A float32 KV cache, as transformers holds (the float16 one: tests/test_kv_cache_dtype.py).
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="float32", block_size=8, kv_cache_memory="16MiB",
              max_num_batched_tokens=32)  # fmt: skip
    config = llm.engine.model_config
    assert config.architecture == CASES[name][0]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1000, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 70)]
    expected = [hf_greedy(hf_model, prompt, 24) for prompt in prompts]
    assert [out.token_ids for out in llm.generate(prompts, greedy(24))] == expected  # batched, chunked
    hits = llm.engine.scheduler.prefix_cache_hit_tokens
    assert llm.generate([prompts[3]], greedy(24))[0].token_ids == expected[3]  # alone, a prefix-cache hit
    assert llm.engine.scheduler.prefix_cache_hit_tokens > hits
    for prompt, tokens in zip(prompts, expected):
        ids = prompt + tokens
        torch.testing.assert_close(our_logits(llm, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_the_config_says_what_each_family_runs(tmp_path):
    def config(model_type, **extra):
        from transformers import AutoConfig

        return config_from_hf_dict(AutoConfig.for_model(model_type, **{**SHAPE, **extra}).to_dict())

    phi3 = config("phi3", rope_scaling=LONGROPE, original_max_position_embeddings=32, partial_rotary_factor=0.5)
    assert phi3.rotary_dim == 32 and phi3.rope_scaling.rope_type == "longrope"
    assert phi3.rope_scaling.original_max_position_embeddings == 32
    assert config("smollm3", num_hidden_layers=8).layer_rope == (True, True, True, False) * 2
    moe = config("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[1])
    assert moe.layer_moe == (True, False, True) and moe.qk_norm
    assert config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}).context_length == 256
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert config("llama", rope_scaling=yarn).context_length == 256


@pytest.mark.parametrize(
    "model_type,extra,message",
    [
        ("llama", {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope scaling 'mrope' is not supported"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported for llama"),
        ("llama", {"hidden_act": "gelu"}, "llama with activation 'gelu' is not supported"),
        ("llama", {"mlp_bias": True}, "MLP biases"),
        ("granite", {"attention_bias": True}, "granite checkpoints with attention biases"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(model_type, extra, message):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **SHAPE).to_dict()
    cfg.update(extra)
    with pytest.raises(ValueError, match=message):
        config_from_hf_dict(cfg)


ROPE_PARAMETERS = {
    "linear": {"factor": 3.0},
    "dynamic": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7, "mscale_all_dim": 1.0},
    "yarn-untruncated": {"factor": 4.0, "original_max_position_embeddings": 64, "truncate": False, "beta_fast": 16},
    "longrope": {
        "short_factor": [1.0 + 0.1 * i for i in range(32)],
        "long_factor": [2.0 + 0.5 * i for i in range(32)],
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("variant", list(ROPE_PARAMETERS))
def test_frequencies_equal_transformers_for_each_rope_type(variant):
    """Our frequencies and cos/sin factor against transformers' own functions for each type."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = variant.split("-")[0]
    params = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPE_PARAMETERS[variant]}
    hf_config = LlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=256, rope_parameters=params)
    ours = config_from_hf_dict(hf_config.to_dict())
    for long in (False, True) if rope_type == "longrope" else (False,):
        seq_len = 257 if long else None  # longrope's long factors past its original length
        if rope_type == "longrope" and long:
            seq_len = 65
        expected, expected_attention = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)
        got, attention = inverse_frequencies(ours.rope_scaling, ours.rope_theta, 64, 256, long=long)
        torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
        assert attention == pytest.approx(expected_attention, rel=1e-9)
    if rope_type == "dynamic":  # past the model's length: a base grown for each length
        for length in (257, 400):
            expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=torch.tensor(length))
            got = dynamic_frequencies(10000.0, 64, 2.0, 256, torch.tensor([length]))[0]
            torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)


def test_unknown_rope_parameters_fail_clearly():
    with pytest.raises(ValueError, match="rope type 'linear' needs a scaling factor"):
        RopeScaling("linear")
    with pytest.raises(ValueError, match="short_factor has 3 values, but a rotary dimension of 64 needs 32"):
        inverse_frequencies(RopeScaling("longrope", short_factor=(1.0,) * 3, long_factor=(1.0,) * 3), 1e4, 64, 64)


# --- the same checkpoints from GGUF ------------------------------------------------------

GGUF_EXTRA_CASES = {  # architectures whose HF-directory parity tests/test_architectures.py covers
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {"sliding_window": 24}),
    "gemma3": ("gemma3_text", {"num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 256}),
}


def _gguf_roundtrip(path, hf_model, tmp_path):
    from pagedllm.testing.gguf_export import write_gguf

    gguf_path = write_gguf(path, tmp_path / "model.gguf")
    llm = LLM(str(gguf_path), dtype="float32", kv_cache_dtype="float32", block_size=8, kv_cache_memory="16MiB",
              max_num_batched_tokens=32)  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1000, 49152, (n,), generator=gen).tolist() for n in (9, 45, 70)]
    expected = [hf_greedy(hf_model, prompt, 16) for prompt in prompts]
    assert [out.token_ids for out in llm.generate(prompts, greedy(16))] == expected
    return llm


def test_a_gguf_of_each_family_gives_the_same_tokens(checkpoint, tmp_path):
    name, path, hf_model = checkpoint
    if name == "llama-dynamic":  # GGUF has no dynamic NTK scaling
        pytest.skip("dynamic NTK has no GGUF form")
    llm = _gguf_roundtrip(path, hf_model, tmp_path)
    config = llm.engine.model_config
    expected_type = {"llama3": "freq_factors", "phi3-longrope-partial": "longrope"}
    assert config.rope_scaling.rope_type == expected_type.get(name, config.rope_scaling.rope_type)


@pytest.mark.parametrize("name", list(GGUF_EXTRA_CASES))
def test_a_gguf_of_each_other_architecture_gives_the_same_tokens(name, tmp_path):
    model_type, extra = GGUF_EXTRA_CASES[name]
    model = save_random_model(tmp_path / "hf", model_type, **{**SHAPE, **extra})
    if model_type == "gemma3_text":  # give the (1 + w) norms weights that matter
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.normal_(0.0, 0.3)
        model.save_pretrained(tmp_path / "hf")
    llm = _gguf_roundtrip(tmp_path / "hf", model, tmp_path)
    assert llm.engine.model_config.layer_windows[0] == {"mistral-window": 24, "gemma3": 16}.get(name, 0)


def test_a_gguf_pre_tokenizer_type_decides_how_text_is_split(tmp_path):
    """The tokenizer comes from the file's own vocabulary and its `tokenizer.ggml.pre`: Llama 3's
    split keeps up to three digits together, Qwen2's splits every digit."""
    from pagedllm.testing.gguf_export import write_gguf
    from pagedllm.text.tokenizer import Tokenizer

    save_random_model(tmp_path / "hf", "llama", **{**SHAPE, "num_hidden_layers": 1})
    splits = {}
    for pre in ("llama-bpe", "qwen2"):
        path = write_gguf(tmp_path / "hf", tmp_path / f"{pre}.gguf", tokenizer_pre=pre)
        pre_tokenizer = Tokenizer(path).hf.backend_tokenizer.pre_tokenizer
        splits[pre] = [piece for piece, _ in pre_tokenizer.pre_tokenize_str("12345")]
    assert splits == {"llama-bpe": ["123", "45"], "qwen2": ["1", "2", "3", "4", "5"]}


def test_an_unknown_gguf_tensor_is_named(tmp_path):
    import gguf

    from pagedllm.testing.gguf_export import write_gguf

    save_random_model(tmp_path / "hf", "llama", **{**SHAPE, "num_hidden_layers": 1})
    path = write_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    for name, f in reader.fields.items():
        if not name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(name, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    writer.add_tensor("blk.0.attn_sinks.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_sinks.weight': is not one a llama model has"):
        LLM(str(tmp_path / "extra.gguf"), dtype="float32", kv_cache_memory="16MiB")


def test_the_gguf_tokenizer_equals_transformers_reading_of_the_file():
    """Read straight from the metadata, the bundled file's tokenizer gives what
    `AutoTokenizer.from_pretrained(gguf_file=...)` gives: ids, text back, chat template."""
    from transformers import AutoTokenizer

    from pagedllm.models.loader import default_model_path
    from pagedllm.text.tokenizer import _tokenizer_from_gguf

    path = default_model_path()
    ours, reference = _tokenizer_from_gguf(path), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("Hello world, 12345!", "  two spaces\n\nand émoji 🙂", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == reference.decode(
            reference.encode(text), skip_special_tokens=True
        )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (
        reference.eos_token_id, reference.bos_token_id, len(reference),
    )  # fmt: skip


def test_the_gguf_header_reader_reads_what_the_gguf_package_reads(tmp_path):
    """pagedllm's lazy GGUF reader against the `gguf` package's on a file with every value kind,
    string arrays, and float and quantized tensors: the same values, types, shapes and bytes."""
    import gguf

    from pagedllm.models.gguf_file import GGUFFile, StringArray

    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_uint32("t.u32", 7)
    writer.add_int64("t.i64", -3)
    writer.add_float32("t.f32", 0.5)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "bc", "", "déf"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    for kind in ("Q8_0", "Q4_0"):  # (the gguf package quantizes these; K-quants it only reads)
        qtype = gguf.GGMLQuantizationType[kind]
        data = gguf.quants.quantize(rng.standard_normal((4, 256)).astype(np.float32), qtype)
        writer.add_tensor(kind, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = GGUFFile(tmp_path / "t.gguf"), gguf.GGUFReader(str(tmp_path / "t.gguf"))
    assert set(ours.fields) == {name for name in theirs.fields if not name.startswith("GGUF.")}
    for name, value in ours.fields.items():
        expected = theirs.fields[name].contents()
        assert value == (StringArray(len(expected)) if name == "t.strs" else expected), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["f32", "f16", "Q8_0", "Q4_0"]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape) and a.n_bytes == b.n_bytes
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(60))
        GGUFFile(tmp_path / "bad.gguf")
