"""Sharing KV blocks on the real model: prefix-cache hits and n>1 forks give the tokens they should."""

from conftest import assert_no_blocks_held

from pagedllm import SamplingParams

QUESTION = [
    {
        "role": "user",
        "content": "Explain in two sentences why the sky is blue, and then say in one more sentence why sunsets "
        "are red instead, using words a child would understand.",
    }
]


def test_greedy_output_is_the_same_with_and_without_prefix_caching(make_llm):
    cached = make_llm(kv_cache_memory="64MiB", enable_prefix_caching=True)
    plain = make_llm(kv_cache_memory="64MiB", enable_prefix_caching=False)
    ids = cached.tokenizer.apply_chat_template(QUESTION)
    whole = ids[: len(ids) // 16 * 16]  # a prompt of whole blocks
    prompts = [
        ids,  # cold: fills the cache
        ids,  # full hit (all but the block holding the last token)
        ids[:-5] + cached.tokenizer.encode(" Answer briefly."),  # partial hit: diverges in the last blocks
        whole,
        whole,  # whole-block prompt hit again: its last block is recomputed, not shared
        ids[:40],  # hit of the first two blocks only
    ]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    scheduler = cached.engine.scheduler
    with_cache, hits = [], []
    for prompt in prompts:  # one at a time, so later prompts find what earlier ones left
        before = scheduler.prefix_cache_hit_tokens
        with_cache.append(cached.generate(prompt, params)[0].token_ids)
        hits.append(scheduler.prefix_cache_hit_tokens - before)
    without = [o.token_ids for o in plain.generate(prompts, params)]
    assert with_cache == without
    n, w = len(ids), len(whole)
    shared_p3 = min((n - 5) // 16, (len(prompts[2]) - 1) // 16) * 16
    assert hits == [0, (n - 1) // 16 * 16, shared_p3, w - 16, w - 16, 32]
    assert plain.engine.scheduler.prefix_cache_hit_tokens == 0


def test_each_of_n_samples_equals_a_single_request_with_its_seed(make_llm):
    llm = make_llm(kv_cache_memory="64MiB")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a line about the moon."}])
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    (group,) = llm.generate(prompt, params)
    assert [c.index for c in group.outputs] == [0, 1, 2, 3] and group.finished
    singles = [
        llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=1234 + i, max_tokens=16))[0]
        for i in range(4)
    ]
    assert [c.token_ids for c in group.outputs] == [s.token_ids for s in singles]
    assert [c.text for c in group.outputs] == [s.text for s in singles]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1  # distinct streams
    assert group.text == group.outputs[0].text


def test_greedy_n_gives_identical_samples_and_copies_only_the_partial_block(make_llm):
    llm = make_llm(kv_cache_memory="64MiB")
    scheduler = llm.engine.scheduler
    prompt = llm.tokenizer.apply_chat_template(QUESTION)
    num_prompt = len(prompt)
    forks, copies = scheduler.num_forks, scheduler.num_cow_copies
    (group,) = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=12))
    (single,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))
    assert [c.token_ids for c in group.outputs] == [single.token_ids] * 3
    assert scheduler.num_forks - forks == 2
    # The prompt's partial last block is copied once per sample but the last one, which writes in place.
    assert scheduler.num_cow_copies - copies == (2 if num_prompt % 16 else 0)
    assert_no_blocks_held(llm)


def test_aborting_an_n_request_frees_every_sample(make_llm):
    llm = make_llm(kv_cache_memory="64MiB")
    engine = llm.engine
    # ignore_eos: no sample may end on its own before the abort, whatever the random draws
    params = SamplingParams(n=3, temperature=0.7, max_tokens=100, ignore_eos=True)
    engine.add_request("Count from one to fifty.", params, "abc")
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.num_used_blocks > 0
    output = engine.abort_request("abc")
    assert output.finished and [c.finish_reason for c in output.outputs] == ["abort"] * 3
    assert_no_blocks_held(llm)
