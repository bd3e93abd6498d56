"""A mixture-of-experts MLP: each token's router picks its top-k experts (SwiGLU MLPs) and
the layer returns their outputs weighted by the router's probabilities.

The tokens are grouped by expert, not looped over: the step's (token, expert) pairs are
sorted by expert, and each expert that any token chose runs one GEMM over all of its
tokens (gate/up, the activation, down), so the step costs one pass per active expert.
The weighted outputs are summed back per token in expert order, as transformers sums them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] in the logits' dtype, expert ids [tokens, k]): the softmax over all
    experts in float32, its k largest, renormalized to sum to 1 where `normalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation,
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert[experts[t, k]](x[t]), for x [tokens, hidden];
    gate_up [E, 2 * inter, hidden], down [E, hidden, inter]; `activation` maps [rows, 2 * inter]
    (gate | up) to [rows, inter]."""
    tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept within
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, token_of)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = slice(start, start + count)
        out[part] = F.linear(activation(F.linear(rows[part], gate_up[expert])), down[expert])
        start += count
    out *= weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token_of, out)
