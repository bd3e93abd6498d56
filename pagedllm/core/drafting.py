"""Draft tokens without a second model: guesses at what a request generates next, taken from its
own tokens (and, for the suffix drafter, from recent requests' outputs).

Pure Python.  A drafter keeps an index per request, extended with the tokens appended since
it last looked, so a proposal costs a few dictionary lookups, not a scan of the prompt.

- `NgramDrafter` (prompt lookup): the last n tokens (n from `max_n` down to `min_n`) are
  looked up among the request's earlier tokens, prompt and output; the tokens that followed
  their latest earlier occurrence are the draft.
- `SuffixDrafter`: a depth-limited suffix tree of the request's tokens, counting how often
  each continuation followed each context.  The longest context of the current suffix seen
  before is matched, and the draft follows the most frequent continuation, token by token,
  while its frequency (continuations / occurrences) stays above `min_confidence`.  With
  `cross_request`, a second tree holds the outputs of the last `max_cached_requests`
  finished requests, consulted where the request's own tree has no match.

Every draft token carries a confidence in (0, 1]: the drafter's own estimate that it is right
given the ones before it (1 for prompt lookup, the frequency for the suffix tree).  The
speculation policy (core/speculation.py) multiplies it with the request's measured
acceptance to decide how many draft tokens are worth verifying.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    confidence: list[float]  # per draft token, in (0, 1]

    @staticmethod
    def empty() -> Draft:
        return Draft([], [])


class Drafter(Protocol):
    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft: ...

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        """The request ended (or was preempted): drop its index; its output may serve others."""


class NgramDrafter:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        # Per request: for each n-gram (a tuple), the position just past its latest occurrence,
        # over the tokens indexed so far, and how many tokens that is.
        self._index: dict[str, tuple[dict[tuple[int, ...], int], list[int]]] = {}

    def _indexed(self, request_id: str, token_ids: list[int]) -> dict[tuple[int, ...], int]:
        entry = self._index.get(request_id)
        if entry is None:
            entry = self._index[request_id] = ({}, [0])
        table, done = entry
        # An n-gram ending at position end - 1 is indexed once the token after it exists, so the
        # current suffix never finds itself.
        for end in range(max(done[0], self.min_n), len(token_ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table[tuple(token_ids[end - n : end])] = end
        done[0] = max(done[0], len(token_ids))
        return table

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(token_ids) < self.min_n:
            return Draft.empty()
        table = self._indexed(request_id, token_ids)
        for n in range(min(self.max_n, len(token_ids)), self.min_n - 1, -1):
            follow = table.get(tuple(token_ids[-n:]))
            if follow is not None:
                draft = token_ids[follow : follow + max_tokens]
                return Draft(draft, [1.0] * len(draft))
        return Draft.empty()

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        self._index.pop(request_id, None)


ROOT = 0  # the empty context's node


class SuffixTree:
    """Every context of up to `depth` tokens of the sequences added, with how often each occurred;
    a node's children are the tokens that followed it.

    Nodes are ints indexing flat lists, and a node's children a dict of ints (None until one
    followed it): such dicts hold no object the garbage collector tracks, so a tree of a million
    contexts adds nothing to the collector's passes (a node object each cost a decode step of 8
    requests about 5% in collections)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: list[int] = [0]
        self.children: list[dict[int, int] | None] = [None]
        self._unused: list[int] = []  # nodes whose count fell to 0, to be given out again

    @property
    def num_nodes(self) -> int:
        return len(self.counts) - len(self._unused)

    def add(self, token_ids: list[int], active: list[int] | None = None, sign: int = 1) -> list[int]:
        """Count the contexts ending at each of `token_ids` (`sign` -1 takes them back); `active`:
        the nodes of the contexts ending just before them (from the last call), shortest first.
        Returns the nodes of the contexts ending at the last token."""
        counts, children, unused = self.counts, self.children, self._unused
        longest = self.depth - 1  # the contexts extended: the empty one and those up to depth - 1
        active = list(active or ())[:longest]
        emptied: list[int] = []  # given out again only after this call: `active` may still name them
        for token in token_ids:
            extended = []
            for node in (ROOT, *active):  # each context, one token longer
                kids = children[node]
                if kids is None:
                    kids = children[node] = {}
                child = kids.get(token)
                if child is None:  # (only when adding: what is taken back was added)
                    if unused:
                        child = unused.pop()
                        counts[child], children[child] = 0, None
                    else:
                        child = len(counts)
                        counts.append(0)
                        children.append(None)
                    kids[token] = child
                counts[child] += sign
                if sign < 0 and counts[child] <= 0:
                    del kids[token]
                    emptied.append(child)
                extended.append(child)
            active = extended[:longest]
        unused += emptied
        return extended if token_ids else active

    def match(self, token_ids: list[int], min_length: int) -> int | None:
        """The node of the longest suffix of `token_ids` (at least `min_length` long) seen before
        with something after it."""
        children = self.children
        for length in range(min(self.depth, len(token_ids)), min_length - 1, -1):
            node: int | None = ROOT
            for token in token_ids[len(token_ids) - length :]:
                kids = children[node]
                node = kids.get(token) if kids else None
                if node is None:
                    break
            else:
                if children[node]:
                    return node
        return None

    def follow(self, node: int, max_tokens: int, min_confidence: float) -> tuple[Draft, bool]:
        """The most frequent path below `node`, while each step's frequency holds up; and whether it
        ended only because the tree's depth did (a node with no children)."""
        counts, children = self.counts, self.children
        tokens, confidence = [], []
        while len(tokens) < max_tokens:
            kids = children[node]
            if not kids:
                return Draft(tokens, confidence), True
            token, child = max(kids.items(), key=lambda item: counts[item[1]])
            share = counts[child] / max(counts[node], counts[child])
            if share < min_confidence:
                break
            tokens.append(token)
            confidence.append(share)
            node = child
        return Draft(tokens, confidence), False


class SuffixDrafter:
    def __init__(
        self,
        depth: int = 16,
        min_match: int = 2,
        min_confidence: float = 0.1,
        cross_request: bool = False,
        max_cached_requests: int = 256,
    ) -> None:
        if depth < 1 or not 1 <= min_match <= depth:
            raise ValueError(f"suffix drafter needs 1 <= min_match <= depth, got {min_match} and {depth}")
        self.depth, self.min_match, self.min_confidence = depth, min_match, min_confidence
        # Per request: its tree, the active nodes after its last indexed token, how many are indexed.
        self._trees: dict[str, tuple[SuffixTree, list[list[int]], list[int]]] = {}
        self.cross_request = cross_request
        self.max_cached_requests = max_cached_requests
        self.shared = SuffixTree(depth)
        self._shared_outputs: OrderedDict[str, list[int]] = OrderedDict()

    def _tree(self, request_id: str, token_ids: list[int]) -> SuffixTree:
        entry = self._trees.get(request_id)
        if entry is None:
            entry = self._trees[request_id] = (SuffixTree(self.depth), [[]], [0])
        tree, active, done = entry
        # The last token's contexts are counted once the token after it is known: a context's
        # children are then only what followed its earlier occurrences.
        if len(token_ids) - 1 > done[0]:
            active[0] = tree.add(token_ids[done[0] : len(token_ids) - 1], active[0])
            done[0] = len(token_ids) - 1
        return tree

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(token_ids) < self.min_match:
            return Draft.empty()
        tree = self._tree(request_id, token_ids)
        context = token_ids[-self.depth :]
        tokens: list[int] = []
        confidence: list[float] = []
        # A path is at most `depth` tokens deep: where it ends for that reason alone, the draft so far
        # is matched again as part of the context, and followed on.
        while len(tokens) < max_tokens:
            source, node = tree, tree.match(context, self.min_match)
            if node is None and self.cross_request and self._shared_outputs:
                source, node = self.shared, self.shared.match(context, self.min_match)
            if node is None:
                break
            draft, at_depth = source.follow(node, max_tokens - len(tokens), self.min_confidence)
            tokens += draft.token_ids
            confidence += draft.confidence
            if not at_depth or not draft.token_ids:
                break
            context = (context + draft.token_ids)[-self.depth :]
        return Draft(tokens, confidence)

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        self._trees.pop(request_id, None)
        if not self.cross_request or not output_token_ids or request_id in self._shared_outputs:
            return
        self._shared_outputs[request_id] = list(output_token_ids)
        self.shared.add(output_token_ids)
        while len(self._shared_outputs) > self.max_cached_requests:
            _, oldest = self._shared_outputs.popitem(last=False)
            self.shared.add(oldest, sign=-1)


def make_drafter(method: str) -> Drafter:
    if method == "ngram":
        return NgramDrafter()
    if method == "suffix":
        return SuffixDrafter(cross_request=True)
    raise ValueError(f"speculative method must be ngram, suffix or off, got {method!r}")
