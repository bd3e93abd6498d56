"""The `pagedllm` command: generate (as a real subprocess), bench, errors."""

import json
import subprocess
import sys

import pytest

from pagedllm.cli import main


def test_generate_runs_as_a_console_command():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.cli",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "12",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "256MiB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "finish reason" in result.stderr and "KV cache:" in result.stderr


def test_bench_writes_the_required_fields(tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text(
        "\n".join(
            json.dumps({"id": f"r{i}", "prompt_token_ids": list(range(100, 100 + 20 + i)), "max_tokens": 5 + i})
            for i in range(6)
        )
    )
    out_file = tmp_path / "result.json"
    code = main(
        [
            "bench",
            "--workload",
            str(workload),
            "--num-requests",
            "4",
            "--output",
            str(out_file),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "64MiB",
            "--log-level",
            "WARNING",
        ]
    )
    assert code == 0
    result = json.loads(out_file.read_text())
    for key in (
        "wall_s",
        "requests",
        "prompt_tokens",
        "output_tokens",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "peak_running",
        "preemptions",
        "kv_blocks_total",
        "kv_peak_blocks_used",
    ):
        assert key in result, key
    assert result["requests"] == 4
    assert result["prompt_tokens"] == 20 + 21 + 22 + 23
    assert result["output_tokens"] == 5 + 6 + 7 + 8  # EOS ignored: exactly max_tokens each
    assert result["peak_running"] == 4 and result["kv_peak_blocks_used"] >= 4
    assert json.loads(capsys.readouterr().out) == result


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
        (["generate", "hi", "--top-p", "2"], "top_p"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--model", "/no/such/model"], "unknown model path"),
        (["bench", "--workload", "/no/such/file.jsonl"], "No such file"),
    ],
)
def test_cli_errors_are_clear(argv, message, capsys):
    assert main(argv + ["--log-level", "WARNING"]) == 2
    assert message in capsys.readouterr().err


def test_chat_streams_replies_and_keeps_the_conversation(monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n\n"))
    code = main(
        ["chat", "--max-tokens", "20", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "WARNING"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out
