"""The server's edges, in process (to reach the engine): a full queue answers 429,
and an engine that fails answers 503 everywhere instead of hanging anyone."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.testing.servers import MODEL, serve_in_process


def small_engine(**overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="64MiB", **overrides))


def test_a_full_queue_answers_429_and_then_serves_again():
    with serve_in_process(small_engine(max_num_seqs=1), max_waiting=1) as (server, _):
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
        running = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400, stream=True)
        next(iter(running))  # A holds the only running slot
        waiting_result = {}

        def wait_in_queue():
            waiting_result["text"] = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        server.wait_until(lambda s: s["waiting"] == 1)
        with pytest.raises(openai.RateLimitError, match="max-waiting 1"):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        running.close()  # A leaves; B runs
        waiter.join(60)
        assert not waiter.is_alive() and waiting_result["text"]
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"
        stats = server.wait_until(lambda s: s["kv"]["used_blocks"] == 0 and s["running"] == 0)
        assert stats["waiting"] == 0


@pytest.mark.engine_left_broken  # its engine thread is made to die mid-request
def test_an_engine_failure_answers_503_and_hangs_no_one():
    engine = small_engine()
    with serve_in_process(engine) as (server, async_engine):

        def broken_step():
            raise RuntimeError("simulated engine bug")

        engine.step = broken_step
        response = httpx.post(server.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert response.status_code == 503
        assert "simulated engine bug" in response.json()["error"]["message"]
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        again = httpx.post(server.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert again.status_code == 503
        assert not async_engine.is_running


def test_a_chat_template_that_refuses_the_messages_is_a_400(monkeypatch):
    """A template's raise_exception (Gemma's, Mistral's: roles must alternate) is the client's error."""
    import jinja2

    from pagedllm.text.tokenizer import Tokenizer

    real = Tokenizer.apply_chat_template

    def alternating_only(self, messages, tools=None):
        roles = [m["role"] for m in messages if m["role"] != "system"]
        if any(a == b for a, b in zip(roles, roles[1:])):
            raise jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant/user/assistant")
        return real(self, messages, tools)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", alternating_only)
    with serve_in_process(small_engine()) as (server, _):
        body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 2}
        response = httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages" and "roles must alternate" in error["message"]
        body["messages"] = body["messages"][:1]
        assert httpx.post(server.v1 + "/chat/completions", json=body, timeout=60).status_code == 200
