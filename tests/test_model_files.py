"""Model files are untrusted input: damaged copies of the bundled SmolLM2 GGUF (one fault each)
and of a tiny checkpoint directory, each run through `pagedllm generate` in a subprocess under a
memory limit and a timeout, end in one line naming the problem and a nonzero exit: never a
crash, a hang, a traceback or a run on a broken file.  The untouched file still generates."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedllm.models.loader import default_model_path
from pagedllm.testing.gguf_damage import (
    ARRAY,
    STRING,
    Header,
    Item,
    header_bytes,
    map_tensor,
    read_header,
    set_item,
    write,
)

MEMORY_LIMIT = 6 * 2**30  # address space of each run (torch alone maps ~2 GiB)
TIMEOUT_S = 180
U32, I32, F32, U64 = 4, 5, 6, 10


def _run(model: Path | str, *extra: str) -> subprocess.CompletedProcess:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    command = [sys.executable, "-m", "pagedllm", "generate", "Hello", "--model", str(model), "--max-tokens", "4"]
    command += ["--kv-cache-memory", "64MiB", "--log-level", "WARNING", *extra]
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_DEBUG"}
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        preexec_fn=limit_memory,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _strings(header: Header, key: str) -> list[bytes]:
    payload = header.item(key).payload
    count = struct.unpack_from("<Q", payload, 4)[0]
    pos, out = 12, []
    for _ in range(count):
        length = struct.unpack_from("<Q", payload, pos)[0]
        out.append(payload[pos + 8 : pos + 8 + length])
        pos += 8 + length
    return out


def _string_array(values: list[bytes]) -> bytes:
    return struct.pack("<IQ", STRING, len(values)) + b"".join(struct.pack("<Q", len(v)) + v for v in values)


def _with_item(header: Header, key: str, kind: int, payload: bytes) -> Header:
    items = [i for i in header.items if i.key != key] + [Item(key, kind, payload)]
    return dataclasses.replace(header, items=items)


def _renamed_architecture(header: Header, arch: str) -> Header:
    """Every llama.* key renamed for another architecture, as a file converted for it would have."""
    items = [
        dataclasses.replace(i, key=arch + i.key[len("llama") :]) if i.key.startswith("llama.") else i
        for i in header.items
    ]
    return set_item(dataclasses.replace(header, items=items), "general.architecture", STRING, arch)


def _tensor_dims(name: str, dims: list[int]):
    return lambda h: map_tensor(h, name, lambda t: dataclasses.replace(t, dims=dims))


def _tensor_field(tensor: str, **change):
    return lambda h: map_tensor(h, tensor, lambda t: dataclasses.replace(t, **change))


# Header faults: name -> (change to the header, words the one-line error must hold).
HEADER_FAULTS = {
    "version": (lambda h: dataclasses.replace(h, version=99), "version 99"),
    "huge tensor count": (lambda h: dataclasses.replace(h, num_tensors=2**60), "tensor count"),
    "huge metadata count": (lambda h: dataclasses.replace(h, num_items=2**62), "metadata count"),
    "more tensors than listed": (lambda h: dataclasses.replace(h, num_tensors=len(h.tensors) + 1), "tensor"),
    "huge string length": (
        lambda h: _with_item(h, "general.name", STRING, struct.pack("<Q", 2**62) + b"x"),
        "general.name",
    ),
    "string not utf-8": (lambda h: _with_item(h, "general.name", STRING, struct.pack("<Q", 2) + b"\xff\xfe"), "UTF-8"),
    "unknown value type": (lambda h: _with_item(h, "general.name", 99, b"\0" * 8), "value type 99"),
    "deeply nested array": (
        lambda h: _with_item(h, "general.tags", ARRAY, struct.pack("<IQ", ARRAY, 1) * 20000 + struct.pack("<IQ", 0, 0)),
        "nested",
    ),
    "huge array length": (
        lambda h: _with_item(h, "general.tags", ARRAY, struct.pack("<IQ", U32, 2**61)),
        "array length",
    ),
    "duplicate key": (lambda h: dataclasses.replace(h, items=h.items + [h.item("general.name")]), "twice"),
    "block_count 10^9": (lambda h: set_item(h, "llama.block_count", U32, 10**9), "llama.block_count"),
    "block_count 0": (lambda h: set_item(h, "llama.block_count", U32, 0), "llama.block_count"),
    "block_count too small": (lambda h: set_item(h, "llama.block_count", U32, 29), "'blk.29."),
    "head_count 0": (lambda h: set_item(h, "llama.attention.head_count", U32, 0), "llama.attention.head_count"),
    "head_count_kv 0": (lambda h: set_item(h, "llama.attention.head_count_kv", U32, 0), "head_count_kv"),
    "head_count_kv not dividing": (lambda h: set_item(h, "llama.attention.head_count_kv", U32, 2), "does not divide"),
    "heads not dividing width": (lambda h: set_item(h, "llama.attention.head_count", U32, 7), "head_count"),
    "width of a string": (lambda h: set_item(h, "llama.embedding_length", STRING, "576"), "embedding_length"),
    "width wrong": (lambda h: set_item(h, "llama.embedding_length", U32, 1152), "shape"),
    "per-layer head counts": (
        lambda h: _with_item(
            h, "llama.attention.head_count", ARRAY, struct.pack("<IQ", U32, 30) + struct.pack("<I", 9) * 30
        ),
        "per-layer",
    ),
    "mlp width wrong": (lambda h: set_item(h, "llama.feed_forward_length", U32, 1000), "shape"),
    "key_length wrong": (lambda h: set_item(h, "llama.attention.key_length", U32, 128), "shape"),
    "context_length 0": (lambda h: set_item(h, "llama.context_length", U32, 0), "context_length"),
    "context_length huge": (lambda h: set_item(h, "llama.context_length", U64, 2**40), "context_length"),
    "rope base NaN": (lambda h: set_item(h, "llama.rope.freq_base", F32, float("nan")), "freq_base"),
    "rope base inf": (lambda h: set_item(h, "llama.rope.freq_base", F32, float("inf")), "freq_base"),
    "rms eps negative": (lambda h: set_item(h, "llama.attention.layer_norm_rms_epsilon", F32, -1.0), "epsilon"),
    "rotary dim odd": (lambda h: set_item(h, "llama.rope.dimension_count", U32, 63), "dimension_count"),
    "rope scaling unknown": (lambda h: set_item(h, "llama.rope.scaling.type", STRING, "warp"), "warp"),
    "alignment 0": (lambda h: set_item(h, "general.alignment", U32, 0), "general.alignment"),
    "alignment 3": (lambda h: set_item(h, "general.alignment", U32, 3), "general.alignment"),
    "architecture unknown": (lambda h: set_item(h, "general.architecture", STRING, "gpt99"), "gpt99"),
    "architecture an integer": (lambda h: set_item(h, "general.architecture", U32, 7), "general.architecture"),
    "architecture gemma3 on llama tensors": (lambda h: set_item(h, "general.architecture", STRING, "gemma3"), "gemma3"),
    "architecture missing": (
        lambda h: dataclasses.replace(h, items=[i for i in h.items if i.key != "general.architecture"]),
        "general.architecture",
    ),
    "unknown tensor type": (_tensor_field("blk.3.ffn_up.weight", kind=99), "type 99"),
    "integer tensor type": (_tensor_field("blk.3.ffn_up.weight", kind=26), "I32"),
    "tensor type of a smaller block": (_tensor_field("blk.3.ffn_up.weight", kind=2), "expected"),
    "tensor type of a larger block": (_tensor_field("blk.3.ffn_up.weight", kind=8), "expected"),
    "architecture qwen2 throughout": (lambda h: _renamed_architecture(h, "qwen2"), "attn_q.bias"),
    "architecture qwen3 throughout": (lambda h: _renamed_architecture(h, "qwen3"), "attn_q_norm"),
    "architecture phi3 throughout": (lambda h: _renamed_architecture(h, "phi3"), "ffn"),
    "tensor offset past the end": (_tensor_field("blk.29.ffn_down.weight", offset=2**40), "past the end"),
    "tensor offset huge": (_tensor_field("blk.29.ffn_down.weight", offset=2**64 - 32), "past the end"),
    "tensor offset misaligned": (_tensor_field("blk.2.ffn_down.weight", offset=8), "multiple of 32"),
    "tensors overlapping": (_tensor_field("blk.2.ffn_down.weight", offset=0), "expected"),
    "duplicate tensor": (lambda h: dataclasses.replace(h, tensors=h.tensors + [h.tensors[-1]]), "twice"),
    "attn_v rows short": (_tensor_dims("blk.0.attn_v.weight", [576, 64]), "attn_v"),
    "attn_q shape wrong": (_tensor_dims("blk.7.attn_q.weight", [576, 64]), "attn_q"),
    "norm without dimensions": (_tensor_dims("blk.1.attn_norm.weight", []), "attn_norm"),
    "five dimensions": (_tensor_dims("blk.1.attn_norm.weight", [576, 1, 1, 1, 1]), "dimensions"),
    "dimension of 0": (_tensor_dims("blk.1.ffn_norm.weight", [0]), "dimension of 0"),
    "dimensions huge": (_tensor_dims("blk.1.ffn_up.weight", [576, 2**40]), "ffn_up"),
    "rows not whole blocks": (_tensor_dims("blk.1.ffn_up.weight", [500, 1536]), "blocks"),
    "embedding 1-D": (_tensor_dims("token_embd.weight", [576 * 49152]), "token_embd"),
    "tensor missing": (
        lambda h: dataclasses.replace(h, tensors=[t for t in h.tensors if t.name != "blk.5.ffn_up.weight"]),
        "blk.5.ffn_up",
    ),
    "tensor unknown": (_tensor_field("blk.5.ffn_up.weight", name="blk.5.ffn_upp.weight"), "ffn_upp"),
    "tensor of a layer past the last": (
        _tensor_field("blk.5.ffn_up.weight", name="blk.30.ffn_up.weight"),
        "blk.5.ffn_up",
    ),
    "tensor name not utf-8": (_tensor_field("blk.5.ffn_up.weight", name="blk.5.\udcff"), "UTF-8"),
    "vocabulary shorter than the embedding": (
        lambda h: _with_item(
            h, "tokenizer.ggml.tokens", ARRAY, _string_array(_strings(h, "tokenizer.ggml.tokens")[:-1])
        ),
        "tokenizer.ggml.tokens",
    ),
    "tokens of integers": (
        lambda h: _with_item(h, "tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", U32, 3) + b"\0" * 12),
        "tokenizer.ggml.tokens",
    ),
    "bos id past the vocabulary": (lambda h: set_item(h, "tokenizer.ggml.bos_token_id", U32, 10**6), "bos_token_id"),
    "eos id negative": (lambda h: set_item(h, "tokenizer.ggml.eos_token_id", I32, -1), "eos_token_id"),
    "chat template does not parse": (
        lambda h: set_item(h, "tokenizer.chat_template", STRING, "{% if %}{{"),
        "chat_template",
    ),
    "chat template raises": (
        lambda h: set_item(h, "tokenizer.chat_template", STRING, "{{ raise_exception('no chats') }}"),
        "chat template failed",
    ),
    "token types out of range": (
        lambda h: _with_item(
            h, "tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", I32, 49152) + struct.pack("<i", 99) * 49152
        ),
        "token_type",
    ),
    "pre-tokenizer not a name": (
        lambda h: set_item(h, "tokenizer.ggml.pre", STRING, "../../x y"),
        "tokenizer.ggml.pre",
    ),
    "tokenizer model unknown": (lambda h: set_item(h, "tokenizer.ggml.model", STRING, "foo"), "tokenizer"),
    "token not utf-8": (
        lambda h: _with_item(
            h, "tokenizer.ggml.tokens", ARRAY, _string_array([b"\xff\xfe", *_strings(h, "tokenizer.ggml.tokens")[1:]])
        ),
        "tokenizer",
    ),
    "eos id an array": (
        lambda h: _with_item(
            h, "tokenizer.ggml.eos_token_id", ARRAY, struct.pack("<IQ", U32, 1) + struct.pack("<I", 2)
        ),
        "eos_token_id",
    ),
    "merges not strings": (
        lambda h: _with_item(h, "tokenizer.ggml.merges", ARRAY, struct.pack("<IQ", U32, 2) + b"\0" * 8),
        "tokenizer",
    ),
}


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _damaged(good: Path, header: Header, name: str, change, out: Path) -> Path:
    changed = change(header)
    path = out / f"{name.replace(' ', '_')}.gguf"
    raw = _header_bytes_raw(changed)
    # The tensor data as a hole of the good file's size: every fault here is in the header, and a
    # file whose fault went unnoticed would still run (on zero weights) and fail the test.
    with open(path, "wb") as f:
        f.write(raw + b"\0" * (-len(raw) % 32))
        f.truncate(f.tell() + good.stat().st_size - header.data_start)
    return path


def _header_bytes_raw(header: Header) -> bytes:
    """header_bytes, with tensor names that hold lone surrogates written as the raw bytes they stand for."""
    if all(t.name.isascii() for t in header.tensors):
        return header_bytes(header)
    marker = {t.name: f"@@{i:06d}" for i, t in enumerate(header.tensors) if not t.name.isascii()}
    tensors = [dataclasses.replace(t, name=marker.get(t.name, t.name)) for t in header.tensors]
    raw = header_bytes(dataclasses.replace(header, tensors=tensors))
    for name, stand_in in marker.items():  # same length: the name's length prefix is patched too
        old = struct.pack("<Q", len(stand_in)) + stand_in.encode()
        raw = raw.replace(old, struct.pack("<Q", len(_encode(name))) + _encode(name))
    return raw


@pytest.fixture(scope="module")
def good() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def header(good) -> Header:
    return read_header(good)


def _assert_refused(result: subprocess.CompletedProcess, expected: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("pagedllm: error:")]
    assert result.returncode not in (0, None) and result.returncode > 0, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1, lines[-10:]
    assert expected.lower() in errors[0].lower(), errors[0]
    assert not result.stdout.strip(), result.stdout  # nothing generated


# Runs `pagedllm generate` once a path in one process (the CLI's own `main`, as the command
# runs it), printing each run's exit code, stderr and stdout as a JSON line: one torch import for
# many files.  Each run starts from the CLI's entry as a new process would; a fault that got past
# the checks and corrupted the process would show in the runs after it.
_DRIVER = """
import contextlib, io, json, sys
from pagedllm.cli import main
for path in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["generate", "Hello", "--model", path, "--max-tokens", "4", "--kv-cache-memory", "64MiB",
                         "--log-level", "WARNING", *json.loads(sys.argv[2])])
        except SystemExit as exit:
            code = exit.code
    print(json.dumps([code, err.getvalue(), out.getvalue()]), flush=True)
"""


def _run_many(paths: list[Path], *extra: str) -> list[subprocess.CompletedProcess]:
    """`_run` for each path, in one subprocess under the same limits (a line of JSON each)."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_DEBUG"}
    command = [sys.executable, "-c", _DRIVER, json.dumps([str(p) for p in paths]), json.dumps(list(extra))]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT_S + 5 * len(paths), preexec_fn=limit_memory,
        env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert done.returncode == 0 and len(lines) == len(paths), (done.returncode, done.stderr[-3000:])
    runs = [json.loads(line) for line in lines]
    return [subprocess.CompletedProcess(path, code, out, err) for path, (code, err, out) in zip(paths, runs)]


def _assert_all_refused(cases: dict[str, tuple[Path, str]], *extra: str) -> None:
    """Each case (path, words its error must hold) run through the CLI, the cases split between two
    processes; every failure listed at once."""
    paths = [path for path, _ in cases.values()]
    halves = [paths[: len(paths) // 2], paths[len(paths) // 2 :]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [run for half in pool.map(lambda half: _run_many(half, *extra) if half else [], halves) for run in half]
    results = dict(zip(cases, runs))
    failures = []
    for name, result in results.items():
        try:
            _assert_refused(result, cases[name][1])
        except AssertionError as error:
            failures.append(f"{name}: {error}")
    assert not failures, "\n".join(failures)


def test_damaged_gguf_headers_are_refused_in_one_line(good, header, tmp_path):
    _assert_all_refused(
        {
            name: (_damaged(good, header, name, change, tmp_path), words)
            for name, (change, words) in HEADER_FAULTS.items()
        }
    )


def _cut(good: Path, size: int, out: Path) -> Path:
    with open(good, "rb") as src, open(out, "wb") as f:
        f.write(src.read(size))
    return out


def test_truncated_and_foreign_files_are_refused(good, header, tmp_path):
    size = good.stat().st_size
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    device = tmp_path / "zero.gguf"
    device.symlink_to("/dev/zero")
    cases = {
        "empty": (_cut(good, 0, tmp_path / "empty.gguf"), "not a GGUF file"),
        "magic only": (_cut(good, 4, tmp_path / "magic.gguf"), "shorter than a GGUF header"),
        "cut in the metadata": (_cut(good, 1000, tmp_path / "meta.gguf"), "truncated or damaged"),
        "cut in the tensor infos": (_cut(good, header.data_start - 100, tmp_path / "infos.gguf"), "past the end"),
        "cut in the data": (_cut(good, size // 2, tmp_path / "data.gguf"), "past the end of the file"),
        "cut by one byte": (_cut(good, size - 1, tmp_path / "byte.gguf"), "past the end of the file"),
        "not a gguf": (tmp_path / "text.gguf", "not a GGUF file"),
        "named pipe": (fifo, "named pipe"),
        "directory": (folder, "no config.json"),
        "character device": (device, "character device"),
        "missing": (tmp_path / "nothing.gguf", "no such file"),
    }
    (tmp_path / "text.gguf").write_text("<html>not found</html>" * 10)
    _assert_all_refused(cases)


def test_the_untouched_file_still_generates(good, header, tmp_path):
    copy = write(good, header, tmp_path / "same.gguf")  # rewritten by the same code that damages
    assert copy.read_bytes() == good.read_bytes()
    result = _run(copy, "--weights", "native")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), result.stderr[-2000:]


def test_an_unreadable_file_is_one_line(good, tmp_path, monkeypatch):
    """Root reads any file, so the permission error is simulated where the file is opened."""
    from pagedllm.cli import main

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("pagedllm.models.gguf_file.os.open", refuse)
    assert main(["generate", "Hello", "--model", str(good)]) == 2


# --- a tiny checkpoint directory ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from pagedllm.testing.hf_reference import save_random_llama

    path = tmp_path_factory.mktemp("tiny")
    save_random_llama(
        path, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return path


def _copy_dir(source: Path, out: Path) -> Path:
    import shutil

    shutil.copytree(source, out)
    return out


def _edit_config(path: Path, **change) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _safetensors(path: Path) -> Path:
    return next(path.glob("*.safetensors"))


def _edit_safetensors_header(path: Path, change) -> Path:
    file = _safetensors(path)
    raw = file.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + length])
    new = json.dumps(change(header)).encode()
    new += b" " * (-len(new) % 8)
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])
    return path


def _rewrite(path: Path, name: str, change) -> Path:
    (path / name).write_text(change((path / name).read_text()))
    return path


def _first_weight(header: dict) -> str:
    return next(k for k in header if k.endswith("q_proj.weight"))


DIR_FAULTS = {
    "layers 0": (lambda p: _edit_config(p, num_hidden_layers=0), "num_hidden_layers"),
    "layers 10^9": (lambda p: _edit_config(p, num_hidden_layers=10**9), "num_hidden_layers"),
    "heads a string": (lambda p: _edit_config(p, num_attention_heads="4"), "num_attention_heads"),
    "kv heads not dividing": (lambda p: _edit_config(p, num_key_value_heads=3), "num_key_value_heads"),
    "hidden wrong": (lambda p: _edit_config(p, hidden_size=96), "shape"),
    "rope theta NaN": (lambda p: _edit_config(p, rope_theta=float("nan")), "rope_theta"),
    "bos past the vocabulary": (lambda p: _edit_config(p, bos_token_id=10**6), "bos_token_id"),
    "config not json": (lambda p: _rewrite(p, "config.json", lambda text: "{"), "not valid JSON"),
    "header length huge": (
        lambda p: _safetensors(p).write_bytes(struct.pack("<Q", 2**60) + _safetensors(p).read_bytes()[8:]) and p,
        "header length",
    ),
    "data offsets past the end": (
        lambda p: _edit_safetensors_header(
            p, lambda h: {**h, _first_weight(h): {**h[_first_weight(h)], "data_offsets": [10**9, 10**9 + 64 * 64 * 4]}}
        ),
        "past the file",
    ),
    "shape against its bytes": (
        lambda p: _edit_safetensors_header(
            p, lambda h: {**h, _first_weight(h): {**h[_first_weight(h)], "shape": [64, 65]}}
        ),
        "bytes",
    ),
    "dtype unknown": (
        lambda p: _edit_safetensors_header(
            p, lambda h: {**h, _first_weight(h): {**h[_first_weight(h)], "dtype": "Q9"}}
        ),
        "dtype",
    ),
    "tensor missing": (
        lambda p: _edit_safetensors_header(
            p, lambda h: {k: v for k, v in h.items() if not k.endswith("layers.1.mlp.up_proj.weight")}
        ),
        "up_proj",
    ),
    "chat template does not parse": (
        lambda p: _rewrite(
            p, "tokenizer_config.json", lambda t: json.dumps({**json.loads(t), "chat_template": "{% for %}"})
        ),
        "chat_template",
    ),
}


def test_damaged_checkpoint_directories_are_refused_in_one_line(tiny_dir, tmp_path):
    cases = {}
    for name, (change, words) in DIR_FAULTS.items():
        cases[name] = (change(_copy_dir(tiny_dir, tmp_path / name.replace(" ", "_"))), words)
    _assert_all_refused(cases, "--raw")


def test_the_untouched_checkpoint_directory_generates(tiny_dir):
    result = _run(tiny_dir, "--raw")
    assert result.returncode == 0, result.stderr[-3000:]
