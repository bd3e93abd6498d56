"""Beam search: the bookkeeping rules on toy numbers, then parity with transformers on the real model."""

import math

import pytest
import torch
from conftest import assert_no_blocks_held

from pagedllm.core.beam_search import BeamSearchState

EOS = 0


def test_first_step_expands_the_single_prompt_beam_into_the_best_w():
    state = BeamSearchState(beam_width=2, max_tokens=5, eos_token_id=EOS)
    live = state.step([[(5, -0.1), (6, -0.5), (7, -0.7), (8, -2.0)]], [()])
    assert [(b.parent, b.token_id) for b in live] == [(0, 5), (0, 6)]
    assert state.live_scores == [-0.1, -0.5] and not state.done


def test_eos_finishes_a_hypothesis_only_within_the_top_w_and_scores_it_by_length():
    state = BeamSearchState(beam_width=2, max_tokens=5, eos_token_id=EOS, length_penalty=1.0)
    state.step([[(5, -0.1), (6, -0.5), (7, -0.7), (8, -2.0)]], [()])
    # beam 0 (score -0.1) ends with EOS at rank 0; beam 1's EOS ranks 4th of 4: a backup, not finished.
    live = state.step([[(EOS, -0.2), (9, -1.0)], [(EOS, -0.6), (4, -0.3)]], [(5,), (6,)])
    assert [(h.token_ids, round(h.score, 6)) for h in state.finished] == [((5, EOS), round(-0.3 / 2, 6))]
    assert [(b.parent, b.token_id) for b in live] == [(1, 4), (0, 9)]  # scores -0.8 and -1.1


def test_the_search_stops_when_no_live_beam_can_beat_the_finished_ones():
    state = BeamSearchState(beam_width=1, max_tokens=10, eos_token_id=EOS)
    state.step([[(EOS, -0.1), (3, -0.2)]], [()])  # finished at -0.1 / 1; live beam at -0.2 cannot beat it
    assert state.done and state.finished[0].token_ids == (EOS,)


def test_max_tokens_ends_every_candidate():
    state = BeamSearchState(beam_width=2, max_tokens=1, eos_token_id=EOS, length_penalty=0.0)
    assert state.step([[(3, -0.1), (4, -0.2), (5, -0.3), (6, -0.4)]], [()]) == []
    assert state.done and [h.token_ids for h in state.finished] == [(3,), (4,)]


PROMPTS = [
    "The three primary colours are",
    [{"role": "user", "content": "Give me a short name for a cat."}],
    "def add(a, b):",
]


@torch.inference_mode()
def hf_beam_search(model, ids, width, max_new_tokens, length_penalty, early_stopping, eos):
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
        top_k=None,
        top_p=None,
        temperature=None,
        repetition_penalty=None,
    )
    sequences = []
    for row in out.sequences[:, len(ids) :].tolist():
        sequences.append(row[: row.index(eos) + 1] if eos in row else row)
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beam_search_matches_transformers(make_llm, hf_model, length_penalty, early_stopping):
    llm = make_llm(kv_cache_memory="64MiB")
    eos = llm.engine.eos_token_id
    width, max_tokens = 4, 20
    ids = [llm.tokenizer.apply_chat_template(p) if isinstance(p, list) else llm.tokenizer.encode(p) for p in PROMPTS]
    ours = llm.beam_search(ids, width, max_tokens, length_penalty=length_penalty, early_stopping=early_stopping)
    for prompt_ids, output in zip(ids, ours):
        hf_sequences, hf_scores = hf_beam_search(
            hf_model, prompt_ids, width, max_tokens, length_penalty, early_stopping, eos
        )
        assert [c.token_ids for c in output.outputs] == hf_sequences
        for completion, hf_score in zip(output.outputs, hf_scores):
            assert math.isclose(completion.score, hf_score, abs_tol=1e-3), (completion.score, hf_score)
    assert_no_blocks_held(llm)


def test_beams_share_their_prefix_blocks(make_llm):
    llm = make_llm(kv_cache_memory="64MiB")
    engine = llm.engine
    prompt = list(range(1000, 1000 + 100))  # 100 tokens: 6 full blocks and a partial one
    engine.memory.reset(engine.scheduler)
    (output,) = llm.beam_search([prompt], beam_width=4, max_tokens=24)
    assert len(output.outputs) == 4
    assert [c.score for c in output.outputs] == sorted((c.score for c in output.outputs), reverse=True)
    summary = engine.memory.summary(engine.scheduler)
    # Four beams of up to 124 tokens would need 4 x 8 blocks unshared; they share the prompt's blocks.
    assert summary["kv_shared_peak"] >= 6 * 16
    assert summary["kv_allocated_peak"] <= 0.6 * summary["kv_unshared_peak"]
    assert_no_blocks_held(llm)
