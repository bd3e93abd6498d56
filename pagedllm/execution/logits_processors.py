"""Penalties, bias and the min_tokens ban, applied to a step's logits before sampling.

Vectorized over the rows that ask for any of them (the others are untouched): token
counts come from one scatter over the padded id lists, and every rule is a masked
tensor operation over [rows, vocab].  The rules are in `SamplingParams`' docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.sampling_params import SamplingParams


@dataclass
class TokenHistory:
    """What the rules look at for one row: the sequence's tokens so far and its stop ids."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None


def _token_counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(id_lists), vocab] float32: how often each id occurs in each list."""
    longest = max((len(ids) for ids in id_lists), default=0)
    padded = torch.full((len(id_lists), max(longest, 1)), vocab, dtype=torch.int64)  # `vocab`: a spare column
    for row, ids in enumerate(id_lists):
        if ids:
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(len(id_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]) -> torch.Tensor:
    """The logits to sample from: a new tensor where any row asks for processing, else `logits` itself."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    vocab = logits.shape[1]
    out = logits.clone()
    sub = out[rows]
    chosen = [params[i] for i in rows]
    seen = [histories[i] for i in rows]

    device = logits.device
    if any(p.repetition_penalty != 1.0 for p in chosen):
        repetition = torch.tensor([p.repetition_penalty for p in chosen], device=device)
        in_context = _token_counts([h.prompt_token_ids + h.output_token_ids for h in seen], vocab, device) > 0
        penalty = repetition[:, None].expand_as(sub)
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(in_context & (penalty != 1.0), penalized, sub)

    if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in chosen):
        frequency = torch.tensor([p.frequency_penalty for p in chosen], device=device)
        presence = torch.tensor([p.presence_penalty for p in chosen], device=device)
        counts = _token_counts([h.output_token_ids for h in seen], vocab, device)
        sub = sub - counts * frequency[:, None] - (counts > 0).float() * presence[:, None]

    for j, p in enumerate(chosen):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
            sub[j, ids] += torch.tensor(list(p.logit_bias.values()), dtype=sub.dtype, device=device)
        history = seen[j]
        for word in p.bad_words_token_ids:  # ban a bad word's last token right after the rest of it
            if len(word) == 1 or history.output_token_ids[-(len(word) - 1) :] == word[:-1]:
                if word[-1] < vocab:
                    sub[j, word[-1]] = float("-inf")
        if len(history.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids)
            if history.eos_token_id is not None and not p.ignore_eos:
                banned.append(history.eos_token_id)
            banned = [t for t in banned if t < vocab]
            if banned:
                sub[j, banned] = float("-inf")
    out[rows] = sub
    return out
