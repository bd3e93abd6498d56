"""Speculative decoding on the real SmolLM2 (float32): the same tokens as decoding one at a time,
with every feature that reads tokens (stops, logprobs, grammars, seeds, aborts)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import release_shared_engines

from pagedllm import LLM, SamplingParams
from pagedllm.core.sampling_params import StructuredOutput
from pagedllm.core.speculation import StepCost
from pagedllm.layers.cpu_kernels import cpu_flags

# Fixed English prose (copies of this repository's docs as they were), so that editing the docs
# never changes these tests' prompts: greedy runs are compared token for token, and a new text
# could bring a new near tie.
DATA = Path(__file__).parent / "data"
TEXT = (DATA / "paging-passage.txt").read_text()
PASSAGES = (DATA / "passages.txt").read_text()

# Input-grounded prompts (drafts from the prompt pay) and open ones (they rarely do).
CHATS = [
    [{"role": "user", "content": "Repeat the following text exactly:\n\n" + TEXT[:900]}],
    [{"role": "user", "content": "Summarize this text in three sentences:\n\n" + TEXT[900:2000]}],
    [{"role": "user", "content": "List every command in this text:\n\n" + TEXT[2000:3200]}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
]


SPEC_KV = "512MiB"  # the engines with drafts are extra to the suite's shared ones: small caches


@pytest.fixture(scope="module", autouse=True)
def _release_engines_after_the_module():
    yield
    release_shared_engines()  # the suite's later tests need the memory these engines hold


@pytest.fixture(params=["ngram", "suffix"])
def method(request):
    return request.param


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


_plain_runs: dict[str, list] = {}


def plain_run(plain: LLM, chats, params, key: str) -> list:
    """The drafting-free engine's outputs, run once for the module: each method's test compares
    against the same ones (`make_llm` hands every test the one shared plain engine)."""
    if key not in _plain_runs:
        _plain_runs[key] = plain.chat(chats, params)
    return _plain_runs[key]


def test_greedy_tokens_equal_decoding_one_at_a_time(make_llm, method):
    plain, spec = make_llm(), make_llm(speculative=method, kv_cache_memory=SPEC_KV)
    params = SamplingParams(temperature=0, max_tokens=80)
    expected = tokens(plain_run(plain, CHATS, params, "greedy-80"))
    assert tokens(spec.chat(CHATS, params)) == expected  # batched
    assert tokens(spec.chat(CHATS[:1], params)) == expected[:1]  # alone
    stats = spec.engine.speculation.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0
    assert stats.mean_accepted_length > 1.5  # the repeat and list prompts copy their input


def grounded_chats(num: int, chars: int = 3600) -> list[list[dict]]:
    """Chats that summarize, extract from, rewrite or quote ~1,000-token passages of the docs' prose."""
    asks = ["Summarize this text.", "Extract every command and number.", "Rewrite this simply.", "Quote its key lines."]
    return [
        [{"role": "user", "content": asks[i % len(asks)] + "\n\n" + PASSAGES[i * chars : (i + 1) * chars]}]
        for i in range(num)
    ]


def copy_chats() -> list[list[dict]]:
    """Chats that ask, in several phrasings, for passages of the docs back: drafts from the prompt
    are taken at almost every step, and many are rejected where the model departs from the text."""
    asks = ["Copy this passage exactly:", "Repeat the following text word for word.", "Quote this text in full:"]
    return [
        [{"role": "user", "content": asks[i % len(asks)] + "\n\n" + PASSAGES[7000 + 2500 * i : 9500 + 2500 * i]}]
        for i in range(3)
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_tokens_are_identical_with_drafts_one_request_at_a_time(dtype):
    """The bundled GGUF as served by default (weights native, the machine's kernels), one request
    at a time: every token with ngram drafts equals the plain run's, to the last of 160.  A draft's
    row computes its attention in the parts its own decode step would (csrc/decode_attention.cpp);
    before that, one chat in three parted at a near tie."""
    if dtype == "bfloat16" and "avx512_bf16" not in cpu_flags().split():
        pytest.skip("bfloat16 is emulated on this CPU class: float32 is its dtype")
    release_shared_engines()
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    chats = copy_chats()
    plain = LLM(dtype=dtype, kv_cache_memory="256MiB")
    expected = [tokens(plain.chat([chat], params))[0] for chat in chats]
    del plain
    spec = LLM(dtype=dtype, kv_cache_memory="256MiB", speculative="ngram")
    for chat, want in zip(chats, expected):
        got = tokens(spec.chat([chat], params))[0]
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert first is None, f"token {first} of {len(want)}: {got[first]} where the plain run has {want[first]}"
    stats = spec.engine.speculation.stats
    assert stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens  # some drafts were rejected


@pytest.mark.skipif("avx512_bf16" not in cpu_flags().split(), reason="bfloat16 is emulated on this CPU class")
def test_greedy_tokens_equal_in_bfloat16_batches():
    """In bfloat16 with AMX the GGUF's projections change kernels past 16 rows (integer kernels,
    then AMX tiles): a batch of 8 whose drafts took it past 16 rows differed in 2-7 of 8 requests
    (7 of 8 with speculative_exact=False).  Drafts now stay within the range the step is in, and at
    most one request may leave the plain run's tokens, at a near tie: drafts change a request's
    company (requests finish sooner, so the batch shrinks at other tokens, which can move a step
    to another row range or below the core count where attention cuts contexts into parts), and
    bfloat16 logits near 20 are 0.125 apart.  How many drafts a step takes follows
    step times; at the measured price (a row ~0.3 of a step's base cost with 1,000 tokens of
    context) drafts barely pay for 8 rows, and a few early rejections could leave too few to test
    anything.  Rows are priced cheaper here so that drafts are taken through the run."""
    from pagedllm.testing.hf_reference import our_logits

    params = SamplingParams(temperature=0, max_tokens=128)
    chats = grounded_chats(8)
    plain = LLM(dtype="bfloat16", kv_cache_memory="512MiB")
    plain_outputs = plain.chat(chats, params)
    spec = LLM(dtype="bfloat16", speculative="suffix", kv_cache_memory="512MiB")
    spec.engine.speculation.cost = StepCost(row=0.05)
    spec_outputs = spec.chat(chats, params)
    assert spec.engine.speculation.stats.mean_accepted_length > 2
    del spec
    diverged = []  # (request, token index, ours, the plain run's)
    for index, (ours, theirs) in enumerate(zip(tokens(spec_outputs), tokens(plain_outputs))):
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if i is not None:
            diverged.append((index, i, ours[i], theirs[i]))
    assert len(diverged) <= 1, f"{len(diverged)} of 8 requests left the plain run's tokens: {diverged}"
    for index, i, ours, theirs in diverged:
        ids = list(plain_outputs[index].prompt_token_ids) + tokens(plain_outputs)[index][:i]
        with torch.inference_mode():
            logits = our_logits(plain, ids)[-1].float()
        gap = float(logits[theirs] - logits[ours])
        assert gap <= 0.25, f"request {index}, token {i}: {ours} where the plain run picks {theirs} by {gap:.3f}"


def test_stops_logprobs_and_max_tokens_cut_where_one_at_a_time_does(make_llm, method):
    plain, spec = make_llm(), make_llm(speculative=method, kv_cache_memory=SPEC_KV)
    reference = plain_run(plain, CHATS[0], SamplingParams(temperature=0, max_tokens=60), "reference")[0].outputs[0]
    middle = len(reference.text) // 2
    stop_word = reference.text[middle : middle + 5]
    cases = [
        SamplingParams(temperature=0, max_tokens=7),  # drafts never reach past max_tokens
        SamplingParams(temperature=0, max_tokens=60, stop=[stop_word]),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[reference.token_ids[30]]),
        SamplingParams(temperature=0, max_tokens=40, logprobs=3),
    ]
    for i, params in enumerate(cases):
        want = plain_run(plain, CHATS[0], params, f"case-{i}")[0].outputs[0]
        got = spec.chat(CHATS[0], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert spec.engine.speculation.stats.accepted_tokens > 0


def test_a_grammar_checks_the_drafts(make_llm):
    plain, spec = make_llm(), make_llm(speculative="ngram", kv_cache_memory=SPEC_KV)
    line = "the cat sat on the mat. "
    chat = [{"role": "user", "content": f"Write '{line}' ten times."}]
    params = SamplingParams(temperature=0, max_tokens=50, structured_output=StructuredOutput(regex=f"({line}){{4}}"))
    before = spec.engine.speculation.stats.accepted_tokens
    want, got = plain.chat(chat, params)[0].outputs[0], spec.chat(chat, params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.text == line * 4
    assert spec.engine.speculation.stats.accepted_tokens > before


def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(make_llm):
    plain, spec = make_llm(), make_llm(speculative="ngram", kv_cache_memory=SPEC_KV)
    params = [SamplingParams(temperature=0.8, max_tokens=48, seed=s) for s in range(4)]
    chats = [CHATS[0]] * 4
    want = tokens(plain.chat(chats, params))
    assert tokens(spec.chat(chats, params)) == want
    assert tokens(spec.chat(chats, params)) == want  # run to run
    assert len({tuple(t) for t in want}) > 1  # the seeds differ, so do the samples


def two_sample_chi2_p(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test that two samples come from one distribution (rare categories
    pooled), via the Wilson-Hilferty approximation of the chi-square tail."""
    na, nb = sum(a.values()), sum(b.values())
    common = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    cells = [(a[k], b[k]) for k in common]
    rest = (na - sum(x for x, _ in cells), nb - sum(y for _, y in cells))
    if sum(rest) >= 10:
        cells.append(rest)
    stat = 0.0
    for x, y in cells:
        total = x + y
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    dof = max(len(cells) - 1, 1)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampling_keeps_the_models_distribution(make_llm, monkeypatch):
    """Unseeded draws at temperature 0.8: the 2nd-4th tokens (drafted and verified with
    speculation) are distributed as without it.  Rows are priced near zero, and steps of any
    row count take drafts, so that every request of the batch gets them."""
    plain, spec = make_llm(), make_llm(speculative="ngram", kv_cache_memory=SPEC_KV)
    monkeypatch.setattr(spec.engine.speculation, "cost", StepCost(0.001))
    monkeypatch.setattr(spec.engine.scheduler, "draft_row_limits", ())
    chat = [{"role": "user", "content": "Repeat exactly: one two three four five six seven eight nine ten"}]
    params = SamplingParams(temperature=0.8, max_tokens=4)
    before = spec.engine.speculation.stats.draft_tokens
    samples = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        outputs = tokens(llm.chat([chat] * 300, params))
        samples[name] = Counter(tuple(t[1:4]) for t in outputs)
    assert spec.engine.speculation.stats.draft_tokens - before > 100
    assert two_sample_chi2_p(samples["plain"], samples["spec"]) > 1e-3
    assert len(samples["plain"]) > 3  # the continuation is random, not one sure path


def test_abort_mid_draft_frees_every_block(make_llm):
    spec = make_llm(speculative="ngram", kv_cache_memory=SPEC_KV)
    engine = spec.engine
    before = engine.speculation.stats.draft_tokens
    params = SamplingParams(temperature=0, max_tokens=200)
    engine.add_request(engine.tokenizer.apply_chat_template(CHATS[0]), params, "r")
    try:
        while engine.speculation.stats.draft_tokens == before:
            engine.step()
            assert engine.has_unfinished_requests()
        engine.step()  # verifies drafts, rolls back
    finally:
        engine.abort_request("r")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_served_streams_equal_offline_and_metrics_show_drafts(make_llm):
    import httpx
    import openai

    from pagedllm.config import EngineConfig
    from pagedllm.engine import LLMEngine
    from pagedllm.testing.servers import MODEL, serve_in_process

    want = make_llm().chat(CHATS[0], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0].text
    config = EngineConfig(dtype="float32", weights="dequantized", kv_cache_memory="64MiB", speculative="ngram")
    with serve_in_process(LLMEngine(config)) as (server, async_engine):
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=MODEL, messages=CHATS[0], max_tokens=64, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == want
        cancelled = client.chat.completions.create(model=MODEL, messages=CHATS[2], max_tokens=300, stream=True)
        for _ in range(4):
            next(iter(cancelled))
        cancelled.close()  # the client leaves mid-stream: the request ends, its blocks go back
        stats = server.wait_until(lambda s: s["running"] == 0 and s["kv"]["used_blocks"] == 0)
        assert stats["speculation"]["method"] == "ngram" and stats["speculation"]["accepted_tokens"] > 0
        metrics = httpx.get(server.url + "/metrics").text
        for name in ("pagedllm_spec_draft_tokens_total", "pagedllm_spec_acceptance_rate"):
            assert name in metrics
        assert "pagedllm_spec_mean_accepted_length" in metrics
        async_engine.shutdown()  # its thread would otherwise hold the engine's memory for the session
