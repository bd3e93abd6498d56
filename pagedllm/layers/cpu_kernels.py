"""The C++ CPU kernels (paged attention, fused elementwise ops), compiled once per CPU.

The sources in `csrc/` are plain C++ with a C ABI and no torch headers, so
`g++` builds them in about two seconds (a torch extension took ~40 s, most of
it in torch's headers), and the library does not depend on the torch version:
virtual environments with different torches share one build.  It is compiled
with `-march=native` under a name tied to this CPU's instruction-set flags,
the sources and the compiler, in `$PAGEDLLM_CACHE_DIR/kernels` (default
`~/.cache/pagedllm/kernels`), so a cache shared between machines never runs
code built for another CPU; which paths it takes (AVX-512, AVX512-BF16 or
plain vectorized C++) is decided by those flags at compile time.  OpenMP comes
from the process's libgomp, the one torch has already loaded, so the kernels
and torch share one thread pool.  When the build fails the engine falls back to
pure-torch code and says so.

Calls go through ctypes with raw pointers: ~5 us each for a one-row call, allocation and
checks included (a torch add of the same row: ~1.3 us); five per layer.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.cache_dir import cache_dir

logger = logging.getLogger("pagedllm")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "elementwise.cpp",
    "small_gemm.cpp",
    "sampling.cpp",
    "decode_layers.cpp",
    "quant_gemm.cpp",
    "quant_amx.cpp",
    "quant_pack.cpp",
    "lora.cpp",
)
_HEADERS = ("common.h", "avx2.h", "avx512.h", "amx.h", "quant_layout.h", "softmax.h")
_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
if platform.machine() in ("x86_64", "AMD64"):
    # GCC vectorizes plain loops with 256-bit registers even where AVX-512 is there; 512 made
    # the prefill kernel's loops 1.3-1.4x faster on an AVX-512 Xeon (ignored without AVX-512).
    _FLAGS.append("-mprefer-vector-width=512")
_COMPILER = os.environ.get("CXX", "g++")
# PAGEDLLM_KERNEL_SANITIZE=address builds the kernels with AddressSanitizer (under their own cache
# name): a read or write outside a tensor stops the process with a report.  The process must load
# the sanitizer's runtime first (LD_PRELOAD=$(g++ -print-file-name=libasan.so)); the test suite's
# tests/test_kernel_bounds.py does.
# Built at -O1: ~14 s where -O3 with the sanitizer takes ~90 s, the same code paths (intrinsics).
SANITIZE_FLAGS = {"address": ["-fsanitize=address", "-fno-omit-frame-pointer"]}


def _build_flags() -> list[str]:
    sanitizer = os.environ.get("PAGEDLLM_KERNEL_SANITIZE", "")
    if not sanitizer:
        return _FLAGS
    if sanitizer not in SANITIZE_FLAGS:
        raise ValueError(f"PAGEDLLM_KERNEL_SANITIZE must be one of {', '.join(SANITIZE_FLAGS)}, got {sanitizer!r}")
    return ["-O1" if flag == "-O3" else flag for flag in _FLAGS] + SANITIZE_FLAGS[sanitizer]


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_F32, _BF16 = (torch.float32,), (torch.bfloat16,)
# float32 activations over a float16 KV cache: the kernels that touch the cache have a version for
# the pair (`f32_f16kv`), keyed by (activation dtype, cache dtype); see kernel_key.
_F16KV = ((torch.float32, torch.float16),)
# float32 or bfloat16 activations over a float8 e4m3 KV cache (`f32_f8kv`, `bf16_f8kv`).
_F8KV = ((torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn))
_SIGNATURES = {  # name: (argument types, the dtypes it has a `name_suffix` symbol for)
    "paged_decode_attention": ([_P] * 7 + [_I] * 5 + [_F, _I, _I, _I], _F32 + _BF16 + _F16KV + _F8KV),
    "paged_prefill_attention": ([_P] * 8 + [_I] * 5 + [_F, _I, _I], _F32 + _BF16 + _F16KV + _F8KV),
    "add_rms_norm": ([_P] * 4 + [_I] * 2 + [_F], _F32 + _BF16),
    "rope_write_kv": ([_P] * 8 + [_I] * 5, _F32 + _BF16 + _F16KV + _F8KV),
    "silu_mul": ([_P] * 2 + [_I] * 2, _F32 + _BF16),
    "gelu_tanh_mul": ([_P] * 2 + [_I] * 2, _F32 + _BF16),
    "gemma_norm": ([_P] * 3 + [_I] * 4 + [_F], _F32 + _BF16),
    # bfloat16: a no-op unless built with AVX512-BF16 (`packed_gemm_max_rows[torch.bfloat16]` > 0)
    "packed_gemm": ([_P] * 3 + [_I] * 3, _F32 + _BF16),
    "argmax_rows": ([_P] * 2 + [_I] * 2, _F32 + _BF16),
    "mask_rows": ([_P] * 3 + [_I] * 3, _F32),
    "decode_layers": ([_P, _I] + [_P] * 8 + [_I, _I, _P], _F32 + _BF16 + _F16KV + _F8KV),
    # quantized weights: a pointer to csrc/quant_layout.h's QuantWeight (PackedWeight.struct)
    "quant_gemm": ([_P, _P, _I, _I, _P], _F32 + _BF16),
    "dequantize_rows": ([_P, _P, _I, _P], _F32 + _BF16),
    "quant_amx_gemm": ([_P, _P, _I, _I, _P], _BF16),  # a no-op unless `quant_amx`
    "dequantize_blocked": ([_P, _P], _BF16),  # a no-op unless `dequantize_blocked_bf16`
    # bfloat16: a no-op unless built with AVX512-BF16 (`lora_add_available`)
    "lora_add": ([_P] * 4 + [_I] * 3 + [_P] * 3, _F32 + _BF16),
}
_SUFFIX = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    _F16KV[0]: "f32_f16kv",
    _F8KV[0]: "f32_f8kv",
    _F8KV[1]: "bf16_f8kv",
}
# The KV cache dtypes the kernels take beside each activation dtype (the first: the same dtype).
KV_CACHE_DTYPES = {
    torch.float32: (torch.float32, torch.float16, torch.float8_e4m3fn),
    torch.bfloat16: (torch.bfloat16, torch.float8_e4m3fn),
}


def kernel_key(dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype | tuple[torch.dtype, torch.dtype]:
    """The version of a cache-touching kernel for activations of `dtype` over a `kv_dtype` cache."""
    return dtype if kv_dtype == dtype else (dtype, kv_dtype)


PANEL = 32  # output columns per panel of a weight packed for `packed_gemm`
# (bits, group) pairs the quantized kernels take (csrc/quant_gemm.cpp): Q4_0/Q4_1/Q4_K, Q5_0/Q5_1/
# Q5_K, Q6_K, Q8_0, and 8-bit in groups of 16.
QUANT_LAYOUTS = ((4, 32), (5, 32), (6, 16), (8, 16), (8, 32))
ATTENTION_HEAD_DIMS = (64, 128, 256)  # the head sizes the attention kernels are compiled for


def _head_dim(q: torch.Tensor) -> int:
    """q [tokens, heads, head_dim]'s head_dim, checked against what the kernels take."""
    if q.shape[-1] not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"the C++ attention kernels take head_dim {ATTENTION_HEAD_DIMS}, got {q.shape[-1]}")
    return q.shape[-1]


AMX_BF16_PACKED_MAX_ROWS = 2  # bfloat16 rows packed_gemm takes where oneDNN has AMX (see CpuKernels)

# PAGEDLLM_CPU_CLASS=avx2 or avx512 makes this process behave as on an older CPU class: the
# kernels are built for it (-march below) and `cpu_flags` hides the newer flags, so `dtype=auto`
# and every kernel path choose what they would there.  The test suite runs its CPU-dependent
# tests this way too, so they hold on AVX2-only and AVX-512-without-BF16 CPUs (docs/testing.md).
CPU_CLASSES = {"native": "native", "avx512": "skylake-avx512", "avx2": "haswell"}


# The flags a class's build (-march) uses: a class can only be taken on a CPU that has them, or
# its kernels would stop the process with an illegal instruction.
_CLASS_NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "avx2": ("avx2", "fma", "bmi2"),
}


@functools.cache
def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split()[1:])


def cpu_class() -> str:
    name = os.environ.get("PAGEDLLM_CPU_CLASS", "native")
    if name not in CPU_CLASSES:
        raise ValueError(f"PAGEDLLM_CPU_CLASS must be one of {', '.join(CPU_CLASSES)}, got {name!r}")
    missing = [flag for flag in _CLASS_NEEDS.get(name, ()) if flag not in _proc_cpu_flags()]
    if missing:
        raise ValueError(
            f"PAGEDLLM_CPU_CLASS={name} runs only on a CPU that has that class's instructions; "
            f"this one lacks {' '.join(missing)}"
        )
    return name


def _hidden_by_class(flag: str, name: str) -> bool:
    if name == "avx2":
        return flag.startswith(("avx512", "amx", "avx_vnni", "avx_ne_convert"))
    if name == "avx512":
        return flag.startswith(("avx512_bf16", "avx512_fp16", "amx", "avx_ne_convert"))
    return False


def hidden_cpu_flags() -> list[str]:
    """The flags of this CPU that PAGEDLLM_CPU_CLASS hides: none means the class is this CPU's
    own, so a test run under it takes the paths a plain run takes (`.ci/run` skips it)."""
    name = cpu_class()
    return sorted(flag for flag in _proc_cpu_flags() if _hidden_by_class(flag, name))


def cpu_flags() -> str:
    """This CPU's flags as /proc/cpuinfo lists them, less those PAGEDLLM_CPU_CLASS hides."""
    name = cpu_class()
    return " ".join(sorted(flag for flag in _proc_cpu_flags() if not _hidden_by_class(flag, name)))


def cpu_summary() -> str:
    """The CPU's model name, core count and the SIMD flags that decide the kernels' paths and the
    speed of bfloat16, e.g. 'AMD EPYC, 2 cores, avx2 avx512f avx512_bf16'; benchmarks print it
    beside every figure."""
    flags = set(cpu_flags().split())
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert")
    shown = " ".join(flag for flag in wanted if flag in flags) or "no AVX2"
    return f"{model}, {os.cpu_count()} cores, {shown}"


def _compiler_version() -> str:
    try:
        return subprocess.run([_COMPILER, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def _build_tag(march: str) -> str:
    digest = hashlib.sha256()
    # Only -march=native depends on the CPU; a named class builds the same code on any CPU, so
    # its library is shared (the suite's haswell build serves a later PAGEDLLM_CPU_CLASS=avx2 run).
    flags = cpu_flags() if march == "native" else ""
    for part in (flags, _compiler_version(), " ".join(_build_flags()), march):
        digest.update(part.encode())
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    return digest.hexdigest()[:16]


def build_library(march: str = "native") -> Path:
    """The compiled library for this CPU, building it first when the cache has none.  `march`
    other than native builds for an older instruction set (tests use it to run the plain
    C++ paths on a CPU that would take the AVX-512 ones); so does PAGEDLLM_CPU_CLASS."""
    if march == "native":
        march = CPU_CLASSES[cpu_class()]
    target = cache_dir("kernels", f"libpagedllm_cpu_{_build_tag(march)}.so")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling the C++ CPU kernels for this CPU (once, a few seconds) into %s", target.parent)
    start = time.perf_counter()
    # Built under a temporary name, then renamed: concurrent builds never see a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            _compile_and_link(march, Path(objects), tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("compiled the CPU kernels in %.1f s", time.perf_counter() - start)
    return target


def _run_compiler(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")


def _compile_and_link(march: str, objects: Path, output: str) -> None:
    """Each source compiled on its own, as many at once as there are cores (the build is ~20 s
    of one core), the largest first so that the last to finish is a small one; then linked."""
    flags = [flag for flag in _build_flags() if flag != "-shared"] + [f"-march={march}"]
    sources = sorted(_SOURCES, key=lambda name: (_CSRC / name).stat().st_size, reverse=True)
    commands = [[_COMPILER, *flags, "-c", str(_CSRC / name), "-o", str(objects / f"{name}.o")] for name in sources]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, len(commands)))) as pool:
        for done in [pool.submit(_run_compiler, command) for command in commands]:
            done.result()
    _run_compiler([_COMPILER, *_build_flags(), f"-march={march}", "-o", output, *(c[-1] for c in commands)])


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class CpuKernels:
    """The library's functions, called with tensors (float32 or bfloat16, contiguous, on the CPU)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, (argtypes, dtypes) in _SIGNATURES.items():
            for dtype in dtypes:
                fn = getattr(library, f"{name}_{_SUFFIX[dtype]}")
                fn.argtypes, fn.restype = argtypes, None
                self._fns[name, dtype] = fn
        # Up to how many rows each dtype goes to `packed_gemm` (where it beats oneDNN, measured);
        # 0 for bfloat16 where the build has no AVX512-BF16.
        self.packed_gemm_max_rows: dict[torch.dtype, int] = {}
        for dtype in _F32 + _BF16:
            fn = getattr(library, f"packed_gemm_max_rows_{_SUFFIX[dtype]}")
            fn.restype = ctypes.c_int64
            self.packed_gemm_max_rows[dtype] = fn()
        # oneDNN (and so torch's GEMMs and SDPA) runs bfloat16 math on the AMX tile unit here.
        self.amx_bf16 = "amx_bf16" in cpu_flags().split()
        if self.amx_bf16:
            # With AMX, oneDNN's bfloat16 GEMMs run on the tile unit: measured 1.05x packed_gemm's
            # speed at 4 rows, 2.2x at 16 and 4-6x at 64-512 (`benchmarks/linear_backends.py`,
            # Sapphire Rapids class), while packed_gemm stays ahead at 1-2 rows.
            rows = self.packed_gemm_max_rows[torch.bfloat16]
            self.packed_gemm_max_rows[torch.bfloat16] = min(rows, AMX_BF16_PACKED_MAX_ROWS)
        # The quantized weights' layout in this build (csrc/quant_gemm.cpp): columns per panel,
        # and whether 8-bit values are stored unsigned (VNNI).
        self.quant_panel_width = library.quant_panel_width()
        self.quant_unsigned8 = bool(library.quant_unsigned8())
        # Values per activation step before a K type (Q4_K, Q5_K, Q6_K): 256 with AVX-512, else 32.
        self.quant_k_activation_span = library.quant_k_activation_span()
        # Built with AMX-BF16 and allowed the tiles by the OS: many-row steps on quantized weights
        # take csrc/quant_amx.cpp.
        self.quant_amx = bool(library.quant_amx_available())
        # Built with AMX-BF16 and allowed the tiles (csrc/amx.h): bfloat16 prefill attention runs
        # on them too (csrc/prefill_attention.cpp); the same condition as `quant_amx`.
        self.amx_tiles = self.quant_amx
        # Built with AVX512-BF16: quantized weights can be dequantized into oneDNN's blocked layout.
        self.dequantize_blocked_bf16 = bool(library.dequantize_blocked_available())
        global _first_out_of_range
        _first_out_of_range = library.first_out_of_range
        _first_out_of_range.argtypes, _first_out_of_range.restype = [_P, _I, _I, _I], ctypes.c_int64
        self._pack_values = library.quant_pack_values
        self._pack_values.argtypes, self._pack_values.restype = [_P, _P] + [_I] * 4, None
        self._peak = library.int8_multiply_add_peak
        self._peak.argtypes, self._peak.restype = [_I], ctypes.c_int64
        self._workspace = library.decode_layers_workspace
        self._workspace.argtypes, self._workspace.restype = [_P], ctypes.c_int64
        # The dtypes `lora_add` runs in this build (bfloat16 needs AVX512-BF16, as packed_gemm).
        self.lora_add_available: dict[torch.dtype, bool] = {}
        for dtype in _F32 + _BF16:
            fn = getattr(library, f"lora_add_available_{_SUFFIX[dtype]}")
            fn.restype = ctypes.c_int64
            self.lora_add_available[dtype] = bool(fn())
        # Built with AVX512-BF16: bfloat16 GEMMs and attention take `vdpbf16ps` paths.
        self.native_bf16 = self.packed_gemm_max_rows[torch.bfloat16] > 0

    def _fn(self, name: str, dtype: torch.dtype | tuple[torch.dtype, torch.dtype]):
        fn = self._fns.get((name, dtype))
        if fn is None:
            described = f"{dtype[0]} over a {dtype[1]} KV cache" if isinstance(dtype, tuple) else dtype
            raise TypeError(f"the CPU kernel {name} has no {described} version")
        return fn

    def paged_decode_attention(
        self, q, k_cache, v_cache, out, rows, seq_lens, tables, scale: float, window: int = 0,
        split_requests: int | None = None,
    ) -> None:  # fmt: skip
        """q, out [tokens, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim], head_dim
        in ATTENTION_HEAD_DIMS; per query row its row, context length and block table (int64);
        `window` > 0: a sliding window.  `split_requests`: the request count a row's split into parts
        is planned for (default: one request a row; rows verifying drafts count once a request)."""
        _check(q, k_cache, v_cache, out, rows, seq_lens, tables)
        name = "paged_decode_attention"
        _check_attention(name, q, k_cache, v_cache, out, tables)
        _index(name, "rows", rows, tables.shape[0])
        _index(name, "seq_lens", seq_lens, tables.shape[0])
        check_index_range(name, "rows", rows, 0, q.shape[0])
        check_index_range(name, "seq_lens", seq_lens, 0, tables.shape[1] * k_cache.shape[1] + 1)
        kv_heads = k_cache.shape[2]
        self._fn("paged_decode_attention", kernel_key(q.dtype, k_cache.dtype))(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(rows), _ptr(seq_lens), _ptr(tables),
            rows.shape[0], tables.shape[1], k_cache.shape[1], kv_heads, q.shape[1] // kv_heads, scale, window,
            _head_dim(q), rows.shape[0] if split_requests is None else max(1, int(split_requests)),
        )  # fmt: skip

    def paged_prefill_attention(
        self, q, k_cache, v_cache, out, starts, lens, seq_lens, tables, scale: float, window: int = 0
    ) -> None:
        """As decode, with per prefilling request its first query row and number of new tokens."""
        _check(q, k_cache, v_cache, out, starts, lens, seq_lens, tables)
        name = "paged_prefill_attention"
        _check_attention(name, q, k_cache, v_cache, out, tables)
        for label, t in (("starts", starts), ("lens", lens), ("seq_lens", seq_lens)):
            _index(name, label, t, tables.shape[0])
        check_index_range(name, "seq_lens", seq_lens, 0, tables.shape[1] * k_cache.shape[1] + 1)
        if starts.numel():  # each request's query rows inside q, and no more new tokens than its context
            check_index_range(name, "starts", starts, 0, q.shape[0])
            check_index_range(name, "lens", lens, 0, q.shape[0] + 1)
            _once(
                (starts, lens, seq_lens),
                ("prefill rows", q.shape[0]),
                lambda: _require(
                    name,
                    bool(((starts + lens) <= q.shape[0]).all()) and bool((lens <= seq_lens).all()),
                    "each request's rows starts + lens within q's tokens, and lens <= seq_lens",
                    q=q, starts=starts, lens=lens, seq_lens=seq_lens,
                ),
            )  # fmt: skip
        kv_heads = k_cache.shape[2]
        self._fn("paged_prefill_attention", kernel_key(q.dtype, k_cache.dtype))(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(starts), _ptr(lens), _ptr(seq_lens),
            _ptr(tables), starts.shape[0], tables.shape[1], k_cache.shape[1], kv_heads, q.shape[1] // kv_heads,
            scale, window, _head_dim(q),
        )  # fmt: skip

    def add_rms_norm(
        self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta (in place, when delta is given); returns weight * rms_norm(residual)."""
        _check(residual, weight, *(() if delta is None else (delta,)))
        _require(
            "add_rms_norm",
            residual.dim() == 2
            and weight.shape == residual.shape[1:]
            and weight.dtype == residual.dtype
            and (delta is None or (delta.shape == residual.shape and delta.dtype == residual.dtype)),
            "residual [rows, hidden], weight [hidden] and delta like residual, of one dtype",
            residual=residual, weight=weight, delta=delta,
        )  # fmt: skip
        out = torch.empty_like(residual)
        rows, hidden = residual.shape
        self._fn("add_rms_norm", residual.dtype)(
            None if delta is None else _ptr(delta), _ptr(residual), _ptr(weight), _ptr(out), rows, hidden, eps
        )
        return out

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        rotary_dim: int | None = None,
    ) -> torch.Tensor:
        """Rotary on q and k of the fused QKV rows; k and v written at their cache slots; returns q
        [tokens, num_heads, head_dim].  cos/sin: float32 [rows, rotary_dim / 2], token t reading row
        positions[t]; the first rotary_dim dims of each head rotate (default: all), the rest pass."""
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise KernelArgumentError(
                f"rope_write_kv: kv_cache must be [2, blocks, block_size, kv_heads, head_dim] "
                f"({_describe({'kv_cache': kv_cache})})"
            )
        _, _, _, kv_heads, head_dim = kv_cache.shape
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim or cos.shape[-1] != rotary_dim // 2:
            raise ValueError(f"rotary_dim {rotary_dim} does not fit head_dim {head_dim} and tables {tuple(cos.shape)}")
        _check(qkv, positions, cos, sin, kv_cache, slot_mapping)
        name = "rope_write_kv"
        _require(
            name,
            qkv.dim() == 2
            and qkv.shape[1] == (num_heads + 2 * kv_heads) * head_dim
            and cos.dim() == 2
            and sin.shape == cos.shape
            and cos.dtype == sin.dtype == torch.float32,
            lambda: f"qkv rows of (heads {num_heads} + 2 x kv_heads {kv_heads}) x head_dim {head_dim} values, "
            "cos and sin float32 [positions, rotary_dim / 2]",
            qkv=qkv, cos=cos, sin=sin, kv_cache=kv_cache,
        )  # fmt: skip
        _index(name, "positions", positions, qkv.shape[0])
        _index(name, "slot_mapping", slot_mapping, qkv.shape[0])
        if rotary_dim:  # (no rotary: the tables are never read)
            check_index_range(name, "positions", positions, 0, cos.shape[0])
        check_index_range(name, "slot_mapping", slot_mapping, 0, kv_cache.shape[1] * kv_cache.shape[2])
        q = torch.empty(qkv.shape[0], num_heads, head_dim, dtype=qkv.dtype)
        self._fn("rope_write_kv", kernel_key(qkv.dtype, kv_cache.dtype))(
            _ptr(qkv), _ptr(q), _ptr(kv_cache[0]), _ptr(kv_cache[1]), _ptr(positions), _ptr(slot_mapping),
            _ptr(cos), _ptr(sin), qkv.shape[0], num_heads, kv_heads, head_dim, rotary_dim,
        )  # fmt: skip
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for rows [gate | up]."""
        return self._gated("silu_mul", gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up for rows [gate | up] (Gemma's GeGLU)."""
        return self._gated("gelu_tanh_mul", gate_up)

    def gemma_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, start: int = 0,
        width: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Gemma's RMSNorm (csrc/elementwise.cpp) of columns [start, start + width) of x [rows, cols]
        (default: all), per group of weight.numel() values, weight float32 (1 + w); into `out`
        (x itself for in place; default: a new [rows, width] tensor), which is returned."""
        _check(x, weight)
        _require(
            "gemma_norm",
            x.dim() == 2 and weight.dim() == 1 and start >= 0,
            "x [rows, cols], weight 1-D",
            x=x,
            weight=weight,
        )
        rows, cols = x.shape
        width = cols - start if width is None else width
        dim = weight.numel()
        if weight.dtype != torch.float32 or not dim or width < 0 or width % dim or start + width > cols:
            raise ValueError(f"gemma_norm: columns {start}+{width} of {cols} in groups of {dim} ({weight.dtype})")
        if out is None:
            out = torch.empty(rows, width, dtype=x.dtype)
            target, stride_ok = _ptr(out), width == cols
            if not stride_ok:
                raise ValueError("gemma_norm into a new tensor takes whole rows")
        else:
            if out.data_ptr() != x.data_ptr() or out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError("gemma_norm with `out` runs in place (out must be x)")
            target = _ptr(out) + start * x.element_size()
        source = _ptr(x) + start * x.element_size()
        self._fn("gemma_norm", x.dtype)(source, _ptr(weight), target, rows, width, dim, cols, eps)
        return out

    def _gated(self, name: str, gate_up: torch.Tensor) -> torch.Tensor:
        _check(gate_up)
        _require(
            name, gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "rows [gate | up] of even width", gate_up=gate_up
        )
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self._fn(name, gate_up.dtype)(_ptr(gate_up), _ptr(out), rows, width)
        return out

    @staticmethod
    def pack_panels(weight: torch.Tensor) -> torch.Tensor:
        """A weight [n, k] as `packed_gemm` reads it: [ceil(n / PANEL), k / s, PANEL * s] with s = 1
        for float32 and 2 for bfloat16 (k even): per panel and step of s k values, the PANEL output
        columns side by side, each column's s values together (zero columns past n)."""
        n, k = weight.shape
        step = 2 if weight.dtype == torch.bfloat16 else 1
        if k % step:
            raise ValueError(f"a bfloat16 weight packs only with an even inner size, got {k}")
        if n % PANEL:
            weight = torch.cat([weight, weight.new_zeros(PANEL - n % PANEL, k)])
        packed = weight.reshape(-1, PANEL, k // step, step).permute(0, 2, 1, 3)
        return packed.reshape(-1, k // step, PANEL * step).contiguous()

    def packed_gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x [m, k] @ W^T for x and W [n, k] packed by `pack_panels` (float32, or bfloat16 where the
        build has AVX512-BF16); any m, but faster than oneDNN only up to `packed_gemm_max_rows`
        (see csrc/small_gemm.cpp)."""
        _check(x, packed)
        _require(
            "packed_gemm", x.dim() == 2 and packed.dim() == 3 and n > 0, "x [m, k], a packed weight", x=x, packed=packed
        )
        m, k = x.shape
        step = 2 if x.dtype == torch.bfloat16 else 1
        if not self.packed_gemm_max_rows.get(x.dtype):
            raise RuntimeError(f"packed_gemm has no {x.dtype} version in this build (bfloat16 needs AVX512-BF16)")
        if packed.dtype != x.dtype or packed.shape != (-(-n // PANEL), k // step, PANEL * step) or k % step:
            raise ValueError(
                f"packed {packed.dtype} weight {tuple(packed.shape)} does not hold [{n}, {k}] {x.dtype} "
                f"in panels of {PANEL}"
            )
        y = torch.empty(m, n, dtype=x.dtype)
        self._fn("packed_gemm", x.dtype)(_ptr(x), _ptr(packed), _ptr(y), m, n, k)
        return y

    def lora_add(
        self, x: torch.Tensor, y: torch.Tensor, order: torch.Tensor, adapter_of: torch.Tensor, parts: tuple,
    ) -> None:  # fmt: skip
        """y[row] += B_a (A_a x[row]) in place for row = order[i], a = adapter_of[i]; `parts`: the
        adapters' A, packed B and layout addresses (layers/lora.py's KernelTable entry; each
        adapter was checked against the model's projection sizes when it was loaded) (csrc/lora.cpp)."""
        _check(x, y, order, adapter_of)
        a_ptrs, b_ptrs, descs = parts
        rows = x.shape[0]
        _require(
            "lora_add",
            x.dim() == 2 and y.dim() == 2 and y.shape[0] == rows and y.dtype == x.dtype
            and self.lora_add_available.get(x.dtype, False),
            "x [rows, in], y [rows, out] of x's dtype, float32 or (with AVX512-BF16) bfloat16",
            x=x, y=y,
        )  # fmt: skip
        _index("lora_add", "order", order, None)
        _index("lora_add", "adapter_of", adapter_of, order.shape[0])
        check_index_range("lora_add", "order", order, 0, rows)
        check_index_range("lora_add", "adapter_of", adapter_of, 0, len(descs))
        self._fn("lora_add", x.dtype)(
            _ptr(x), _ptr(y), _ptr(order), _ptr(adapter_of), order.numel(), x.shape[1], y.shape[1],
            ctypes.addressof(a_ptrs), ctypes.addressof(b_ptrs), ctypes.addressof(descs),
        )  # fmt: skip

    def decode_layers_workspace(self, shape: ctypes.Structure) -> int:
        """Workspace elements per row that `decode_layers` needs for this model's shape."""
        return self._workspace(ctypes.addressof(shape))

    def decode_layers(
        self, layers, num_layers: int, shape, residual, out, workspace, final_norm, positions, rows, seq_lens,
        kv_dtype: torch.dtype | None = None, split_requests: int | None = None, lora=None,
    ) -> None:  # fmt: skip
        """Every layer of a decode-only step and the final norm (csrc/decode_layers.cpp); `layers`
        and `shape` are its structs (each layer's rotary, cache slots and block tables among them), built by
        pagedllm/layers/fused_decode.py, which checks what the kernels cannot."""
        _check(residual, out, workspace, final_norm, positions, rows, seq_lens)
        name = "decode_layers"
        m = residual.shape[0] if residual.dim() == 2 else -1
        _require(
            name,
            m >= 0
            and out.shape == residual.shape
            and out.dtype == residual.dtype
            and final_norm.shape == residual.shape[1:]
            and shape.hidden == residual.shape[1]
            and workspace.dtype == residual.dtype
            and workspace.numel() >= m * self.decode_layers_workspace(shape),
            "residual and out [rows, hidden], final_norm [hidden], workspace of the rows' size",
            residual=residual, out=out, final_norm=final_norm, workspace=workspace,
        )  # fmt: skip
        for label, t in (("positions", positions), ("rows", rows), ("seq_lens", seq_lens)):
            _index(name, label, t, m)
        check_index_range(name, "rows", rows, 0, max(m, 1))
        self._fn("decode_layers", kernel_key(residual.dtype, kv_dtype or residual.dtype))(
            ctypes.addressof(layers), num_layers, ctypes.addressof(shape), _ptr(residual), _ptr(out),
            _ptr(workspace), _ptr(final_norm), _ptr(positions), _ptr(rows), _ptr(seq_lens), rows.shape[0],
            rows.shape[0] if split_requests is None else max(1, int(split_requests)),
            None if lora is None else ctypes.addressof(lora),
        )  # fmt: skip

    def quant_gemm(self, x: torch.Tensor, w, out: torch.Tensor, col: int = 0) -> None:
        """out[:, col : col + w.rows] = x [m, k] @ W^T for W a PackedWeight [rows, k]
        (pagedllm/layers/quantized.py; the kernels are csrc/quant_gemm.cpp); x float32 or
        bfloat16, out [m, >= col + rows] of x's dtype."""
        self._quant_gemm("quant_gemm", x, w, out, col)

    def _quant_gemm(self, name: str, x: torch.Tensor, w, out: torch.Tensor, col: int) -> None:
        _check(x, out, *w.tensors())
        _check_packed(name, w, self.quant_panel_width)
        _require(name, x.dim() == 2 and out.dim() == 2 and col >= 0, "x [m, k] and out [m, n]", x=x, out=out)
        m, k = x.shape
        if k != w.cols or out.dtype != x.dtype or out.shape[0] != m or out.shape[1] < col + w.rows:
            raise ValueError(f"quant_gemm: x {tuple(x.shape)}, weight [{w.rows}, {w.cols}], out {tuple(out.shape)}")
        y = _ptr(out) + col * out.element_size()
        self._fn(name, x.dtype)(_ptr(x), y, m, out.shape[1], ctypes.addressof(w.struct))

    def pack_quantized_values(self, qs: torch.Tensor, rows: int, cols: int, bits: int, flip8: bool) -> torch.Tensor:
        """A QuantizedWeight's `qs` [rows, cols / 32 * (16 for 4-bit, else 32)] (uint8) in the
        panel layout of this build, [panels, cols / 32 * panel block bytes], rows past the last
        zero (csrc/quant_pack.cpp); flip8: 8-bit values stored as q + 128."""
        _check(qs)
        per_block = 16 if bits == 4 else 32
        expected = (rows, cols // 32 * per_block)
        if bits not in (4, 5, 6, 8) or cols % 32 or qs.dtype != torch.uint8 or tuple(qs.shape) != expected:
            shape = f"qs {tuple(qs.shape)} {qs.dtype} for [{rows}, {cols}] of {bits} bits"
            raise ValueError(f"pack_quantized_values: {shape}")
        panel = self.quant_panel_width
        out = torch.empty(-(-rows // panel), cols * panel * bits // 8, dtype=torch.uint8)
        self._pack_values(_ptr(qs), _ptr(out), rows, cols, bits, int(flip8))
        return out

    def quant_amx_gemm(self, x: torch.Tensor, w, out: torch.Tensor, col: int = 0) -> None:
        """`quant_gemm` on AMX tiles, for bfloat16 x where `quant_amx` (csrc/quant_amx.cpp)."""
        if not self.quant_amx or x.dtype != torch.bfloat16:
            raise TypeError(f"the AMX quantized GEMM takes bfloat16 on a CPU with AMX-BF16, got {x.dtype}")
        self._quant_gemm("quant_amx_gemm", x, w, out, col)

    def dequantize_blocked(self, w, out: int) -> None:
        """A PackedWeight [rows, cols] (rows a multiple of 32) to bfloat16 in oneDNN's blocked linear
        layout at address `out` (csrc/quant_amx.cpp; where `dequantize_blocked_bf16`)."""
        if not self.dequantize_blocked_bf16 or w.rows % 32:
            raise ValueError(f"dequantize_blocked: [{w.rows}, {w.cols}] on a build without it or rows not of 32")
        _check_packed("dequantize_blocked", w, self.quant_panel_width)
        self._fn("dequantize_blocked", torch.bfloat16)(ctypes.addressof(w.struct), out)

    def dequantize_rows(self, w, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64, each in range) of a PackedWeight into `out` [len(ids), cols] (float32
        or bfloat16); returns out."""
        _check(out, ids, *w.tensors())
        _check_packed("dequantize_rows", w, self.quant_panel_width)
        _index("dequantize_rows", "ids", ids, None)
        if tuple(out.shape) != (ids.shape[0], w.cols) or out.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequantize_rows: out {tuple(out.shape)} for {ids.shape[0]} rows of {w.cols}")
        check_index_range("dequantize_rows", "ids", ids, 0, w.rows)
        self._dequantize(w, _ptr(ids), ids.shape[0], _ptr(out), out.dtype)
        return out

    def dequantize_transposed(self, w, out: torch.Tensor, col: int = 0) -> None:
        """out[:, col : col + w.rows] = W^T for a PackedWeight W [rows, cols]; out [cols, >= col + rows]."""
        _check(out, *w.tensors())
        _check_packed("dequantize_transposed", w, self.quant_panel_width)
        if out.dim() != 2 or col < 0 or out.shape[0] != w.cols or out.shape[1] < col + w.rows:
            raise ValueError(f"dequantize_transposed: out {tuple(out.shape)} for [{w.rows}, {w.cols}] at {col}")
        self._dequantize(w, None, out.shape[1], _ptr(out) + col * out.element_size(), out.dtype)

    def _dequantize(self, w, ids: int | None, count: int, out: int, dtype: torch.dtype) -> None:
        self._fn("dequantize_rows", dtype)(ctypes.addressof(w.struct), ids, count, out)

    def int8_multiply_add_peak(self, iterations: int = 2_000_000, repeats: int = 5) -> float:
        """Integer multiply-adds a second that the quantized kernels' instruction reaches on every
        thread at once with its operands in registers (csrc/quant_gemm.cpp): the machine's peak
        against which a compute-bound step is read.  The median of `repeats` timed calls; 0.0 where
        the build has no AVX2."""
        self._peak(iterations // 10)  # wakes the threads and raises the clock first
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            done = self._peak(iterations)
            rates.append(done / (time.perf_counter() - start))
        return sorted(rates)[len(rates) // 2]

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) for float32 or bfloat16 x [rows, cols] (cols >= 1): the first index
        of each row's largest value, a NaN counting as the largest (csrc/sampling.cpp)."""
        _check(x)
        if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"argmax_rows takes float32 or bfloat16 [rows, cols >= 1], got {x.dtype} {tuple(x.shape)}")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._fn("argmax_rows", x.dtype)(_ptr(x), _ptr(out), x.shape[0], x.shape[1])
        return out

    def mask_rows(self, x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """In place: row rows[j] of float32 x [*, cols] gets -inf where bitmask [len(rows), words] int32
        has a 0 bit for the token, and past 32 * words (csrc/sampling.cpp)."""
        _check(x, bitmask)
        if x.dtype != torch.float32 or x.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
            raise ValueError(f"mask_rows takes float32 x and int32 bitmask, got {x.dtype} and {bitmask.dtype}")
        if bitmask.shape[0] != len(rows) or any(not 0 <= r < x.shape[0] for r in rows):
            raise ValueError(f"mask_rows: {len(rows)} rows for a bitmask of {bitmask.shape[0]} and x of {x.shape[0]}")
        index = torch.tensor(rows, dtype=torch.int64)
        self._fn("mask_rows", torch.float32)(
            _ptr(x), _ptr(bitmask), _ptr(index), len(rows), x.shape[1], bitmask.shape[1]
        )


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_cpu or not t.is_contiguous():  # is_cpu: 4x cheaper than comparing t.device
            raise ValueError("the CPU kernels need contiguous CPU tensors")


# --- the C++ boundary ---------------------------------------------------------------------
#
# Every kernel entry checks what it is given against each other (shapes, dtypes, lengths) and
# the index tensors' values against what they index, so that no caller, however wrong, makes a
# kernel read or write outside its tensors: a wrong call is a KernelArgumentError naming the
# kernel and the shapes.  Shape checks are a few comparisons a call; an index tensor's range is
# checked once while it lives unchanged (every layer of a step shares the step's tables).


class KernelArgumentError(ValueError):
    """A C++ kernel called with tensors that disagree: the call is refused before the kernel runs."""


def _describe(tensors: dict[str, torch.Tensor | None]) -> str:
    def one(t: torch.Tensor | None) -> str:
        return "None" if t is None else f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"

    return ", ".join(f"{name} {one(t)}" for name, t in tensors.items())


def _require(kernel: str, ok: bool, what: str | Callable[[], str], **tensors: torch.Tensor | None) -> None:
    """`what`: the rule the call broke (a function, where building the text costs)."""
    if not ok:
        raise KernelArgumentError(f"{kernel}: {what if isinstance(what, str) else what()} ({_describe(tensors)})")


def _index(kernel: str, name: str, t: torch.Tensor, length: int | None, dims: int = 1) -> None:
    """An int64 index tensor of `dims` dimensions (and `length` rows where given)."""
    if t.dtype != torch.int64 or t.dim() != dims or (length is not None and t.shape[0] != length):
        rows = "" if length is None else f" of {length} rows"
        raise KernelArgumentError(
            f"{kernel}: {name} must be int64 with {dims} dimension(s){rows} ({_describe({name: t})})"
        )


_CHECKED: dict[tuple, tuple] = {}  # (ids, what) -> (weak references, versions) of tensors found right
_first_out_of_range = None  # csrc/elementwise.cpp's, once the library is loaded


def _once(tensors: tuple[torch.Tensor, ...], what: tuple, check: Callable[[], None]) -> None:
    """Run `check` on these tensors unless it passed on the very same tensors, unchanged since (their
    version counters), before: every layer of a step hands the kernels the step's tables."""
    versioned = not any(t.is_inference() for t in tensors)
    if versioned:
        key = (*map(id, tensors), *what)
        seen = _CHECKED.get(key)
        if (
            seen is not None
            and all(ref() is t for ref, t in zip(seen[0], tensors))
            and seen[1] == tuple(t._version for t in tensors)
        ):
            return
    check()
    if versioned:
        if len(_CHECKED) > 1024:
            _CHECKED.clear()
        _CHECKED[key] = (tuple(weakref.ref(t) for t in tensors), tuple(t._version for t in tensors))


def check_index_range(kernel: str, name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every value of the int64 tensor `t` in [low, high), checked once while `t` lives unchanged
    (an inference tensor, which keeps no version, at every call), in C++ where it can."""

    def check() -> None:
        if not t.numel():
            return
        if _first_out_of_range is not None and t.dtype == torch.int64 and t.is_contiguous() and t.is_cpu:
            bad = _first_out_of_range(t.data_ptr(), t.numel(), low, high)
        else:
            bad = -1 if bool(((t >= low) & (t < high)).all()) else 0
        if bad >= 0:
            least, most = torch.aminmax(t)
            raise KernelArgumentError(
                f"{kernel}: {name} holds values in [{int(least)}, {int(most)}], outside [{low}, {high})"
            )

    _once((t,), ("range", low, high), check)


_PACKED_CHECKED: dict[int, weakref.ref] = {}  # id -> a PackedWeight found consistent (weights do not change)


def _check_packed(kernel: str, w, panel: int) -> None:
    """A PackedWeight's tensors hold exactly what its rows, cols, bits and groups say (once a weight)."""
    seen = _PACKED_CHECKED.get(id(w))
    if seen is not None and seen() is w:
        return
    panels = -(-w.rows // panel) if panel else 0
    expected_qs = (panels, w.cols * panel * w.bits // 8)
    groups = w.cols // w.group if (w.bits, w.group) in QUANT_LAYOUTS else -1
    per_super = w.super_group // w.group if w.super_group > 0 and w.super_group % w.group == 0 else 0
    supers = w.cols // w.super_group if per_super and not per_super & (per_super - 1) else -1  # a power of two
    two_level = w.super_group != w.group

    def holds(t, dtype, per_row: int) -> bool:
        return t.dtype == dtype and tuple(t.shape) == (panels, per_row, panel) and t.is_contiguous()

    ok = (
        w.rows > 0
        and w.cols > 0
        and w.cols % 32 == 0
        and groups > 0
        and supers > 0
        and w.cols % w.super_group == 0
        and w.qs.dtype == torch.uint8
        and tuple(w.qs.shape) == expected_qs
        and holds(w.scales, torch.float16, supers)
        and (w.mins is None or holds(w.mins, torch.float16, supers))
        and (w.sub_scales is not None) == two_level
        and (w.sub_scales is None or holds(w.sub_scales, torch.int8, groups))
        and (w.sub_mins is None or (w.mins is not None and two_level and holds(w.sub_mins, torch.int8, groups)))
        and (w.mins is None or not two_level or w.sub_mins is not None)
    )
    _require(
        kernel, ok, f"a packed weight [{w.rows}, {w.cols}] of {w.bits} bits in groups of {w.group}, panels of {panel}",
        qs=w.qs, scales=w.scales, sub_scales=w.sub_scales, mins=w.mins, sub_mins=w.sub_mins,
    )  # fmt: skip
    if len(_PACKED_CHECKED) > 4096:
        _PACKED_CHECKED.clear()
    _PACKED_CHECKED[id(w)] = weakref.ref(w)


def _check_attention(kernel: str, q, k_cache, v_cache, out, tables) -> None:
    _require(
        kernel,
        q.dim() == 3
        and out.shape == q.shape
        and out.dtype == q.dtype
        and k_cache.dim() == 4
        and v_cache.shape == k_cache.shape
        and v_cache.dtype == k_cache.dtype
        and k_cache.shape[3] == q.shape[2]
        and k_cache.shape[2] > 0
        and q.shape[1] % k_cache.shape[2] == 0,
        "q and out [tokens, heads, head_dim], caches [blocks, block_size, kv_heads, head_dim] of one head_dim, "
        "heads a multiple of kv_heads",
        q=q, k_cache=k_cache, v_cache=v_cache, out=out,
    )  # fmt: skip
    _index(kernel, "block tables", tables, None, dims=2)
    check_index_range(kernel, "block tables", tables, 0, k_cache.shape[0])


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None when they cannot be built here."""
    try:
        return CpuKernels(ctypes.CDLL(str(build_library())))
    except Exception as error:  # any build or load problem: compiler, headers, a foreign library
        logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch paths", error)
        return None
