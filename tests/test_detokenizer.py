"""Incremental detokenization with a stand-in tokenizer (one character per id)."""

from pagedllm.text.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def stream(text: str, stop: list[str]):
    detok = IncrementalDetokenizer(CharTokenizer(), stop)
    ids, deltas = [], []
    for ch in text:
        ids.append(ord(ch))
        delta, hit = detok.update(ids, final=False)
        deltas.append(delta)
        if hit:
            return detok.text, "".join(deltas), True
    deltas.append(detok.update(ids, final=True)[0])
    return detok.text, "".join(deltas), False


def test_streamed_text_equals_the_final_text():
    text, streamed, hit = stream("hello world", [])
    assert text == streamed == "hello world" and not hit


def test_stop_string_spanning_tokens_is_never_streamed():
    text, streamed, hit = stream("one two END three", ["END"])
    assert hit and text == "one two " and streamed == text


def test_earliest_of_several_stops_wins():
    text, streamed, hit = stream("abcXYdefZ", ["Z", "XY"])
    assert hit and text == streamed == "abc"


def test_held_back_text_is_flushed_at_the_end():
    text, streamed, hit = stream("no stop here EN", ["END"])
    assert not hit and text == streamed == "no stop here EN"


def test_real_tokenizer_decodes_as_transformers_does():
    import random

    from pagedllm.models.loader import resolve_model_path
    from pagedllm.text.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_path("smollm2"))
    assert tok._backend_decode is not None  # SmolLM2's fast tokenizer takes the direct path
    rng = random.Random(0)
    special = list(tok.hf.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tok.hf)) for _ in range(rng.randrange(1, 12))] + rng.sample(special, 1)
        rng.shuffle(ids)
        assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)
