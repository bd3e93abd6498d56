"""Paged vs contiguous on the real model: same tokens, and the comparison report."""

import json

from pagedllm import SamplingParams
from pagedllm.cli import main

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue?",
]


def test_greedy_output_is_identical_under_both_layouts(make_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    paged = make_llm(kv_cache_memory="64MiB", max_model_len=256)
    # 256-token reservations in 24 MiB (float32: 46,080 bytes a token): two requests at a time.
    contiguous = make_llm(kv_cache_memory="24MiB", max_model_len=256, kv_layout="contiguous")
    assert contiguous.engine.kv_cache.num_tokens_capacity // 256 == 2
    paged_out = paged.chat(messages, params)
    contiguous_out = contiguous.chat(messages, params)
    assert [o.token_ids for o in paged_out] == [o.token_ids for o in contiguous_out]
    assert "Paris" in paged_out[0].text
    assert contiguous.engine.stats.peak_running == 2


def test_bench_compare_writes_the_report_folder(tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text(
        "\n".join(
            json.dumps({"id": f"r{i}", "prompt_token_ids": list(range(200, 230 + 7 * i)), "max_tokens": 6 + 2 * i})
            for i in range(5)
        )
    )
    report = tmp_path / "report"
    argv = ["bench", "--workload", str(workload), "--compare", "paged,contiguous", "--block-size", "16,32"]
    argv += [
        "--report-dir",
        str(report),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--kv-cache-dtype",
        "float32",
    ]
    argv += ["--max-model-len", "128", "--log-level", "WARNING"]
    assert main(argv) == 0
    summary = json.loads((report / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    names = ["paged-bs16", "paged-bs32", "contiguous-bs16", "contiguous-bs32"]
    assert list(summary["settings"]) == names
    for name in names:
        result = summary["settings"][name]
        for key in (
            "output_tokens_per_s",
            "total_tokens_per_s",
            "kv_utilization_mean",
            "kv_utilization_peak",
            "internal_waste_mean",
            "external_fragmentation_waits",
            "peak_running",
        ):
            assert key in result, (name, key)
        assert result["output_tokens"] == sum(6 + 2 * i for i in range(5))
        header, *rows = (report / f"series-{name}.csv").read_text().splitlines()
        assert header.startswith("step,time_s,running,waiting,tokens,allocated")
        assert len(rows) == result["steps"]
    # 16 MiB holds 364 tokens: two 128-token reservations, against every request at once when paged.
    assert summary["settings"]["contiguous-bs16"]["peak_running"] == 2
    assert summary["settings"]["paged-bs16"]["peak_running"] == 5
    # Short requests (36-72 tokens) waste half a 16-token block each when paged, 128 - length when reserved.
    paged, contiguous = (summary["settings"][n]["kv_utilization_mean"] for n in ("paged-bs16", "contiguous-bs16"))
    assert paged > 0.7 and contiguous < 0.5 and paged > contiguous + 0.25
    for plot in ("kv_utilization", "running", "kv_memory", "throughput", "block_size"):
        assert (report / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot


def test_a_report_without_matplotlib_still_has_its_summary_and_series(tmp_path, monkeypatch, capsys, caplog):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    report = tmp_path / "report"
    argv = ["bench", "--dataset", "random", "--num-prompts", "3", "--input-len", "20", "--output-len", "4"]
    argv += ["--report-dir", str(report), "--dtype", "float32", "--kv-cache-memory", "16MiB", "--log-level", "WARNING"]
    assert main(argv) == 0
    summary = json.loads((report / "summary.json").read_text())
    assert "matplotlib is not installed" in summary["plots_skipped"] and "plots" not in summary
    assert (report / "series-paged-bs16.csv").is_file() and not list(report.glob("*.png"))
    assert "no plots" in caplog.text
