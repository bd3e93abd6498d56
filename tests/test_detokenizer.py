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
