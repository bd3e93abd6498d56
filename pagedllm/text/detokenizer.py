"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

from pagedllm.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text, a few tokens at a time.

    Decoding a window of recent tokens (rather than the token alone) keeps
    multi-byte characters and word-initial spaces right; a window that ends
    in an incomplete character waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        # While running, the last len(longest stop) - 1 characters are held back from
        # the deltas: they may turn out to begin a stop string.
        self._holdback = max(map(len, stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, output_ids: list[int], final: bool) -> tuple[str, bool]:
        """Take the full output so far; return (text to emit now, whether a stop string was hit)."""
        old_len = len(self.text)
        self._decode_new(output_ids)
        hit = False
        if self.stop and len(self.text) > old_len:
            search_from = max(0, old_len - self._holdback)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                hit = True
        limit = len(self.text) if (hit or final) else max(len(self.text) - self._holdback, self._emitted)
        delta = self.text[self._emitted : limit]
        self._emitted = limit
        return delta, hit

    def _decode_new(self, output_ids: list[int]) -> None:
        decode = self.tokenizer.decode
        prefix_text = decode(output_ids[self._prefix_offset : self._read_offset])
        new_text = decode(output_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
