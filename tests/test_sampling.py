"""Sampling on the real model: seeds, filters, stops, logprobs; and the sampler alone."""

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.execution.sampler import Sampler
from pagedllm.testing.hf_reference import greedy, our_logits

STORY = [{"role": "user", "content": "Tell me a story about a dragon and a village."}]


@pytest.fixture
def llm(make_llm):
    return make_llm()


def chat_ids(llm, messages=STORY):
    return llm.tokenizer.apply_chat_template(messages)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    prompt = chat_ids(llm)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate(prompt, params)[0].token_ids
    again = llm.generate(prompt, params)[0].token_ids
    assert alone == again
    others = chat_ids(llm, [{"role": "user", "content": "Name five colours."}])
    batch = llm.generate(
        [others, prompt, others, prompt],
        [SamplingParams(temperature=1.0, max_tokens=30), params, SamplingParams(temperature=0.7, seed=9), params],
    )
    assert batch[1].token_ids == alone and batch[3].token_ids == alone
    different_seed = llm.generate(prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24))
    assert different_seed[0].token_ids != alone


def test_filters_that_keep_one_token_equal_greedy(llm):
    prompt = chat_ids(llm)
    expected = llm.generate(prompt, greedy(16))[0].token_ids
    for params in (
        SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=16, ignore_eos=True),
    ):
        assert llm.generate(prompt, params)[0].token_ids == expected


def test_stop_string_cuts_the_text(llm):
    prompt = chat_ids(llm)
    full = llm.generate(prompt, greedy(40))[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop, "never-appears-xyz"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ends_generation_and_is_not_in_the_text(llm):
    prompt = chat_ids(llm)
    full = llm.generate(prompt, greedy(20))[0]
    stop_token = full.token_ids[6]
    first = full.token_ids.index(stop_token)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(full.token_ids[:first])


def test_eos_stops_unless_ignored(llm):
    prompt = chat_ids(llm, [{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.engine.eos_token_id
    assert "Paris" in out.text and "<|im_end|>" not in out.text
    ignored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 5, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(out.token_ids) + 5


def test_logprobs_of_sampled_token_and_alternatives(llm):
    prompt = chat_ids(llm)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 6
    reference = our_logits(llm, prompt + out.token_ids).log_softmax(-1)
    for i, entry in enumerate(out.logprobs):
        row = reference[len(prompt) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id  # greedy picks the top one
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


def test_sampler_follows_the_distribution_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(4000, 1)
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = torch.tensor(sampler(logits, params, [None] * 4000).token_ids)
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.03)

    top_k = torch.tensor(sampler(logits, [SamplingParams(temperature=1.0, top_k=2)] * 4000, [None] * 4000).token_ids)
    assert set(top_k.tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # ~[0.61, 0.22, 0.14, 0.03, 0.004]
    top_p = sampler(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 4000, [None] * 4000).token_ids
    assert set(top_p) == {0, 1}, probs
    min_p = sampler(logits, [SamplingParams(temperature=1.0, min_p=0.2)] * 4000, [None] * 4000).token_ids
    assert set(min_p) == {0, 1, 2}
    hot = sampler(logits, [SamplingParams(temperature=100.0)] * 4000, [None] * 4000).token_ids
    assert set(hot) == {0, 1, 2, 3, 4}
    # Zero-probability tokens at both ends and between are never drawn, whatever the random number.
    gaps = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]]).repeat(4000, 1)
    assert set(sampler(gaps, params, [None] * 4000).token_ids) == {1, 3}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"n": 0}, "n must be an integer from 1"),
    ],
)
def test_bad_sampling_params_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampler_with_the_cpp_argmax_picks_what_torch_picks():
    from pagedllm.layers.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    logits = torch.randn(9, 49152, generator=torch.Generator().manual_seed(3))
    logits[2, 100] = logits[2, 7] = logits[2].max() + 1  # a tie: the first index
    params = [SamplingParams(temperature=0.0)] * 9
    fast = Sampler(seed=0, kernels=kernels)
    assert fast.kernels is kernels
    assert fast(logits, params, [None] * 9).token_ids == logits.argmax(dim=-1).tolist()
    assert fast(logits, params, [None] * 9).token_ids[2] == 7
    # A non-contiguous view goes to torch's argmax, with the same answer.
    view = logits[:, :40000]
    assert fast(view, params, [None] * 9).token_ids == view.argmax(dim=-1).tolist()


def test_sampler_reads_bfloat16_logits_as_their_float32_copy():
    from pagedllm.layers.cpu_kernels import load_cpu_kernels

    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(5)).bfloat16()
    logits[1, 10] = logits[1, 4000] = logits[1].max() + 1  # a tie: the first index
    logits[4, 77] = float("nan")  # no token allowed there: looked at alone, NaN as -inf
    wide = logits.float()
    greedy_rows = [SamplingParams(temperature=0.0)] * 6
    for sampler in (Sampler(seed=0, kernels=load_cpu_kernels()), Sampler(seed=0)):
        assert sampler(logits, greedy_rows, [None] * 6).token_ids == sampler(wide, greedy_rows, [None] * 6).token_ids
        # Rows that need more than the argmax get the float32 logits: logprobs, seeded draws.
        mixed = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, seed=3)] * 3
        seeds = [None, 11] * 3
        finite = logits.nan_to_num(nan=0.0)
        ours, reference = sampler(finite, mixed, seeds), sampler(finite.float(), mixed, seeds)
        assert ours.token_ids == reference.token_ids and ours.logprobs == reference.logprobs


def test_greedy_steps_sample_the_heads_bfloat16_output(monkeypatch):
    from conftest import assert_no_blocks_held

    from pagedllm import LLM

    llm = LLM(dtype="bfloat16", kv_cache_memory="256MiB")  # the GGUF's blocks kept, the default
    runner = llm.engine.runner
    seen: list[torch.dtype] = []
    sample = runner.sample

    def spy(logits, rows):
        seen.append(logits.dtype)
        return sample(logits, rows)

    monkeypatch.setattr(runner, "sample", spy)
    prompts = [chat_ids(llm), chat_ids(llm, [{"role": "user", "content": "Name five colours."}])]
    fast = [o.token_ids for o in llm.generate(prompts, greedy(12))]
    assert set(seen) == {torch.bfloat16}
    # A step with a row that asks for logprobs samples float32 logits, as every step did before.
    seen.clear()
    with_logprobs = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=1))
    assert set(seen) == {torch.float32} and with_logprobs[0].token_ids == fast[0][:3]
    seen.clear()
    monkeypatch.setattr(runner, "argmax_only", lambda rows: False)
    assert [o.token_ids for o in llm.generate(prompts, greedy(12))] == fast
    assert set(seen) == {torch.float32}
    assert_no_blocks_held(llm)
