"""Benchmark datasets and the online benchmark's arithmetic (pure Python, no model)."""

import json

import pytest

from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset, load_workload, save_workload, summarize
from pagedllm.benchmarking.serve import RequestTiming, arrival_times, parse_goodput, percentiles


def test_random_dataset_lengths_ids_and_seed():
    spec = DatasetSpec("random", num_prompts=200, input_len=100, output_len=50, range_ratio=0.5, seed=3)
    requests = generate_dataset(spec, vocab_size=49152)
    assert len(requests) == 200 and len({r["id"] for r in requests}) == 200
    prompt_lens = [len(r["prompt_token_ids"]) for r in requests]
    assert min(prompt_lens) >= 50 and max(prompt_lens) <= 150 and max(prompt_lens) - min(prompt_lens) > 50
    assert all(25 <= r["max_tokens"] <= 75 for r in requests)
    assert all(1000 <= t < 49152 for r in requests for t in r["prompt_token_ids"])
    assert generate_dataset(spec, 49152) == requests  # the seed decides everything
    assert generate_dataset(DatasetSpec("random", num_prompts=200, seed=4), 49152) != requests
    fixed = generate_dataset(DatasetSpec("random", num_prompts=5, input_len=32, output_len=8), 49152)
    assert {len(r["prompt_token_ids"]) for r in fixed} == {32} and {r["max_tokens"] for r in fixed} == {8}


def test_shared_prefix_dataset_shares_its_prefixes():
    spec = DatasetSpec("shared-prefix", num_prompts=40, input_len=64, output_len=16, prefix_len=96, num_prefixes=3)
    requests = generate_dataset(spec, vocab_size=1000)  # a small vocabulary: ids from 100 up
    prefixes = {tuple(r["prompt_token_ids"][:96]) for r in requests}
    assert len(prefixes) == 3
    assert all(len(r["prompt_token_ids"]) == 96 + 64 for r in requests)
    assert all(100 <= t < 1000 for r in requests for t in r["prompt_token_ids"])


def test_sharegpt_like_lengths_have_the_asked_means_and_a_tail():
    spec = DatasetSpec("sharegpt-like", num_prompts=2000, input_len=250, output_len=150, seed=1)
    stats = summarize(generate_dataset(spec, 49152))
    assert 200 < stats["prompt_tokens"] / 2000 < 260 and 125 < stats["output_tokens"] / 2000 < 160
    assert stats["prompt_len_min_max"][0] < 40 and stats["prompt_len_min_max"][1] > 700


def test_bad_dataset_settings_are_clear():
    with pytest.raises(ValueError, match="unknown dataset 'sharegpt'"):
        DatasetSpec("sharegpt")
    with pytest.raises(ValueError, match="--num-prompts must be at least 1"):
        DatasetSpec("random", num_prompts=0)
    with pytest.raises(ValueError, match="--range-ratio"):
        DatasetSpec("random", range_ratio=1.5)


def test_saved_workloads_load_back(tmp_path):
    requests = generate_dataset(DatasetSpec("random", num_prompts=3, input_len=8, output_len=4), 49152)
    save_workload(requests, tmp_path / "w.jsonl")
    loaded = load_workload(tmp_path / "w.jsonl")
    assert [r["prompt_token_ids"] for r in loaded] == [r["prompt_token_ids"] for r in requests]
    assert loaded[0]["n"] == 1 and loaded[0]["temperature"] == 0.0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"id": "x", "max_tokens": 3}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not a workload line"):
        load_workload(tmp_path / "bad.jsonl")


def test_goodput_slos_and_timings():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    timing = RequestTiming(ttft=0.4, e2el=2.4, output_tokens=41)
    assert timing.tpot == pytest.approx(0.05)
    assert timing.meets({"ttft": 0.5, "tpot": 0.05}) and not timing.meets({"ttft": 0.3})
    assert not RequestTiming(error="boom").meets({})


def test_poisson_arrivals_and_percentiles():
    times = arrival_times(2000, 4.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert 450 < times[-1] < 550  # 2000 arrivals at 4/s take about 500 s
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_times(3, 0.0, 0)
    p = percentiles([float(i) for i in range(100)], "ttft")
    assert p["ttft_p50_s"] == 50.0 and p["ttft_p99_s"] == 99.0 and p["ttft_mean_s"] == 49.5
