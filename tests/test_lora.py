"""LoRA adapters: PEFT directories made by PEFT itself on a tiny random llama give
transformers+PEFT's greedy tokens and logits, alone and mixed in one batch with each other and the
base model, through chunked prefill and prefix-cache hits; KV blocks never cross adapters; bad
adapter files are refused by name; llama.cpp's GGUF form of an adapter gives its PEFT form's
tokens; nothing is left held."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pagedllm import LLM
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.errors import ModelFileError
from pagedllm.testing.hf_reference import hf_greedy, save_random_llama


def import_peft():
    """PEFT, imported when a test first needs it: importing it imports triton, which must not happen
    while the test modules are collected (tests/test_triton_attention.py sets TRITON_INTERPRET first)."""
    return pytest.importorskip("peft")


ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "attn": (4, 8, ["q_proj", "v_proj"], False),
    "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"], False),
    "all": (16, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "kv-o": (2, 4, ["k_proj", "o_proj"], False),
}


def peft_adapter(base, rank: int, alpha: float, targets, std: float, seed: int, rslora: bool = False):
    """A PEFT LoRA model over a copy of `base` whose A and B are random (B drawn from N(0, std): PEFT's
    own random init leaves it small, and the update must change the tokens)."""
    peft = import_peft()
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The base checkpoint, and per adapter its PEFT directory and transformers+PEFT model."""
    root = tmp_path_factory.mktemp("lora")
    base = save_random_llama(
        root / "base",
        hidden_size=64,  # head_dim 16: the pure-torch attention, which matches transformers to 1e-5
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,  # clear argmax gaps (see test_parity_tiny)
    )
    adapters = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        model = peft_adapter(base, rank, alpha, targets, std=0.3, seed=100 + i, rslora=rslora)
        model.save_pretrained(root / name)
        adapters[name] = (root / name, model)
    return root / "base", base, adapters


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 64, 23, 9)[:count]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def make_llm(path, adapters, **kwargs) -> LLM:
    modules = [f"{name}={adapter_path}" for name, (adapter_path, _) in adapters.items()]
    args = dict(dtype="float32", block_size=8, kv_cache_memory="16MiB", lora_modules=modules) | kwargs
    return LLM(str(path), **args)


def assert_nothing_held(llm: LLM) -> None:
    assert llm.engine.num_kv_blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_each_adapter_alone_matches_transformers_with_peft(tiny):
    path, base, adapters = tiny
    llm = make_llm(path, adapters)
    for name, (_, reference) in adapters.items():
        for prompt in prompts(3):
            output = llm.generate([prompt], greedy(12), lora=name)[0]
            assert output.token_ids == hf_greedy(reference, prompt, 12), name
    # The adapters do change the output: the base model's tokens differ from at least one adapter's.
    prompt = prompts(1)[0]
    assert llm.generate([prompt], greedy(12))[0].token_ids == hf_greedy(base, prompt, 12)
    assert any(hf_greedy(ref, prompt, 12) != hf_greedy(base, prompt, 12) for _, ref in adapters.values())
    assert_nothing_held(llm)


def test_logits_match_transformers_with_peft(tiny):
    path, _, adapters = tiny
    llm = make_llm(path, adapters)
    prompt = prompts(4)[3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    for name, (_, reference) in adapters.items():
        output = llm.generate([prompt], params, lora=name)[0].outputs[0]
        ids = prompt + output.token_ids
        expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
        for i, entry in enumerate(output.logprobs):
            row = expected[len(prompt) - 1 + i]
            top = [token for token, _ in entry.top]
            assert top == row.topk(5).indices.tolist(), (name, i)
            ours = torch.tensor([logprob for _, logprob in entry.top])
            torch.testing.assert_close(ours, row.topk(5).values, atol=1e-4, rtol=1e-4)


def test_four_adapters_and_the_base_in_one_batch_with_chunked_prefill(tiny):
    path, base, adapters = tiny
    # A 24-token step budget cuts the longer prompts into chunks that share steps with the others.
    llm = make_llm(path, adapters, max_num_batched_tokens=24)
    names = [*adapters, None, "attn"]
    batch = prompts(6, seed=7)
    outputs = llm.generate(batch, greedy(10), lora=names)
    for prompt, name, output in zip(batch, names, outputs):
        reference = base if name is None else adapters[name][1]
        assert output.token_ids == hf_greedy(reference, prompt, 10), name
    assert_nothing_held(llm)


def test_prefix_cache_never_shares_blocks_across_adapters(tiny):
    path, base, adapters = tiny
    llm = make_llm(path, adapters)
    prompt = prompts(4)[3]  # 64 tokens: 8 full blocks
    llm.generate([prompt], greedy(4), lora="attn")
    hits = llm.engine.state()["prefix_cache_hit_tokens"]
    # The same prompt under another adapter, and under none: no hit, and each adapter's own tokens.
    assert llm.generate([prompt], greedy(8), lora="mlp")[0].token_ids == hf_greedy(adapters["mlp"][1], prompt, 8)
    assert llm.generate([prompt], greedy(8))[0].token_ids == hf_greedy(base, prompt, 8)
    assert llm.engine.state()["prefix_cache_hit_tokens"] == hits
    # Under the first adapter again: its blocks are found, and the tokens are still its own.
    assert llm.generate([prompt], greedy(8), lora="attn")[0].token_ids == hf_greedy(adapters["attn"][1], prompt, 8)
    assert llm.engine.state()["prefix_cache_hit_tokens"] > hits
    assert_nothing_held(llm)


def test_samples_and_beams_keep_their_adapter(tiny):
    path, _, adapters = tiny
    llm = make_llm(path, adapters)
    prompt = prompts(2)[1]
    reference = hf_greedy(adapters["all"][1], prompt, 6)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3)
    output = llm.generate([prompt], params, lora="all")[0]
    assert [o.token_ids for o in output.outputs] == [reference] * 3
    beams = LLM.beam_search(llm, [prompt], beam_width=2, max_tokens=4)
    assert beams[0].outputs  # the base model's beams still run beside the adapters
    assert_nothing_held(llm)


def test_unknown_adapter_and_unload_in_use_are_clear_errors(tiny):
    path, _, adapters = tiny
    llm = make_llm(path, adapters)
    with pytest.raises(KeyError, match="no LoRA adapter named 'nope'"):
        llm.engine.add_request([5, 6, 7], greedy(2), lora="nope")
    request_id = llm.engine.add_request([5, 6, 7], greedy(4), lora="mlp")
    with pytest.raises(ValueError, match="in use by 1 unfinished"):
        llm.engine.unload_lora("mlp")
    llm.engine.abort_request(request_id)
    llm.engine.unload_lora("mlp")
    assert "mlp" not in {a["name"] for a in llm.engine.lora_adapters()}
    # Loaded again under the same name: a new key, so its cached blocks are its own.
    llm.engine.load_lora("mlp", str(adapters["mlp"][0]))
    assert_nothing_held(llm)


def test_rank_limit(tiny):
    path, _, adapters = tiny
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", max_lora_rank=8)
    llm.engine.load_lora("attn", str(adapters["attn"][0]))
    with pytest.raises(ModelFileError, match="rank 16 is over the engine's max_lora_rank of 8"):
        llm.engine.load_lora("all", str(adapters["all"][0]))
    assert [a["name"] for a in llm.engine.lora_adapters()] == ["attn"]


def test_a_hundred_adapters_registered_with_room_for_eight(tiny, tmp_path):
    """100 registered, 8 resident: a stream of requests over all of them completes, each with its
    own adapter's tokens (adapters read again after eviction give the same), and nothing is held."""
    from pagedllm.models.loader import read_model_config
    from pagedllm.testing.lora import write_random_adapter

    path, _, adapters = tiny
    config = read_model_config(path)
    llm = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory="16MiB", max_loras=8, max_num_seqs=12)
    names = [f"n{i}" for i in range(100)]
    for i, name in enumerate(names):
        adapter = write_random_adapter(tmp_path / name, config, rank=2 + i % 3, seed=i, std=0.3)
        llm.engine.load_lora(name, str(adapter))
    listed = llm.engine.lora_adapters()
    assert len(listed) == 100 and sum(a["resident"] for a in listed) == 8
    # Each adapter alone first: the tokens to expect.
    prompt = prompts(2)[1]
    alone = {name: llm.generate([prompt], greedy(6), lora=name)[0].token_ids for name in names[::7]}
    # Then all 100 at once, 12 running at a time over 8 slots: the rest wait for an idle adapter.
    outputs = llm.generate([prompt] * 100, greedy(6), lora=names)
    assert all(o.finish_reason == "length" for o in outputs)
    for name, output in zip(names, outputs):
        if name in alone:
            assert output.token_ids == alone[name], name
    assert len({tuple(o.token_ids) for o in outputs}) > 50  # the adapters differ
    assert llm.engine.adapters.num_evictions >= 92
    assert sum(a["resident"] for a in llm.engine.lora_adapters()) == 8
    lora = llm.engine.state()["lora"]  # what /stats, /metrics and the dashboard show
    assert (lora["registered"], lora["resident"], lora["evictions"]) == (100, 8, llm.engine.adapters.num_evictions)
    assert lora["resident_bytes"] == sum(w.nbytes for w in llm.engine.adapters.resident.values()) > 0
    # Resident adapters live in the KV cache's own blocks: pages it counts, no more than a tenth
    # past their bytes' worth of blocks (alignment, and each tensor whole in one K or V span).
    assert lora["in_kv_pages"] and lora["resident_kv_blocks"] == llm.engine.kv_cache.num_page_blocks
    worth = -(-lora["resident_bytes"] // llm.engine.kv_block_bytes)
    assert worth <= lora["resident_kv_blocks"] <= 1.1 * worth
    assert_nothing_held(llm)


def test_adapters_and_kv_share_the_blocks_idle_adapters_give_theirs_back(tiny):
    """Resident adapters hold runs of the KV cache's blocks; a request that needs those blocks
    takes them from idle adapters (least recently used first), and an adapter read back later
    gives the same tokens."""
    path, base, adapters = tiny
    llm = make_llm(path, adapters, kv_cache_memory="768KiB", max_model_len=512)
    kv = llm.engine.kv_cache
    held = kv.num_page_blocks
    assert held > kv.num_blocks // 2 and len(llm.engine.adapters.resident) == 4
    assert kv.block_states().count("a") == held
    prompt = prompts(4)[3]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    output = llm.generate([prompt], long)[0]  # more blocks than the adapters left free
    assert len(output.token_ids) == 400 and output.token_ids[:12] == hf_greedy(base, prompt, 12)
    assert kv.num_page_blocks < held and len(llm.engine.adapters.resident) < 4
    for name in adapters:  # read back where evicted, the same tokens as PEFT's
        assert llm.generate([prompt], greedy(6), lora=name)[0].token_ids == hf_greedy(adapters[name][1], prompt, 6)
    assert_nothing_held(llm)


def test_an_adapter_or_a_request_too_big_for_the_cache_beside_it_is_refused(tiny):
    """No request waits forever for blocks its own adapter's pages hold: an adapter larger than
    the cache is refused at load, a request that fits the cache alone but not beside its
    adapter's pages at submission."""
    path, _, adapters = tiny
    probe = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory="16MiB")
    probe.engine.load_lora("all", str(adapters["all"][0]))
    pages = probe.engine.adapters.blocks_of(probe.engine.adapters.key_of("all"))
    block_bytes = probe.engine.kv_block_bytes
    del probe
    small = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory=str((pages - 1) * block_bytes))
    with pytest.raises(ValueError, match=f"needs {pages} blocks of the KV cache for its pages; the cache has"):
        small.engine.load_lora("all", str(adapters["all"][0]))
    llm = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory=str((pages + 40) * block_bytes))
    llm.engine.load_lora("all", str(adapters["all"][0]))
    params = SamplingParams(max_tokens=41 * 8 - 5, ignore_eos=True)  # 41 blocks with its 5-token prompt
    llm.engine.add_request([1, 2, 3, 4, 5], params, "alone")  # fits without the adapter
    llm.engine.abort_request("alone")
    with pytest.raises(ValueError, match="beside its LoRA adapter's .* blocks of pages"):
        llm.engine.add_request([1, 2, 3, 4, 5], params, "beside", lora="all")
    assert_nothing_held(llm)


def test_an_adapter_removed_or_changed_on_disk_ends_its_requests(tiny, tmp_path):
    import shutil

    path, base, adapters = tiny
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", max_loras=1)
    shutil.copytree(adapters["attn"][0], tmp_path / "attn")
    shutil.copytree(adapters["attn"][0], tmp_path / "changed")
    llm.engine.load_lora("attn", str(adapters["attn"][0]))
    llm.engine.load_lora("gone", str(tmp_path / "attn"))  # registered, not resident (one slot)
    llm.engine.load_lora("changed", str(tmp_path / "changed"))
    shutil.rmtree(tmp_path / "attn")
    shutil.rmtree(tmp_path / "changed")
    shutil.copytree(adapters["mlp"][0], tmp_path / "changed")  # a valid adapter, other weights
    outputs = llm.generate(prompts(4), greedy(4), lora=["attn", "gone", None, "changed"])
    assert outputs[1].finish_reason == "error" and "LoRA adapter 'gone' could not be loaded" in outputs[1].error
    assert outputs[3].finish_reason == "error" and "changed on disk since the adapter was loaded" in outputs[3].error
    assert outputs[0].token_ids == hf_greedy(adapters["attn"][1], prompts(4)[0], 4)
    assert outputs[2].token_ids == hf_greedy(base, prompts(4)[2], 4)
    assert_nothing_held(llm)


def rewrite_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    settings = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(settings | changes))
    return dst


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_dora": True}, "DoRA adapters are not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "trained biases are not supported"),
        ({"peft_type": "IA3"}, "'IA3' adapters are not supported"),
        ({"r": 0}, "not a positive integer rank"),
        ({"r": 5}, "rank 5 on this model needs"),
        ({"lora_alpha": "big"}, "not a finite number"),
    ],
)
def test_bad_adapter_configs_are_refused_by_name(tiny, tmp_path, changes, message):
    path, _, adapters = tiny
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    bad = rewrite_config(adapters["attn"][0], tmp_path / "bad", **changes)
    with pytest.raises(ModelFileError, match=message):
        llm.engine.load_lora("bad", str(bad))
    assert llm.engine.lora_adapters() == []


def test_bad_adapter_tensors_are_refused_by_name(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, adapters = tiny
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    source = adapters["attn"][0]
    tensors = load_file(str(source / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    cases = {
        "nan": ({**tensors, first: torch.full_like(tensors[first], float("nan"))}, "NaN or infinity"),
        "head": ({**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "LM head adapter"),
        "layer": (
            {**tensors, "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
            "names layer 9; the model has 3",
        ),
        "half": ({k: v for k, v in tensors.items() if k != first}, "has no lora_"),
    }
    for case, (content, message) in cases.items():
        bad = rewrite_config(source, tmp_path / case)
        save_file(content, str(bad / "adapter_model.safetensors"))
        with pytest.raises(ModelFileError, match=message):
            llm.engine.load_lora(case, str(bad))
    with pytest.raises(ModelFileError, match="no adapter_config.json"):
        llm.engine.load_lora("empty", str(tmp_path))


def test_gguf_adapters_give_the_peft_adapters_tokens_over_a_gguf_base(tiny, tmp_path):
    """Each adapter written as llama.cpp's converter writes it (q/k rows interleaved, rsLoRA's scale
    as an alpha), all four and the base in one batch over the base's own GGUF form."""
    from pagedllm.models.loader import read_model_config
    from pagedllm.testing.gguf_export import write_gguf
    from pagedllm.testing.lora import write_gguf_adapter

    path, base, adapters = tiny
    config = read_model_config(path)
    files = {name: write_gguf_adapter(d, tmp_path / f"{name}.gguf", config) for name, (d, _) in adapters.items()}
    llm = LLM(
        str(write_gguf(path, tmp_path / "base.gguf")),
        dtype="float32",
        block_size=8,
        kv_cache_memory="16MiB",
        lora_modules=[f"{name}={file}" for name, file in files.items()],
    )
    names = [*adapters, None]
    batch = prompts(5, seed=3)
    for prompt, name, output in zip(batch, names, llm.generate(batch, greedy(10), lora=names)):
        assert output.token_ids == hf_greedy(base if name is None else adapters[name][1], prompt, 10), name
    assert_nothing_held(llm)


@pytest.mark.parametrize("tensor_type, tolerance", [("F16", 1e-3), ("Q8_0", 1e-2)])
def test_gguf_adapter_tensor_types_read_as_the_peft_values(tiny, tmp_path, tensor_type, tolerance):
    from pagedllm.models.loader import read_model_config
    from pagedllm.models.lora_files import read_adapter
    from pagedllm.testing.lora import write_gguf_adapter

    path, _, adapters = tiny
    config = read_model_config(path)
    directory = adapters["all"][0]
    peft_form = read_adapter(directory, config, 64)
    gguf_form = read_adapter(write_gguf_adapter(directory, tmp_path / "a.gguf", config, tensor_type), config, 64)
    assert gguf_form.rank == peft_form.rank and gguf_form.scale == pytest.approx(peft_form.scale)
    for ours, theirs in zip(gguf_form.layers, peft_form.layers):
        assert ours.keys() == theirs.keys()
        for module, (a, b) in ours.items():
            torch.testing.assert_close(a, theirs[module][0], atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(b, theirs[module][1], atol=tolerance * 4, rtol=tolerance)


def write_adapter_gguf(path, tensors: dict, arch: str = "llama", kind: str = "adapter", alpha: float = 8.0):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", kind)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, array in tensors.items():  # an array, or (quantized bytes, their type)
        data, raw_dtype = array if isinstance(array, tuple) else (array, None)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_gguf_adapters_are_refused_by_name(tiny, tmp_path):
    import gguf
    import numpy as np

    path, _, _ = tiny
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    a, b = np.zeros((4, 64), np.float32), np.zeros((64, 4), np.float32)
    good = {"blk.0.attn_q.weight.lora_a": a, "blk.0.attn_q.weight.lora_b": b}
    q4 = (gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0)
    cases = {
        "model": (good, {"kind": "model"}, "a GGUF LoRA adapter says 'adapter'"),
        "arch": (good, {"arch": "qwen2"}, "'qwen2' is not the base model's architecture"),
        "embed": ({**good, "token_embd.weight.lora_a": a}, {}, "embedding or LM head adapter"),
        "norm": ({**good, "blk.0.attn_norm.weight.lora_a": a}, {}, "only q/k/v/o/gate/up/down"),
        "half": ({"blk.0.attn_q.weight.lora_a": a}, {}, "has no lora_b"),
        "ranks": ({**good, "blk.1.attn_v.weight.lora_a": np.zeros((2, 64), np.float32)}, {}, "one rank"),
        "layer": ({**good, "blk.7.attn_q.weight.lora_a": a}, {}, "names layer 7; the model has 3"),
        "flat": ({**good, "blk.1.attn_v.weight.lora_a": np.zeros(256, np.float32)}, {}, "a LoRA factor is a matrix"),
        "nan": ({**good, "blk.0.attn_q.weight.lora_b": np.full((64, 4), np.nan, np.float32)}, {}, "NaN"),
        "type": ({**good, "blk.0.attn_q.weight.lora_a": q4}, {}, "is Q4_0; adapter tensors are read in"),
    }
    for case, (tensors, settings, message) in cases.items():
        file = write_adapter_gguf(tmp_path / f"{case}.gguf", tensors, **settings)
        with pytest.raises(ModelFileError, match=message):
            llm.engine.load_lora(case, str(file))
    (tmp_path / "junk.bin").write_bytes(b"not a model" * 10)
    with pytest.raises(ModelFileError, match="neither a directory nor a GGUF file"):
        llm.engine.load_lora("junk", str(tmp_path / "junk.bin"))
    assert llm.engine.lora_adapters() == []


def test_combinations_without_adapter_support_are_refused(tiny):
    path, _, adapters = tiny
    modules = [f"attn={adapters['attn'][0]}"]
    with pytest.raises(ValueError, match="speculative='off'"):
        LLM(str(path), dtype="float32", lora_modules=modules, speculative="ngram")
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        LLM(str(path), dtype="float32", lora_modules=modules, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="NAME=PATH"):
        LLM(str(path), dtype="float32", lora_modules=["just-a-path"])
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", speculative="ngram")
    with pytest.raises(ValueError, match="speculative decoding does not verify drafts under adapters"):
        llm.engine.load_lora("attn", str(adapters["attn"][0]))


@pytest.fixture(scope="module")
def smollm2_adapter(hf_model, tmp_path_factory):
    """A random rank-16 PEFT adapter on the real SmolLM2 (every projection), and transformers+PEFT
    running it on the GGUF's weights."""
    model = peft_adapter(hf_model, 16, 32, ADAPTERS["all"][2], std=0.02, seed=5)
    path = tmp_path_factory.mktemp("smollm2-lora")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def hf_replies(hf_model, smollm2_adapter):
    """transformers' greedy replies, each computed once for the module: both weight forms compare
    against the same ones (the models are the module's fixtures, so their ids stay theirs)."""
    replies: dict[tuple[int, tuple[int, ...], int], list[int]] = {}

    def reply(model, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (id(model), tuple(prompt), max_new_tokens)
        if key not in replies:
            replies[key] = hf_greedy(model, prompt, max_new_tokens)
        return replies[key]

    return reply


@pytest.mark.parametrize("weights", ["dequantized", "native"])
def test_real_smollm2_with_an_adapter_matches_transformers_with_peft(smollm2_adapter, hf_model, hf_replies, weights):
    from pagedllm.testing.hf_reference import first_divergence_is_a_near_tie

    path, reference = smollm2_adapter
    llm = LLM(dtype="float32", weights=weights, kv_cache_memory="256MiB", lora_modules=[f"tuned={path}"])
    chat = llm.tokenizer.apply_chat_template
    batch = [chat([{"role": "user", "content": q}]) for q in ("What is a hash table?", "Name three rivers.")]
    # Each prompt under the adapter and under the base model, all four in one batch.
    outputs = llm.generate(batch * 2, greedy(16), lora=["tuned", "tuned", None, None])
    tuned = [hf_replies(reference, prompt, 16) for prompt in batch]
    assert tuned != [hf_replies(hf_model, prompt, 16) for prompt in batch]  # the adapter changes the reply
    for prompt, output, expected, model in zip(
        batch * 2, outputs, tuned + [None, None], [reference] * 2 + [hf_model] * 2
    ):
        expected = expected or hf_replies(model, prompt, 16)
        if weights == "dequantized":  # the same float32 weights: the same tokens
            assert output.token_ids == expected
        else:  # 4-bit blocks times int8-rounded activations: the base rows too first part at gaps near 0.7
            assert first_divergence_is_a_near_tie(model, prompt, output.token_ids, expected, 1.0) is None
    # The decode steps ran in the one-call step, adapters included; the layer loop gives the same logprobs.
    model = llm.engine.runner.model
    assert model.fused_decode is not None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    names = ["tuned", None, "tuned", None]
    fused = llm.generate(batch * 2, params, lora=names)
    model.fused_decode, kept = None, model.fused_decode
    try:
        loop = llm.generate(batch * 2, params, lora=names)
    finally:
        model.fused_decode = kept
    for a, b in zip(fused, loop):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [e.top for e in a.outputs[0].logprobs] == [e.top for e in b.outputs[0].logprobs]
    assert_nothing_held(llm)


@pytest.mark.parametrize(
    "mode, dtype",
    [("batched", torch.float32), ("grouped", torch.float32), ("kernel", torch.float32), ("kernel", torch.bfloat16)],
)
def test_every_way_of_adding_updates_gives_each_rows_own(monkeypatch, mode, dtype):
    """The C++ kernel, torch's batched products and the adapter-by-adapter loop: each row gets its
    own adapter's B A x, and rows without one nothing."""
    from pagedllm.layers import lora
    from pagedllm.layers.cpu_kernels import load_cpu_kernels

    monkeypatch.setattr(lora, "MIN_BATCHED_FILL", 0.0 if mode == "batched" else 2.0)
    kernel = load_cpu_kernels() if mode == "kernel" else None
    if kernel is not None and not kernel.lora_add_available[dtype]:
        pytest.skip(f"this build has no {dtype} LoRA kernel (bfloat16 needs AVX512-BF16)")
    gen = torch.Generator().manual_seed(0)
    outs = {"q_proj": 12, "k_proj": 4, "v_proj": 4, "o_proj": 8, "gate_proj": 6, "up_proj": 6, "down_proj": 8}
    ins = {"q_proj": 8, "k_proj": 8, "v_proj": 8, "o_proj": 12, "gate_proj": 8, "up_proj": 8, "down_proj": 6}

    def adapter(key: str, rank: int, targets: tuple[str, ...]) -> lora.LoraWeights:
        layer = {
            t: (torch.randn(rank, ins[t], generator=gen), torch.randn(outs[t], rank, generator=gen)) for t in targets
        }
        weights = lora.LoraWeights.build(key, [layer], outs, dtype)
        return weights.pack(kernel.pack_panels) if kernel is not None else weights

    adapters = [
        adapter("a", 2, ("q_proj", "v_proj")),
        adapter("b", 4, lora.FUSED_PARTS["qkv_proj"]),
        adapter("c", 3, ("k_proj",)),
    ]
    # 40 rows: an adapter's 15 rows take the kernel's runs of up to 12 (4 on AVX2) in pieces.
    rows = [adapters[0], None, adapters[1], adapters[0], adapters[2], adapters[1], adapters[0], None] * 5
    step = lora.LoraStep.for_rows(rows, lora.LoraStack.build, kernel=kernel, table_of=lora.KernelTable.build)
    assert (step.batched is not None) == (mode != "grouped")
    assert (step.batched is not None and step.batched.kernel is not None) == (mode == "kernel")
    x = torch.randn(len(rows), 8, generator=gen).to(dtype)
    base = torch.randn(len(rows), 20, generator=gen).to(dtype)
    y = step.layer(0).add("qkv_proj", x, base.clone())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for i, weights in enumerate(rows):
        expected = base[i].float()
        if weights is not None:
            a, b = (t.float() for t in weights.layers[0]["qkv_proj"])
            expected = expected + b @ (a @ x[i].float())
        torch.testing.assert_close(y[i].float(), expected, atol=tolerance, rtol=tolerance)


def test_gemma3_layers_take_adapters_as_a_merged_checkpoint_runs(tmp_path):
    """Gemma 3's layers (sliding windows, per-head norms, GeGLU) under an adapter on every
    projection give the tokens of the same engine on PEFT's merged checkpoint (W + s B A), in the
    layer loop for prompts and the one-call step for decodes."""
    import shutil

    from pagedllm.testing.hf_reference import first_divergence_is_a_near_tie, save_random_model

    base = save_random_model(
        tmp_path / "base", "gemma3_text", hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=12, query_pre_attn_scalar=32,
        max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip
    tuned = peft_adapter(base, 8, 16, ADAPTERS["all"][2], std=0.1, seed=3)
    tuned.save_pretrained(tmp_path / "adapter")
    merged = tuned.merge_and_unload().eval()
    merged.save_pretrained(tmp_path / "merged")
    for file in (tmp_path / "base").iterdir():
        if "token" in file.name or file.name.endswith(".jinja"):
            shutil.copy(file, tmp_path / "merged" / file.name)
    args = dict(dtype="float32", block_size=4, kv_cache_memory="16MiB")
    with_adapter = LLM(str(tmp_path / "base"), lora_modules=[f"a={tmp_path / 'adapter'}"], **args)
    on_merged = LLM(str(tmp_path / "merged"), **args)
    batch = prompts(4, seed=11)
    ours = with_adapter.generate(batch, greedy(20), lora="a")
    expected = on_merged.generate(batch, greedy(20))
    assert [o.token_ids for o in ours] != [o.token_ids for o in with_adapter.generate(batch, greedy(20))]
    for prompt, a, b in zip(batch, ours, expected):
        assert first_divergence_is_a_near_tie(merged, prompt, a.token_ids, b.token_ids, 1e-3) is None
    assert_nothing_held(with_adapter)
