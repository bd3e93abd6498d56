"""Rotary position embeddings: the frequency of each rotated pair of dims, and the cos/sin
tables the kernels read, for every RoPE variant a checkpoint names.

Variants (`RopeScaling.rope_type`), each computed once into the tables:

- `default`: frequency i is theta ** (-2i / d);
- `linear`: every frequency divided by `factor`;
- `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between;
- `yarn`: interpolated and extrapolated frequencies blended by a ramp over the dims, and
  cos/sin scaled by an attention factor;
- `freq_factors`: each frequency divided by its own factor (a GGUF's `rope_freqs` tensor,
  how llama.cpp stores Llama 3's scaling);
- `longrope`: per-dim short or long factors, cos/sin scaled by an attention factor;
- `dynamic`: NTK scaling whose base grows with the sequence length past the model's length.

`d` is the rotary dimension: head_dim, or a part of it (`partial_rotary_factor`), where
the dims past it pass through unrotated; 0 turns rotary off for a layer (SmolLM3's NoPE
layers).

`longrope` and `dynamic` depend on the sequence length, as transformers computes them: a
token at position p of a request whose prompt has L tokens uses the frequencies for length
max(p + 1, L) (the whole prompt's length while it is prefilled, then one more per decoded
token).  Their tables are built per step (`RotaryStep`), and a request's KV depends on its
prompt length past the threshold, so `cache_salt` keeps such requests' prefix-cache keys
apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE variant and its parameters (transformers' `rope_parameters` names)."""

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    attention_factor: float | None = None  # yarn, longrope: scales cos and sin
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    freq_factors: tuple[float, ...] = ()  # freq_factors

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.rope_type in ("linear", "dynamic", "llama3") and not self.factor:
            raise ValueError(f"rope type {self.rope_type!r} needs a scaling factor")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("rope type 'longrope' needs short_factor and long_factor")
        if self.rope_type == "freq_factors" and not self.freq_factors:
            raise ValueError("rope type 'freq_factors' needs one factor per rotated pair")

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _check_width(factors: tuple[float, ...], dim: int, what: str) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ValueError(f"{what} has {len(factors)} values, but a rotary dimension of {dim} needs {dim // 2}")
    return torch.tensor(factors, dtype=torch.float32)


def inverse_frequencies(
    scaling: RopeScaling, theta: float, dim: int, max_position_embeddings: int, long: bool = False
) -> tuple[torch.Tensor, float]:
    """(frequency of each rotated pair [dim / 2] in float32, factor on cos and sin) for a
    length-independent variant, or `longrope`'s short (`long` False) or long set."""
    s = scaling
    original = s.original_max_position_embeddings or max_position_embeddings
    base = 1.0 / (theta ** _exponents(dim))
    if s.rope_type in ("default", "dynamic"):  # dynamic at lengths within the model's: the default
        return base, 1.0
    if s.rope_type == "linear":
        return base / s.factor, 1.0
    if s.rope_type == "freq_factors":
        return base / _check_width(s.freq_factors, dim, "rope_freqs"), 1.0
    if s.rope_type == "llama3":
        # Wavelengths above original / low_freq_factor are scaled down by `factor`, those below
        # original / high_freq_factor kept, and those between blended by where they fall.
        wavelength = 2 * math.pi / base
        scaled = torch.where(wavelength > original / s.low_freq_factor, base / s.factor, base)
        blend = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - blend) * scaled / s.factor + blend * scaled
        middle = (wavelength >= original / s.high_freq_factor) & (wavelength <= original / s.low_freq_factor)
        return torch.where(middle, blended, scaled), 1.0
    factor = s.factor or max_position_embeddings / original
    if s.rope_type == "longrope":
        factors = _check_width(
            s.long_factor if long else s.short_factor, dim, "long_factor" if long else "short_factor"
        )
        attention = s.attention_factor
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return 1.0 / (factors * theta ** _exponents(dim)), attention
    # yarn: dims that turn fewer than beta_slow times over the original length are interpolated
    # (divided by factor), those turning more than beta_fast times kept, a linear ramp between.
    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor, 1.0)

    def dim_of(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep, float(attention)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def dynamic_frequencies(theta: float, dim: int, factor: float, max_position_embeddings: int, lengths: torch.Tensor):
    """NTK-scaled frequencies [len(lengths), dim / 2] for sequence lengths past the model's,
    computed in float32 as transformers computes them."""
    lengths = lengths.to(torch.float32)
    bases = theta * ((factor * lengths / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (bases[:, None] ** _exponents(dim)[None, :])


@dataclass(frozen=True)
class RotaryStep:
    """What one step's rotary reads: row `index[t]` of the tables for token t.  `rotary_dim`
    dims of each head rotate (by halves), the rest pass through; 0 means no rotary at all."""

    cos32: torch.Tensor  # [rows, rotary_dim / 2] float32
    sin32: torch.Tensor
    index: torch.Tensor  # [tokens] int64
    rotary_dim: int
    dtype: torch.dtype

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated (the torch path; Hugging Face's order and rounding:
        cos/sin cast to x's dtype)."""
        if self.rotary_dim == 0:
            return x
        cos = self.cos32[self.index].to(x.dtype).unsqueeze(1)
        sin = self.sin32[self.index].to(x.dtype).unsqueeze(1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class Rotary:
    """cos/sin tables for every position up to `max_len` (float32), built once; `for_step`
    gives one step's view of them."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_len: int,
        dtype: torch.dtype,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        self.scaling = scaling = scaling or RopeScaling()
        self.rotary_dim = dim = head_dim if rotary_dim is None else rotary_dim
        if dim % 2 or not 0 <= dim <= head_dim:
            raise ValueError(f"rotary dimension {dim} must be even and within head_dim {head_dim}")
        self.theta, self.dtype, self.max_len = theta, dtype, max_len
        self.max_position_embeddings = max_position_embeddings or max_len
        self.length_dependent = dim > 0 and scaling.length_dependent
        self.cos32, self.sin32 = self._tables(inverse_frequencies(scaling, theta, dim, self.max_position_embeddings))
        if dim and scaling.rope_type == "longrope":  # rows max_len.. hold the long factors' table
            long_cos, long_sin = self._tables(
                inverse_frequencies(scaling, theta, dim, self.max_position_embeddings, True)
            )
            self.cos32, self.sin32 = torch.cat([self.cos32, long_cos]), torch.cat([self.sin32, long_sin])

    def _tables(self, freqs: tuple[torch.Tensor, float]) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, attention = freqs
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float32), inv_freq)
        return (angles.cos() * attention).contiguous(), (angles.sin() * attention).contiguous()

    @property
    def threshold(self) -> int:
        """Past this sequence length a length-dependent variant changes its frequencies."""
        s = self.scaling
        if s.rope_type == "longrope":
            return s.original_max_position_embeddings or self.max_position_embeddings
        return self.max_position_embeddings

    def cache_salt(self, num_prompt_tokens: int) -> bytes:
        """What besides the tokens makes a request's KV differ: the prompt length, for a
        length-dependent variant past its threshold (b"" otherwise)."""
        if not self.length_dependent or num_prompt_tokens <= self.threshold:
            return b""
        if self.scaling.rope_type == "longrope":
            return b"rope:long"
        return f"rope:{num_prompt_tokens}".encode()

    def for_step(self, positions: torch.Tensor, rope_lengths: torch.Tensor | None = None) -> RotaryStep:
        """The tables and row index for a step's tokens; `rope_lengths` (per token: the
        length its frequencies are for, max(p + 1, prompt length)) matters only where the
        variant is length-dependent, and must be given there."""
        if not self.length_dependent:
            return RotaryStep(self.cos32, self.sin32, positions, self.rotary_dim, self.dtype)
        if rope_lengths is None:
            raise ValueError(f"rope type {self.scaling.rope_type!r} needs each token's sequence length")
        long = rope_lengths > self.threshold
        if self.scaling.rope_type == "longrope":
            return RotaryStep(self.cos32, self.sin32, positions + long * self.max_len, self.rotary_dim, self.dtype)
        # dynamic: tokens past the threshold get rows of their own, computed for their length.
        cos, sin = self.cos32[positions], self.sin32[positions]
        if bool(long.any()):
            lengths, which = torch.unique(rope_lengths[long], return_inverse=True)
            inv_freq = dynamic_frequencies(
                self.theta, self.rotary_dim, self.scaling.factor, self.max_position_embeddings, lengths.cpu()
            ).to(cos.device)
            angles = positions[long].float()[:, None] * inv_freq[which]
            cos[long], sin[long] = angles.cos(), angles.sin()
        index = torch.arange(positions.numel(), device=positions.device)
        return RotaryStep(cos.contiguous(), sin.contiguous(), index, self.rotary_dim, self.dtype)
