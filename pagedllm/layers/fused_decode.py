"""A decode-only step's layers in one C++ call (csrc/decode_layers.cpp).

The Python layer loop makes ~9 kernel calls a layer; between them one core runs Python
while the other waits.  For SmolLM2 (30 layers) on a 2-core Zen 4 in bfloat16 one call
takes 0.71x the time of the loop for one request, 0.85-0.92x for 8-128 requests
(`python benchmarks/fused_decode.py`, docs/performance.md).  `FusedDecode` runs the
same kernels in the same order from C++, so its output is bit-identical to the loop's; it
takes only the steps it can run exactly as the loop would:

- every request decodes one token (no prompt chunk in the step), at most `max_rows` of them:
  the rows up to which every projection goes to `packed_gemm` (csrc/small_gemm.cpp), or for
  weights kept quantized (a GGUF's, weights=native) to `quant_gemm` (csrc/quant_gemm.cpp) and,
  in bfloat16 on a CPU with AMX, past its rows to the AMX tile kernel (csrc/quant_amx.cpp, up
  to `quantized.TILE_MAX_ROWS`, 224).  On a 2-core AMX Xeon that took SmolLM2's 24- and 40-row
  steps from 34-35 and 49-50 ms to 31 and 41-45, and 96-160-row steps about 3% faster
  (benchmarks/step_profile.py; docs/performance.md);
- plain llama layers (no biases, no q/k norm) or Gemma 3's, the C++ attention and
  elementwise kernels, no tensor parallelism (pagedllm/execution/fused_step.py checks those,
  from what the model declares).  With layer groups
  (core/layer_groups.py: Gemma 3's sliding layers free their old blocks) each layer reads its
  group's block tables; every group must decode the same requests.

Anything else runs through the loop.  `PAGEDLLM_FUSED_DECODE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass

import torch

from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.cpu_kernels import KV_CACHE_DTYPES, CpuKernels, check_index_range
from pagedllm.layers.linear import Linear
from pagedllm.layers.lora import KernelTable, LoraStep
from pagedllm.layers.quantized import QuantizedLinear, QuantWeightStruct

MAX_PARTS = 4  # csrc/decode_layers.cpp's kMaxParts


class _Projection(ctypes.Structure):  # csrc/decode_layers.cpp's Projection
    _fields_ = [("packed", ctypes.c_void_p), ("num_parts", ctypes.c_int64), ("parts", QuantWeightStruct * MAX_PARTS)]


class _Layer(ctypes.Structure):  # csrc/decode_layers.cpp's DecodeLayer
    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("pre_ffn_norm", "post_ffn_norm", "q_norm", "k_norm")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("k_cache", "v_cache", "cos", "sin", "slots", "tables")]
    _fields_ += [(name, ctypes.c_int64) for name in ("max_blocks", "window", "rotary_dim")]


class _LoraPart(ctypes.Structure):  # csrc/decode_layers.cpp's LoraPart
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("descs", ctypes.c_void_p)]


class _LoraRows(ctypes.Structure):  # csrc/decode_layers.cpp's LoraRows
    _fields_ = [(name, ctypes.c_void_p) for name in ("parts", "order", "adapter_of")] + [("count", ctypes.c_int64)]


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # LoraPart's order per layer
MAX_LORA_TABLES = 4  # stacked adapter sets whose tables are kept (as LoraAdapters keeps the stacks)


def fusable(linear: Linear | QuantizedLinear) -> bool:
    """Whether the fused step can run this projection: packed for packed_gemm, or quantized in
    at most MAX_PARTS parts."""
    if isinstance(linear, QuantizedLinear):
        return len(linear.parts) <= MAX_PARTS
    return linear.small_weight is not None


def _projection(linear: Linear | QuantizedLinear) -> _Projection:
    p = _Projection()
    if isinstance(linear, QuantizedLinear):
        p.packed, p.num_parts = None, len(linear.parts)
        for i, w in enumerate(linear.parts):
            p.parts[i] = w.struct
    else:
        p.packed, p.num_parts = linear.small_weight.data_ptr(), 0
    return p


def _max_rows(linear: Linear | QuantizedLinear, tile: bool) -> int:
    """The rows up to which the fused step runs this projection as the layer loop would: the
    small-batch kernel's or the integer kernels' limit, or with `tile` the AMX tile kernel's."""
    if not isinstance(linear, QuantizedLinear):
        return linear.small_max_rows
    return max(linear.max_rows, linear.tile_max_rows) if tile else linear.max_rows


def _tile_applies(linears: list[Linear | QuantizedLinear], dtype: torch.dtype, kernels: CpuKernels) -> bool:
    """Whether steps past the integer kernels' rows can take the AMX tile kernel in the fused step:
    bfloat16 where the kernels have it, every projection quantized with one integer-kernel limit."""
    quantized = [lin for lin in linears if isinstance(lin, QuantizedLinear)]
    return (
        dtype == torch.bfloat16
        and kernels.quant_amx
        and len(quantized) == len(linears)
        and len({lin.max_rows for lin in quantized}) == 1
    )


class _Shape(ctypes.Structure):  # csrc/decode_layers.cpp's DecodeShape
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "block")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("gemma", ctypes.c_int64)]
    _fields_ += [("q_scale", ctypes.c_float), ("quant_int_max_rows", ctypes.c_int64)]


@dataclass(frozen=True)
class FusedLayer:
    """One layer's weights as the fused step reads them: a llama layer's, or with the four
    Gemma norms (float32 1 + w, as input_norm and post_norm are then) a Gemma 3 layer's."""

    input_norm: torch.Tensor
    qkv_proj: Linear | QuantizedLinear
    o_proj: Linear | QuantizedLinear
    post_norm: torch.Tensor
    gate_up_proj: Linear | QuantizedLinear
    down_proj: Linear | QuantizedLinear
    window: int
    rotary_dim: int  # dims of each head that rotate (0: none)
    cos: torch.Tensor  # float32 [positions, rotary_dim / 2], rows read at each token's position
    sin: torch.Tensor
    pre_ffn_norm: torch.Tensor | None = None  # Gemma 3 only, as the three below
    post_ffn_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    @property
    def gemma(self) -> bool:
        return self.pre_ffn_norm is not None


def fused_decode_enabled() -> bool:
    return os.environ.get("PAGEDLLM_FUSED_DECODE", "1") != "0"


class FusedDecode:
    """All layers and the final norm of a decode-only step, for one model and its KV caches."""

    def __init__(
        self,
        kernels: CpuKernels,
        layers: list[FusedLayer],
        final_norm: torch.Tensor,
        *,
        dtype: torch.dtype,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        q_scale: float = 1.0,
    ) -> None:
        """`q_scale`: Gemma 3's factor on q before attention (the kernels scale by head_dim ** -0.5)."""
        linears = [
            lin for layer in layers for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        if not layers or not all(fusable(lin) for lin in linears):
            raise ValueError("the fused decode step needs every projection packed for packed_gemm, or quantized")
        gemma = layers[0].gemma
        if any(layer.gemma != gemma for layer in layers) or (q_scale != 1.0 and not gemma):
            raise ValueError("the fused decode step runs llama layers or Gemma 3 layers, not both")
        self.kernels, self.layers, self.final_norm = kernels, layers, final_norm
        self.dtype = dtype
        tile = _tile_applies(linears, dtype, kernels)
        self.max_rows = min(_max_rows(lin, tile) for lin in linears)
        quant_int_max_rows = linears[0].max_rows if tile else 0
        # The projections' descriptors, kept alive here: the layer table points at them.
        self._projections = [
            [_projection(lin) for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
            for layer in layers
        ]
        hidden, inter = final_norm.shape[0], layers[0].gate_up_proj.out_features // 2
        scale = 1.0 / math.sqrt(head_dim)
        self._shape = _Shape(
            hidden, heads, kv_heads, head_dim, inter, 0, eps, scale, int(gemma), q_scale, quant_int_max_rows
        )
        self._row = kernels.decode_layers_workspace(self._shape)
        self._bound: tuple[int, ...] = ()  # the data pointers of the KV caches `_table` names
        self.kv_dtype = self.dtype  # the bound caches' dtype
        self._table = (_Layer * len(layers))()
        # Rows of the rotary tables a position may index (a layer without rotary reads none).
        self._positions = min((layer.cos.shape[0] for layer in layers if layer.rotary_dim), default=2**62)
        # Per stacked adapter set (keyed by its adapters' keys): its LoraPart table, and the stack it points into.
        self._lora_tables: dict[tuple[str, ...], tuple[ctypes.Array, KernelTable]] = {}

    def applies(self, meta: AttentionMetadata | list[AttentionMetadata], num_tokens: int) -> bool:
        """True for a step this path runs exactly as the layer loop would (`meta`: one for every
        layer, or one per layer: each layer group's, which must all decode the same rows)."""
        metas = meta if isinstance(meta, list) else [meta]
        if len(metas) not in (1, len(self.layers)):
            return False
        first = metas[0]
        if first.prefill_indices or len(first.decode_indices) != num_tokens or not 0 < num_tokens <= self.max_rows:
            return False
        return all(m is first or (not m.prefill_indices and m.decode_indices == first.decode_indices) for m in metas)

    def _bind(self, kv_caches: list[torch.Tensor]) -> None:
        key = tuple(cache.data_ptr() for cache in kv_caches)
        if key == self._bound:
            return
        kv_dtype = kv_caches[0].dtype if kv_caches else self.dtype
        if (
            len(kv_caches) != len(self.layers)
            or kv_dtype not in KV_CACHE_DTYPES[self.dtype]
            or any(c.dtype != kv_dtype or not c.is_contiguous() for c in kv_caches)
        ):
            raise ValueError(
                f"the fused decode step needs {len(self.layers)} contiguous KV caches of one of "
                f"{KV_CACHE_DTYPES[self.dtype]} beside {self.dtype}"
            )
        self.kv_dtype = kv_dtype
        for entry, layer, projections, cache in zip(self._table, self.layers, self._projections, kv_caches):
            entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            qkv, o, gate_up, down = (ctypes.addressof(p) for p in projections)
            entry.qkv, entry.o, entry.gate_up, entry.down = qkv, o, gate_up, down
            if layer.gemma:
                entry.pre_ffn_norm, entry.post_ffn_norm = layer.pre_ffn_norm.data_ptr(), layer.post_ffn_norm.data_ptr()
                entry.q_norm, entry.k_norm = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
            entry.k_cache, entry.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
            entry.cos, entry.sin = layer.cos.data_ptr(), layer.sin.data_ptr()
            entry.window, entry.rotary_dim = layer.window, layer.rotary_dim
        self._shape.block = kv_caches[0].shape[2]
        self._bound = key

    def _lora_rows(self, lora: LoraStep, rows: int) -> _LoraRows:
        """The step's adapters as decode_layers takes them (a LoraStep of the C++ kernel's kind)."""
        batched = lora.batched
        table = batched.table
        entry = self._lora_tables.get(table.keys)
        if entry is None or entry[1] is not table:
            parts = (_LoraPart * (4 * len(self.layers)))()
            for layer_index, layer in enumerate(table.layers):
                for which, name in enumerate(PROJECTIONS):
                    if name in layer:
                        a_ptrs, b_ptrs, descs = layer[name]
                        parts[layer_index * 4 + which] = _LoraPart(
                            ctypes.addressof(a_ptrs), ctypes.addressof(b_ptrs), ctypes.addressof(descs)
                        )
            if len(self._lora_tables) >= MAX_LORA_TABLES:
                del self._lora_tables[next(iter(self._lora_tables))]
            entry = self._lora_tables[table.keys] = (parts, table)
        check_index_range("decode_layers", "adapter rows", batched.gather, 0, rows)
        check_index_range("decode_layers", "adapters", batched.adapter_of, 0, len(table.keys))
        return _LoraRows(
            ctypes.addressof(entry[0]), batched.gather.data_ptr(), batched.adapter_of.data_ptr(), batched.gather.numel()
        )

    def __call__(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """residual [rows, hidden], the embedded tokens (added to in place) -> the final norm's output,
        for a step `applies` took; `lora`: the step's adapters, of the C++ kernel's kind."""
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        self._bind(kv_caches)
        rows, seq_lens, _ = metas[0].decode_tensors()
        m = residual.shape[0]
        # Each layer's cache slots and block tables (its group's), looked up once a group; `held`
        # keeps them alive until the call returns.
        held, pointers = [], {}
        for entry, layer_meta in zip(self._table, metas):
            found = pointers.get(id(layer_meta))
            if found is None:
                table, slots = layer_meta.decode_tensors()[2], layer_meta.slot_mapping
                if table.dtype != torch.int64 or not table.is_contiguous() or table.shape[0] != rows.shape[0]:
                    raise ValueError(f"block tables {tuple(table.shape)} {table.dtype} for {rows.shape[0]} requests")
                if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != m:
                    raise ValueError(f"slot mapping {tuple(slots.shape)} {slots.dtype} for {m} rows")
                # The kernel reads and writes the caches where these point: every entry inside them.
                blocks, block_size = kv_caches[0].shape[1], kv_caches[0].shape[2]
                check_index_range("decode_layers", "block tables", table, 0, blocks)
                check_index_range("decode_layers", "slot mapping", slots, 0, blocks * block_size)
                check_index_range("decode_layers", "seq_lens", seq_lens, 0, table.shape[1] * block_size + 1)
                held.append((table, slots))
                found = pointers[id(layer_meta)] = (slots.data_ptr(), table.data_ptr(), table.shape[1])
            entry.slots, entry.tables, entry.max_blocks = found
        check_index_range("decode_layers", "positions", positions, 0, self._positions)
        out = torch.empty_like(residual)
        workspace = torch.empty(m * self._row, dtype=self.dtype)
        lora_rows = None if lora is None else self._lora_rows(lora, m)
        self.kernels.decode_layers(
            self._table, len(self.layers), self._shape, residual, out, workspace, self.final_norm,
            positions, rows, seq_lens, self.kv_dtype, metas[0].decode_split_requests, lora_rows,
        )  # fmt: skip
        return out
