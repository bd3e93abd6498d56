"""Start-up checks on given numbers (pure Python, no model)."""

import pytest

from pagedllm.execution.startup_checks import (
    available_memory_bytes,
    check_kv_cache_memory,
    check_max_model_len,
    fit_max_model_len,
    format_bytes,
)

GiB = 2**30


def test_available_memory_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert available_memory_bytes(meminfo) == 20000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_memory_bytes(meminfo) is None
    assert available_memory_bytes(tmp_path / "missing") is None


def test_kv_cache_memory_beyond_what_is_available_is_refused():
    check_kv_cache_memory(4 * GiB, 20 * GiB)
    check_kv_cache_memory(4 * GiB, None)  # not Linux: nothing to check against
    with pytest.raises(ValueError, match=r"64.0 GiB is more than .* 20.0 GiB of memory is available.*18432MiB or less"):
        check_kv_cache_memory(64 * GiB, 20 * GiB)
    with pytest.raises(ValueError, match="100.0 TiB"):
        check_kv_cache_memory(100 * 2**40, 20 * GiB)
    with pytest.raises(ValueError):  # over 90% of what is available: the weights need the rest
        check_kv_cache_memory(19 * GiB, 20 * GiB)


def test_max_model_len_may_not_exceed_the_models():
    assert check_max_model_len(None, 8192) == 8192
    assert check_max_model_len(2048, 8192) == 2048
    with pytest.raises(ValueError, match="100000 is longer than this model's context length of 8192"):
        check_max_model_len(100_000, 8192)


def test_a_cache_smaller_than_one_request_lowers_the_default_or_refuses_an_explicit_length():
    assert fit_max_model_len(8192, False, num_blocks=1000, block_size=16, block_bytes=1) == 8192
    assert fit_max_model_len(8192, False, num_blocks=100, block_size=16, block_bytes=1) == 1600
    with pytest.raises(
        ValueError, match=r"holds 1600 tokens .* pass --kv-cache-memory 2MiB or more, or --max-model-len 1600"
    ):
        fit_max_model_len(8192, True, num_blocks=100, block_size=16, block_bytes=2**12)
    with pytest.raises(ValueError, match="holds 1 tokens"):
        fit_max_model_len(8192, False, num_blocks=1, block_size=1, block_bytes=1)


def test_format_bytes():
    assert format_bytes(3 * GiB / 2) == "1.5 GiB"
    assert format_bytes(512) == "512 bytes"


def test_the_default_cpu_kv_cache_is_4_gib_or_half_of_what_the_weights_leave_free():
    from pagedllm.execution.startup_checks import default_cpu_kv_cache_memory

    gib = 2**30
    assert default_cpu_kv_cache_memory(20 * gib, 1 * gib) == 4 * gib
    assert default_cpu_kv_cache_memory(5 * gib, 1 * gib) == 2 * gib
    assert default_cpu_kv_cache_memory(1 * gib, 1 * gib) == 256 * 2**20  # the load check then says what fits
    assert default_cpu_kv_cache_memory(None, 1 * gib) == 4 * gib  # MemAvailable unknown
