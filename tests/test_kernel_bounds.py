"""The C++ kernels' boundary: a wrong call is refused with an error naming the kernel before the
kernel runs, and under AddressSanitizer neither engine steps nor wrong calls read or write
outside a tensor (and with the checks switched off, a wrong call does: the test can fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pagedllm.layers.cpu_kernels import load_cpu_kernels
from pagedllm.testing.kernel_misuse import WRONG_CALLS

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here")


@needs_kernels
@pytest.mark.parametrize("name", list(WRONG_CALLS))
def test_a_wrong_call_is_refused_naming_the_kernel(name):
    with pytest.raises((ValueError, TypeError)) as refused:
        WRONG_CALLS[name](kernels)
    assert name.split(":")[0] in str(refused.value)


def _libasan() -> str | None:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return None
    found = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


_SCRIPT = textwrap.dedent(
    """
    import sys
    import pagedllm.layers.cpu_kernels as cpu
    from pagedllm.testing.kernel_misuse import WRONG_CALLS, run_all

    mode = sys.argv[1]
    kernels = cpu.load_cpu_kernels()
    assert kernels is not None, "the sanitized kernels did not build"
    if mode == "engine":
        from pagedllm import LLM, SamplingParams

        prompts = ["Hello", "Name three colors of the rainbow, please.", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18"]
        for weights in ("native", "dequantized"):
            llm = LLM(dtype="float32", weights=weights, kv_cache_memory="64MiB", max_num_seqs=8)
            outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
            assert all(o.outputs[0].token_ids for o in outs)
        accepted = run_all(kernels)
        assert not accepted, accepted
    else:  # the boundary's checks switched off: the named wrong call reaches its kernel
        cpu._require = lambda *args, **kwargs: None
        cpu.check_index_range = lambda *args, **kwargs: None
        WRONG_CALLS[mode](kernels)
    print("done")
    """
)


def _sanitized(mode: str, tmp_path) -> subprocess.CompletedProcess:
    from conftest import release_shared_engines

    release_shared_engines()  # the sanitized child takes GBs of its own (its engine steps under ASan)
    env = {
        **os.environ,
        "PAGEDLLM_KERNEL_SANITIZE": "address",
        "LD_PRELOAD": _libasan(),
        # Python and torch hold memory to the end: leaks are not what this looks for.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=86",
        "PAGEDLLM_COMMIT_KV_CACHE": "0",
    }
    script = tmp_path / "sanitized.py"
    script.write_text(_SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )


needs_asan = pytest.mark.skipif(_libasan() is None, reason="no AddressSanitizer runtime (libasan) for the compiler")


@needs_kernels
@needs_asan
def test_engine_steps_and_wrong_calls_stay_inside_their_tensors(tmp_path):
    result = _sanitized("engine", tmp_path)
    assert "AddressSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0 and "done" in result.stdout, result.stderr[-4000:]


@needs_kernels
@needs_asan
@pytest.mark.parametrize(
    "name", ["rope_write_kv: qkv narrower than its heads", "paged_decode_attention: a block id past the cache"]
)
def test_without_the_checks_the_sanitizer_catches_the_wrong_call(name, tmp_path):
    """The harness has teeth: the same wrong call with the boundary's checks removed is an overflow."""
    result = _sanitized(name, tmp_path)
    assert result.returncode != 0 and "done" not in result.stdout
    assert "AddressSanitizer" in result.stderr and "overflow" in result.stderr, result.stderr[-3000:]
