"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

from pagedllm.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text, a few tokens at a time.

    Decoding a window of recent tokens (rather than the token alone) keeps
    multi-byte characters and word-initial spaces right; a window that ends
    in an incomplete character waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, output_ids: list[int]) -> tuple[str, bool]:
        """Take the full output so far; return (new text, whether a stop string was hit)."""
        decode = self.tokenizer.decode
        prefix_text = decode(output_ids[self._prefix_offset : self._read_offset])
        new_text = decode(output_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return "", False
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
        old_len = len(self.text)
        self.text += delta
        if self.stop:
            longest = max(map(len, self.stop))
            search_from = max(0, old_len - longest + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = self.text[old_len:cut] if cut > old_len else ""
                self.text = self.text[:cut]
                return delta, True
        return delta, False
