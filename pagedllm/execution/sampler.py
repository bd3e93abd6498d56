"""Vectorized sampling for one step's batch of logits.

Random draws invert the cumulative distribution: one uniform number per row,
found in the row's running sum of probabilities.  That costs one random number
per row instead of one per vocabulary entry (the exponential race it replaced
spent ~140 ms per step drawing 128 x 49,152 exponentials).

On CUDA every tensor of a step stays on the GPU; the one wait is `tolist()` of
the sampled ids (and the logprobs' values, for rows that ask).

A request with a seed draws the number for its output token i from `token_seed(seed, i)`
alone.  Its tokens then depend on nothing but its seed and its logits: not on the batch, and
not on how many tokens a step gives it, so speculative decoding (core/speculation.py) draws
exactly the tokens that decoding one at a time draws.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.execution.logits_processors import TokenHistory, process_logits
from pagedllm.layers.cpu_kernels import CpuKernels

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The seed of output token `index` of a request seeded with `seed`: splitmix64's finalizer over
    the two, so neighbouring seeds and indices give unrelated streams; in [0, 2**63) as torch wants."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def argmax_only(params: list[SamplingParams]) -> bool:
    """Whether every row only takes its argmax of the raw logits: greedy, no logprobs, no
    penalties or bias (a grammar the caller checks apart).  Such rows read the model's dtype."""
    return all(p.greedy and p.logprobs is None and not p.processes_logits for p in params)


@dataclass
class SamplerOutput:
    # Per row: the sampled id, always in [0, vocab); None where the row allows no token at all.
    token_ids: list[int | None]
    # Per row: (logprob of the sampled token, top alternatives) when asked for, else None.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu", kernels: CpuKernels | None = None) -> None:
        """`kernels`: the C++ CPU kernels, whose argmax replaces torch's where it can (6-7x faster
        on 128 x 49,152 float32 logits, the same indices; it also reads bfloat16 logits)."""
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._seeded = torch.Generator(self.device)  # re-seeded for each seeded row's draw
        self.kernels = kernels

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int | None],
        histories: list[TokenHistory] | None = None,
        constrain: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """logits [batch, vocab] float32 (or the model's dtype, widened here unless every row only takes
        its argmax); one params and optional seed (`token_seed`'s) per row, and each row's
        token history where any row has penalties, bias or min_tokens (logits_processors.py).
        `constrain` masks the rows' forbidden tokens (structured outputs) after those.
        Log-probabilities are the raw model's, before all of that and before temperature."""
        if logits.dtype != torch.float32 and not (histories is None and constrain is None and argmax_only(params)):
            logits = logits.float()
        processed = process_logits(logits, params, histories) if histories is not None else logits
        if constrain is not None:  # grammar masks, in place: never on the raw logits the logprobs come from
            processed = constrain(processed.clone() if processed is logits else processed)
        tokens = self._pick(processed, params, seeds)
        # A row whose pick is no allowed token (its logit -inf or NaN, or an id past the vocabulary:
        # every token masked, or NaN logits) comes back as -1 and is looked at again alone; the
        # usual step pays one gather, and still one wait for the ids.
        vocab = processed.shape[1]
        picked = processed.gather(1, tokens.clamp(max=vocab - 1)[:, None]).squeeze(1)
        bad = (tokens >= vocab) | ~torch.isfinite(picked)
        token_list: list[int | None] = torch.where(bad, -1, tokens).tolist()
        for row, token in enumerate(token_list):
            if token == -1:
                token_list[row] = self._pick_alone(processed[row], params[row], seeds[row])
        return SamplerOutput(token_list, self._logprobs(logits, params, token_list))

    def _pick(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]) -> torch.Tensor:
        tokens = self._argmax(logits)
        if not all(p.greedy for p in params):
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            tokens = torch.where(greedy, tokens, self._sample(logits, params, seeds))
        return tokens

    def _pick_alone(self, row: torch.Tensor, params: SamplingParams, seed: int | None) -> int | None:
        """A row the batched pick could not serve: NaN counts as forbidden (-inf), a +inf logit is
        certain; None when no token is left (the engine then ends the sequence, see SamplingParams)."""
        row = torch.nan_to_num(row.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        certain = torch.isposinf(row).nonzero().flatten()
        if certain.numel():
            return int(certain[0])
        allowed = torch.isfinite(row)
        if not bool(allowed.any()):
            return None
        row = row - row[allowed].max()  # <= 0 everywhere: no overflow once divided by a temperature
        token = int(self._pick(row[None], [params], [seed])[0])
        return token if token < row.shape[0] and bool(allowed[token]) else None

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if (
            self.kernels is not None
            and logits.is_cpu
            and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.is_contiguous()
        ):
            return self.kernels.argmax_rows(logits)
        return logits.float().argmax(dim=-1)  # torch's bfloat16 argmax: 6x slower than widening first

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        logits = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        if any(top_k):
            k = torch.tensor([min(k, logits.shape[1]) if k else logits.shape[1] for k in top_k], device=device)
            sorted_logits = logits.sort(dim=-1, descending=True).values
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the tokens ranked above it already reach top_p.
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        uniform = torch.rand(probs.shape[0], generator=self.generator, dtype=torch.float64, device=device)
        for row, seed in enumerate(seeds):
            if seed is not None:
                self._seeded.manual_seed(seed)
                uniform[row] = torch.rand(1, generator=self._seeded, dtype=torch.float64, device=device)[0]
        cdf = probs.cumsum(dim=-1)
        # x in (0, total]: the first token whose running sum reaches x has a nonzero probability
        # (a zero-probability token repeats the sum of the token before it), and one always exists.
        x = ((1.0 - uniform) * cdf[:, -1].double()).float().clamp_(min=torch.finfo(torch.float32).tiny)
        return torch.searchsorted(cdf, x[:, None]).squeeze(1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], tokens: list[int | None]
    ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(params)
        if not rows:
            return result
        logprobs = logits[rows].log_softmax(dim=-1)
        max_k = max(params[i].logprobs or 0 for i in rows)
        top_values, top_ids = logprobs.topk(max(max_k, 1), dim=-1)
        for j, row in enumerate(rows):
            if tokens[row] is None:
                continue
            k = params[row].logprobs or 0
            top = list(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist()))
            result[row] = (float(logprobs[j, tokens[row]]), top)
        return result
