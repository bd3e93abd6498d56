"""`pagedllm serve` driven by the real openai client (sync and async) over loopback HTTP.

One server process for the module (the real command, SmolLM2 in float32); the
expected texts come from the offline engine on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import openai
import pytest
from conftest import llm_factory

from pagedllm import SamplingParams
from pagedllm.testing.servers import API_KEY, MODEL, serve_subprocess

# Dequantized weights: several tests check that a request's reply is the same alone and in a
# batch, which holds up to float rounding there.  On the native path a step of many rows runs
# a float GEMM instead of the integer kernels, and where a logit is nearly tied the two can
# part (docs/performance.md); tests/test_quantized.py serves the native path.  The KV cache is
# float32 (256 MiB: 5,824 tokens); the offline engine holds the same.  Not the default float16
# cache beside float32: it rounds keys and values once more, which turns a tiny difference in a
# projection's sum between batch sizes into a whole float16 step, enough to flip a near tie (on
# an AMX Xeon, one of 32 concurrent replies did), and the batch tests below compare replies token
# for token.
SERVER_ARGS = (
    "--dtype",
    "float32",
    "--kv-cache-dtype",
    "float32",
    "--kv-cache-memory",
    "256MiB",
    "--max-num-seqs",
    "64",
    "--weights",
    "dequantized",
)


@pytest.fixture(scope="module")
def server():
    with serve_subprocess(*SERVER_ARGS) as server:
        yield server
    # (every test below that leaves requests behind checks the blocks itself)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The offline engine on the same weights: the expected texts."""
    with llm_factory() as make:
        yield make(kv_cache_memory="256MiB", kv_cache_dtype="float32")


def greedy_text(llm, prompt_ids: list[int], max_tokens: int) -> str:
    return llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].text


def assert_all_blocks_free(server) -> dict:
    return server.wait_until(lambda s: s["running"] == 0 and s["waiting"] == 0 and s["kv"]["used_blocks"] == 0)


def test_models_and_health(server, client):
    import time

    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert 0 < time.time() - models[0].created < 3600  # when the server loaded the model
    card = httpx.get(server.v1 + "/models", headers=server.headers()).json()["data"][0]
    assert card["max_model_len"] == 5824 and card["vocab_size"] == 49152
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_matches_the_offline_engine(client, offline):
    prompt = "The three primary colors are"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ids = offline.tokenizer.encode(prompt)
    choice = response.choices[0]
    assert choice.text == greedy_text(offline, ids, 12)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(ids) + 12


def test_chat_streamed_equals_unstreamed_and_usage_counts(client, offline):
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    prompt_ids = offline.tokenizer.apply_chat_template(messages)
    assert whole.choices[0].message.content == greedy_text(offline, prompt_ids, 16)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(prompt_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert len(chunks) > 3, "a stream sends tokens as they come, not one block at the end"


def test_streamed_completion_with_logprobs(client):
    stream = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0, logprobs=2, stream=True
    )
    tokens, text = [], ""
    for chunk in stream:
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            assert all(len(top) == 2 for top in chunk.choices[0].logprobs.top_logprobs)
    assert len(tokens) == 8 and "".join(tokens) == text


def test_n_samples_with_a_seed_are_reproducible(client):
    def ask():
        return client.completions.create(
            model=MODEL,
            prompt="My favourite animal is",
            max_tokens=10,
            temperature=1.0,
            n=3,
            seed=7,
            extra_body={"ignore_eos": True},  # every sample makes its 10 tokens, whatever it draws
        )

    first, second = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1, "three seeded samples should not all be equal"
    assert first.usage.completion_tokens == 30


def test_batched_prompts_and_n_index_the_choices(client):
    response = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: equal samples
    assert response.choices[2].text == response.choices[3].text


def test_stop_strings_end_and_are_cut(client):
    response = client.completions.create(
        model=MODEL, prompt="Here is a list of fruits: apple, banana,", max_tokens=30, temperature=0, stop=[","]
    )
    choice = response.choices[0]  # unstopped: " orange, lemon, grape, ..."
    assert choice.finish_reason == "stop" and choice.text == " orange"


def test_thirty_two_concurrent_streams_async(server, offline):
    prompts = [f"Write a word that rhymes with number {i}:" for i in range(32)]
    expected = [
        o.text for o in offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    ]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run()) == expected
    stats = assert_all_blocks_free(server)
    assert stats["kv"]["free_blocks"] == stats["kv"]["num_blocks"]


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server, client):
    stream = client.completions.create(
        model=MODEL,
        prompt="Tell me a very long story.",
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # an extension: it runs its 500 tokens unless aborted
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    during = server.stats()
    assert during["running"] == 1 and during["kv"]["used_blocks"] > 0
    stream.close()
    assert_all_blocks_free(server)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagedllm_requests_finished_total{finish_reason="abort"} 1.0' in metrics


BAD_INPUTS = [
    # (name, path, raw body or json, headers override, status, words in the message)
    ("malformed-json", "/v1/completions", b'{"prompt": "hi",', None, 400, "not valid JSON"),
    ("not-an-object", "/v1/completions", [1, 2], None, 400, "JSON object"),
    ("wrong-type", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, None, 400, "max_tokens"),
    ("negative-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, None, 400, "max_tokens"),
    ("huge-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, None, 400, "maximum context length"),
    ("n-zero", "/v1/completions", {"prompt": "hi", "n": 0}, None, 400, "n must be"),
    ("top-p-two", "/v1/completions", {"prompt": "hi", "top_p": 2}, None, 400, "top_p"),
    (
        "temperature-negative",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
        None,
        400,
        "temperature",
    ),
    ("no-prompt", "/v1/completions", {"max_tokens": 3}, None, 400, "prompt"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, None, 400, "empty"),
    ("bad-token-id", "/v1/completions", {"prompt": [1, 10**7]}, None, 400, "token ids"),
    ("no-messages", "/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "role"),
    ("penalty", "/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, None, 400, "frequency_penalty"),
    ("bias-out-of-vocab", "/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 5}}, None, 400, "vocabulary"),
    ("bias-not-an-id", "/v1/completions", {"prompt": "hi", "logit_bias": {"the": 5}}, None, 400, "token ids"),
    ("detokenize-bad-id", "/detokenize", {"tokens": [1, -4]}, None, 400, "tokens must be ids"),
    ("unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, None, 404, "gpt-9"),
    # 128 MiB of float32 KV holds 2,912 tokens: the server lowered its maximum model length to that at start
    ("too-long-prompt", "/v1/completions", {"prompt": [42] * 9000}, None, 400, "maximum context length is 5824"),
    ("over-the-cache", "/v1/completions", {"prompt": "hi", "max_tokens": 8000}, None, 400, "length of 5824"),
    ("prompt-number", "/v1/completions", {"prompt": 5}, None, 400, "prompt"),
    ("no-key", "/v1/completions", {"prompt": "hi"}, {}, 401, "missing API key"),
    ("wrong-key", "/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer nope"}, 401, "wrong API key"),
    ("oversized-body", "/v1/completions", b"x" * (5 * 2**20), None, 413, "larger than the limit"),
    ("unknown-path", "/v1/embeddings", {"input": "hi"}, None, 404, "Not Found"),
    (
        "echo-logprobs",
        "/v1/completions",
        {"prompt": "hi", "echo": True, "logprobs": 1},
        None,
        400,
        "echo with logprobs",
    ),
    ("best-of-below-n", "/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, None, 400, "best_of must be"),
    (
        "best-of-streamed",
        "/v1/completions",
        {"prompt": "hi", "best_of": 3, "stream": True},
        None,
        400,
        "cannot be streamed",
    ),
]


# The `param` each error names: the request body's field a client has to fix.
BAD_PARAMS = {
    "wrong-type": "max_tokens",
    "negative-max-tokens": "max_tokens",
    "huge-max-tokens": "max_tokens",
    "over-the-cache": "max_tokens",
    "n-zero": "n",
    "top-p-two": "top_p",
    "temperature-negative": "temperature",
    "prompt-number": "prompt",
    "too-long-prompt": "prompt",
    "bad-role": "messages.0.role",
    "penalty": "frequency_penalty",
    "bias-out-of-vocab": "logit_bias",
    "bias-not-an-id": "logit_bias",
    "detokenize-bad-id": "tokens",
    "unknown-model": "model",
    "echo-logprobs": "echo",
    "best-of-below-n": "best_of",
    "best-of-streamed": "best_of",
}


@pytest.mark.parametrize(
    "path,body,headers,status,words,param",
    [(*case[1:], BAD_PARAMS.get(case[0])) for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_gets_its_4xx_and_the_server_goes_on(server, client, path, body, headers, status, words, param):
    sent_headers = server.headers() if headers is None else headers
    if isinstance(body, bytes):
        response = httpx.post(server.url + path, content=body, headers=sent_headers, timeout=60)
    else:
        response = httpx.post(server.url + path, json=body, headers=sent_headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words.lower() in error["message"].lower()
    assert {"message", "type", "param", "code"} <= set(error)
    if param is not None:
        assert error["param"] == param
    # ...and the next correct request is answered correctly.
    ok = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length" and len(ok.choices[0].text) > 0


def test_bad_input_through_the_client_raises_its_error(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="hi", top_p=2.0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    bad_key = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_metrics_count_tokens_and_latencies(server, client):
    client.completions.create(model=MODEL, prompt="Cats are", max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in (
        "pagedllm_requests_running",
        "pagedllm_requests_waiting",
        "pagedllm_kv_blocks_used",
        "pagedllm_kv_blocks_free",
        "pagedllm_kv_blocks_cached",
        "pagedllm_prefix_cache_hit_rate",
        "pagedllm_preemptions_total",
    ):
        assert name in values, name
    assert values["pagedllm_generation_tokens_total"] >= 5
    assert values["pagedllm_prompt_tokens_total"] >= 2
    assert values["pagedllm_time_to_first_token_seconds_count"] >= 1
    assert values["pagedllm_inter_token_latency_seconds_count"] >= 4
    assert values["pagedllm_kv_blocks_free"] + values["pagedllm_kv_blocks_used"] == values["pagedllm_kv_blocks_total"]


def test_soak_400_requests_a_quarter_cancelled(server):
    """400 streamed requests, 32 at a time; about a quarter leave after 1-3 chunks.
    Afterwards no block is held and the server still answers."""
    rng = random.Random(1234)
    plan = [
        (
            f"Item {i}: describe a {rng.choice(['cat', 'boat', 'tree', 'cloud'])}",
            rng.random() < 0.25,
            rng.randint(0, 2),
            rng.randint(5, 10),
        )
        for i in range(400)
    ]
    results = {"done": 0, "cancelled": 0}

    async def one(client, semaphore, prompt, cancel, cancel_after, max_tokens):
        async with semaphore:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=1, stream=True
            )
            count = 0
            async for chunk in stream:
                count += 1
                if cancel and count > cancel_after:
                    await stream.close()
                    results["cancelled"] += 1
                    return
                if chunk.choices[0].finish_reason:
                    results["done"] += 1

    async def run():
        semaphore = asyncio.Semaphore(32)
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300) as client:
            await asyncio.wait_for(asyncio.gather(*(one(client, semaphore, *item) for item in plan)), timeout=600)

    asyncio.run(run())
    assert results["done"] + results["cancelled"] == 400
    assert 60 < results["cancelled"] < 140
    assert_all_blocks_free(server)
    assert httpx.get(server.url + "/health").status_code == 200
    answer = httpx.post(server.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=server.headers())
    assert answer.status_code == 200


def test_bench_serve_measures_the_running_server(server, capsys):
    from pagedllm.cli import main

    argv = ["bench", "serve", "--url", server.v1, "--api-key", API_KEY, "--dataset", "random", "--num-prompts", "6"]
    argv += ["--input-len", "24", "--output-len", "5", "--request-rate", "20", "--goodput", "ttft:60000", "e2el:1"]
    assert main(argv + ["--log-level", "WARNING"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == MODEL and result["completed"] == 6 and result["failed"] == 0
    assert result["prompt_tokens"] == 6 * 24 and result["output_tokens"] == 6 * 5
    for key in ("ttft_p50_s", "itl_p50_s", "tpot_p99_s", "e2el_p90_s", "output_tokens_per_s"):
        assert result[key] > 0, key
    assert result["goodput_slos_ms"] == {"ttft": 60000.0, "e2el": 1.0}
    assert result["good_requests"] == 0  # no request ends within 1 ms
    assert_all_blocks_free(server)


def test_penalties_bias_and_min_tokens_over_http(client, offline):
    prompt = "My favourite colours are red, green and"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    first = offline.tokenizer.encode(plain.choices[0].text)[0]
    banned = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logit_bias={str(first): -100}
    )
    assert offline.tokenizer.encode(banned.choices[0].text)[0] != first
    expected = offline.generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, presence_penalty=1.2, frequency_penalty=0.4)
    )[0].text
    penalized = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, presence_penalty=1.2, frequency_penalty=0.4
    )
    assert penalized.choices[0].text == expected
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with one word: yes or no?"}],
        max_tokens=30,
        temperature=0,
        extra_body={"min_tokens": 12, "repetition_penalty": 1.1, "bad_words": ["no"]},
    )
    assert chat.usage.completion_tokens >= 12


def test_tokenize_and_detokenize(server, offline):
    headers = server.headers()
    text = "The capital of France is Paris."
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=headers).json()
    assert tokens["tokens"] == offline.tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 5824
    chat = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=headers
    ).json()
    assert chat["tokens"] == offline.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert back == {"prompt": text}
    neither = httpx.post(server.url + "/tokenize", json={}, headers=headers)
    assert neither.status_code == 400 and "either prompt" in neither.json()["error"]["message"]
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401  # the key guards it


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_over_http(client):
    import jsonschema

    messages = [{"role": "user", "content": "Describe a person."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    replies = []
    # A first request leaves the prompt's full blocks in the prefix cache, so that both compared
    # requests compute the same tail of it in steps of the same shape (a GEMM of other rows may
    # differ in the last bits, which a float16 KV cache can round apart).
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=messages, max_tokens=60, temperature=0.8, seed=4)
        if stream:
            chunks = client.chat.completions.create(stream=True, response_format=response_format, **kwargs)
            replies.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            response = client.chat.completions.create(response_format=response_format, **kwargs)
            assert response.choices[0].finish_reason == "stop"
            replies.append(response.choices[0].message.content)
    assert replies[0] == replies[1]  # streamed and not: the same tokens for a seed
    jsonschema.validate(json.loads(replies[0]), PERSON)
    anything = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    choice = client.completions.create(
        model=MODEL, prompt="The best colour is", max_tokens=5, extra_body={"guided_choice": ["red", "blue"]}
    )
    assert choice.choices[0].text in ("red", "blue")
    # Greedy: a sampled path may wander into other scripts' digits (\d takes them) and run out of tokens.
    regex = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=12, temperature=0, extra_body={"guided_regex": r"\d{3}-\d{4}"}
    )
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text)


STRUCTURED_BAD_INPUTS = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
        "response_format",
        "invalid json schema",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"guided_regex": "(open"}, "guided_regex", "invalid regex"),
    ({"guided_choice": []}, "guided_choice", "choice must be non-empty"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "one structured output constraint"),
]


@pytest.mark.parametrize("extra,param,words", STRUCTURED_BAD_INPUTS)
def test_bad_structured_outputs_are_400s_naming_the_field(server, extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = httpx.post(server.v1 + "/chat/completions", json=body, headers=server.headers(), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}


def test_tool_calls_named_required_streamed_and_a_follow_up(client):
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named, max_tokens=60, temperature=0.7, seed=2
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    for seed in range(3):  # required: one of the tools, with arguments valid for that tool
        required = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60,
            temperature=1.0, seed=seed,
        )  # fmt: skip
        (call,) = required.choices[0].message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=60, temperature=0.7, seed=2,
        stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    (streamed,) = [d.delta.tool_calls for d in deltas if d.delta.tool_calls][0]
    assert streamed.function.name == "get_weather" and streamed.index == 0
    jsonschema.validate(json.loads(streamed.function.arguments), WEATHER["function"]["parameters"])

    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "unit": "celsius"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=follow_up, tools=[WEATHER, TIME], max_tokens=30, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


# OpenAI's function-calling guide's weather tool, as written there: no additionalProperties, so
# JSON Schema's own default would let the model add keys until max_tokens; strict schemas close it.
OPENAI_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}


def test_openai_docs_weather_tool_as_written_gives_tool_calls(client):
    """`required` and a named function end with `tool_calls` whose arguments validate, greedy.
    With `auto` SmolLM2-135M answers in prose for every phrasing tried (it is not tuned for tools);
    its reply must then be plain content, and a reply that is a call would be read as one."""
    import jsonschema

    messages = [{"role": "user", "content": "What's the weather like in Boston today?"}]
    named = {"type": "function", "function": {"name": "get_current_weather"}}
    for choice in ("required", named):
        response = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[OPENAI_WEATHER_TOOL], tool_choice=choice, max_tokens=100,
            temperature=0,
        )  # fmt: skip
        reply = response.choices[0]
        assert reply.finish_reason == "tool_calls", (choice, reply.message.content)
        (call,) = reply.message.tool_calls
        assert call.function.name == "get_current_weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, OPENAI_WEATHER_TOOL["function"]["parameters"])
        assert set(arguments) <= {"location", "unit"} and "Boston" in arguments["location"], arguments
    auto = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[OPENAI_WEATHER_TOOL], tool_choice="auto", max_tokens=100, temperature=0
    ).choices[0]
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls" and auto.message.tool_calls[0].function.name == "get_current_weather"
    else:
        assert auto.message.content and '"arguments"' not in auto.message.content


TOOL_BAD_INPUTS = [
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "not among",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
        "tools",
        "invalid json schema",
    ),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
]


@pytest.mark.parametrize("extra,param,words", TOOL_BAD_INPUTS)
def test_bad_tool_requests_are_400s_naming_the_field(server, extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = httpx.post(server.v1 + "/chat/completions", json=body, headers=server.headers(), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_thirty_two_concurrent_mixed_requests_each_equal_itself_alone(server):
    """Constrained, penalized, biased and plain requests in one running batch: each reply is the
    one the same request gets alone, so no row's penalties, bias or grammar mask leaks into
    another's.  Greedy: a sampled draw can land on either side of a token boundary that moves
    by float rounding between batch sizes (the projections' sums run in another order)."""
    kinds = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
        {"presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"logit_bias": {"198": -100}, "extra_body": {"repetition_penalty": 1.2}},
        {"extra_body": {"guided_choice": ["yes", "no", "maybe"]}},
        {},
    ]

    def body(i: int) -> dict:
        kind = dict(kinds[i % len(kinds)])
        extra = kind.pop("extra_body", {})
        return dict(
            model=MODEL,
            messages=[{"role": "user", "content": f"Question {i}: tell me about a person."}],
            max_tokens=40,
            temperature=0.0,
            extra_body={"ignore_eos": False, **extra},
            **kind,
        )

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300) as client:
            replies = await asyncio.gather(*(client.chat.completions.create(**body(i)) for i in range(32)))
        return [r.choices[0].message.content for r in replies]

    together = asyncio.run(all_at_once())
    sync = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300)
    # Alone: two requests of each kind, spread over the batch (a leak shows in any row it reaches;
    # all 32 alone took two thirds of the test's time, one request at a time).
    checked = list(range(0, 32, 3))
    alone = [sync.chat.completions.create(**body(i)).choices[0].message.content for i in checked]
    assert [together[i] for i in checked] == alone
    for i in range(0, 32, len(kinds)):
        json.loads(together[i])  # the constrained ones parse
    assert_all_blocks_free(server)


def test_echo_and_best_of(client):
    prompt = "The three primary colors are"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text

    # best_of=4: the one returned is the sample of the four with the highest cumulative log-probability.
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=9)
    best = client.completions.create(best_of=4, **kwargs)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    four = client.completions.create(n=4, logprobs=0, **kwargs)
    scores = [sum(c.logprobs.token_logprobs) for c in four.choices]
    assert best.choices[0].text == four.choices[scores.index(max(scores))].text
    assert len({c.text for c in four.choices}) > 1  # the four samples differ, so the choice means something
    two = client.completions.create(best_of=4, n=2, **kwargs)
    ranked = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert [c.text for c in two.choices] == [four.choices[i].text for i in ranked]
    assert [c.index for c in two.choices] == [0, 1]
