"""`pagedllm serve --lora NAME=PATH` driven by the real openai client: a request picks an adapter by
`model`, /v1/models lists it under its parent, adapters load and unload at run time behind the API
key, and an unknown name is a 404; the replies are the offline engine's under the same adapter."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import llm_factory

from pagedllm import SamplingParams
from pagedllm.models.loader import read_model_config, resolve_model_path
from pagedllm.testing.lora import write_random_adapter
from pagedllm.testing.servers import API_KEY, MODEL, serve_subprocess

# As tests/test_server.py: float32, weights dequantized, so that a reply is the same alone and in a batch.
SERVER_ARGS = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--kv-cache-memory", "256MiB")
ARGS = (*SERVER_ARGS, "--weights", "dequantized")
QUESTION = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    config = read_model_config(resolve_model_path(None))
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_random_adapter(root / name, config, rank=8, seed=seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def server(adapters):
    with serve_subprocess(*ARGS, "--lora", f"a={adapters['a']}", "--allow-runtime-lora", "--kv-events") as server:
        yield server


@pytest.fixture(scope="module")
def expected(adapters):
    """The offline engine's greedy replies under each adapter and under none."""
    with llm_factory() as make:
        llm = make(kv_cache_memory="256MiB", kv_cache_dtype="float32")
        for name, path in adapters.items():
            llm.engine.load_lora(name, str(path))
        prompt = llm.tokenizer.apply_chat_template(QUESTION)
        params = SamplingParams(temperature=0.0, max_tokens=16)
        replies = {name: llm.generate([prompt], params, lora=name)[0].text for name in (None, "a", "b")}
        for name in adapters:
            llm.engine.unload_lora(name)
        return replies


def test_a_request_picks_its_adapter_by_model(server, expected, adapters):
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "a"} and cards["a"].parent == MODEL
    assert len({expected[None], expected["a"], expected["b"]}) == 3  # each adapter changes the reply

    def reply(model: str) -> str:
        response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
        return response.choices[0].message.content

    assert reply("a") == expected["a"]
    assert reply(MODEL) == expected[None]
    with pytest.raises(openai.NotFoundError, match="the model 'b' does not exist"):
        reply("b")

    # Loaded at run time, behind the key; then used; then gone.
    load = {"lora_name": "b", "lora_path": str(adapters["b"])}
    assert httpx.post(server.v1 + "/load_lora_adapter", json=load).status_code == 401
    response = httpx.post(server.v1 + "/load_lora_adapter", json=load, headers=server.headers())
    assert response.status_code == 200, response.text
    assert reply("b") == expected["b"]
    again = httpx.post(server.v1 + "/load_lora_adapter", json=load, headers=server.headers())
    assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
    bad = httpx.post(
        server.v1 + "/load_lora_adapter", json={"lora_name": "c", "lora_path": "/nonexistent"}, headers=server.headers()
    )
    assert bad.status_code == 400 and "neither a directory nor a GGUF file" in bad.json()["error"]["message"]
    unload = httpx.post(server.v1 + "/unload_lora_adapter", json={"lora_name": "b"}, headers=server.headers())
    assert unload.status_code == 200
    with pytest.raises(openai.NotFoundError):
        reply("b")
    server.wait_until(lambda s: s["running"] == 0 and s["waiting"] == 0 and s["kv"]["used_blocks"] == 0)


def test_kv_events_carry_the_adapter_key_the_router_salts_by(server):
    """A replica's /kv_events names each adapter's key, and the blocks a request under the adapter
    stores are the keys the data-parallel router computes for its prompt under that key."""
    from pagedllm.core.kv_cache_manager import adapter_salt, prompt_block_keys, root_key

    httpx.get(server.url + "/kv_events", headers=server.headers())  # drain what earlier tests stored
    prompt = list(range(1000, 1100))
    body = {"model": "a", "prompt": prompt, "max_tokens": 1}
    assert httpx.post(server.v1 + "/completions", json=body, headers=server.headers(), timeout=120).status_code == 200
    events = httpx.get(server.url + "/kv_events", headers=server.headers()).json()
    key = events["adapters"]["a"]
    assert key.startswith("a#")
    stored = {bytes.fromhex(k) for s, k in events["events"] if s}
    under_a = prompt_block_keys(prompt, events["block_size"], root_key(b"", adapter_salt(key)))
    assert under_a and set(under_a) <= stored
    assert not set(prompt_block_keys(prompt, events["block_size"], root_key())) & stored  # not the base model's
    lora = server.stats()["lora"]
    assert lora["registered"] >= 1 and lora["resident"] >= 1 and lora["resident_kv_blocks"] >= 1
    assert lora["in_kv_pages"]  # the dashboard draws the adapters' pages among the blocks
    blocks = httpx.get(server.url + "/dashboard/state").json()["blocks"]
    assert blocks.count("a") == lora["resident_kv_blocks"]
    metrics = httpx.get(server.url + "/metrics").text
    assert f"pagedllm_lora_adapters_resident {float(lora['resident'])}" in metrics
    assert "pagedllm_lora_resident_kv_blocks" in metrics and "pagedllm_lora_evictions_total" in metrics
