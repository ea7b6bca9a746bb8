"""The suffix structures of ``suffix`` mode (SuffixDecoding): occurrence counts of every short token
string in a set of sequences, kept as a depth-capped suffix trie.

A ``SuffixTrie`` over sequences S with depth cap D has one node per token string p with
1 ≤ |p| ≤ D that occurs in S, and the node's ``count`` is how many times p occurs (overlapping
occurrences count). Example, S = {[1, 2, 1, 2]}, D = 3: count([1]) = 2, count([1, 2]) = 2,
count([2, 1]) = 1, count([1, 2, 1]) = 1; the continuations of [1, 2] are {1: 1}.

Stored lazily so that a sequence costs about as many nodes as it shares with others, not D per
token: a node with count 1 (a string occurring once) need not have its children built, because
its whole subtree is that one occurrence's continuation, read from the sequence itself (each
node keeps where its latest occurrence is). A second occurrence passing through such a node builds its one
child first ("expands" it). Nodes with count ≥ 2 are always expanded.

Sequences grow (``append``: a request's own text as tokens commit, each token touching at most D
nodes) and go (``remove``: counts decremented along the sequence's strings, nodes that reach 0
deleted), so the trie always equals one built from the surviving sequences. ``SuffixStore``
keeps one trie per tenant under one bound on stored tokens, evicting the oldest sequence first.
"""

from __future__ import annotations

import heapq
import threading
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SUFFIX_MAX_TOKENS = 1 << 18
"""``SuffixStore``'s default bound on stored tokens, over all tenants (262 144;
``specdraft serve worker --suffix-max-tokens``)."""
UNEXPANDED = -2
"""``SuffixTrie._first`` of a node whose children are not built (its count is 1)."""
_STRIDE = 1 << 32  # child key: parent * _STRIDE + token


Cursor = tuple[int, int]
"""A place in the trie: a built node, and how many tokens further down its implicit continuation
(0 at the node itself; > 0 only below an unexpanded node, whose strings all have count 1)."""


@dataclass(frozen=True)
class Continuation:
    token: int
    count: int  # occurrences of the string ending in ``token``
    cursor: Cursor
    source: int  # position of ``token`` in its latest occurrence's sequence


class SuffixTrie:
    """Counts of every string of at most ``depth`` tokens over the sequences added (module doc).

    Nodes are ids into flat arrays (no Python object per node: a store of millions of nodes must
    not slow the garbage collector down). Node p: ``_count`` its occurrences, ``_depth`` |p|,
    ``_seq`` / ``_pos`` its latest occurrence (the sequence, and the position right after p in it,
    where p's continuation starts), ``_first`` / ``_next`` its first child and next sibling
    (``UNEXPANDED``: children not built), ``_token`` its last token; ``_child`` finds a child by
    token. Node 0 is the root (the empty string).
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, not {depth}")
        self.depth = depth
        self._count = array("q", [0])
        self._depth = array("q", [0])
        self._seq = array("q", [-1])
        self._pos = array("q", [0])
        self._first = array("q", [-1])
        self._next = array("q", [-1])
        self._token = array("q", [-1])
        self._child: dict[int, int] = {}
        self._free: list[int] = []
        self.seqs: dict[int, array[int]] = {}
        self._open: dict[int, list[int]] = {}
        """Per growing sequence, the deepest built node on the path of each of its last ``depth``
        starts (occurrences still shorter than the cap), the oldest start first."""

    @property
    def nodes(self) -> int:
        """Built nodes, the root excluded."""
        return len(self._count) - 1 - len(self._free)

    @property
    def tokens(self) -> int:
        """Tokens stored over all sequences."""
        return sum(len(s) for s in self.seqs.values())

    def _new(self, parent: int, token: int, seq: int, pos: int) -> int:
        """A node with count 1, unexpanded, as ``parent``'s first child."""
        sibling = max(self._first[parent], -1)
        if self._free:
            node = self._free.pop()
            self._count[node], self._depth[node] = 1, self._depth[parent] + 1
            self._seq[node], self._pos[node] = seq, pos
            self._first[node], self._next[node], self._token[node] = UNEXPANDED, sibling, token
        else:
            node = len(self._count)
            self._count.append(1)
            self._depth.append(self._depth[parent] + 1)
            self._seq.append(seq)
            self._pos.append(pos)
            self._first.append(UNEXPANDED)
            self._next.append(sibling)
            self._token.append(token)
        self._first[parent] = node
        self._child[parent * _STRIDE + token] = node
        return node

    def append(self, seq: int, tokens: Iterable[int]) -> None:
        """Add ``tokens`` at the end of sequence ``seq`` (a new one if unknown): every string that
        now ends in one of them is counted. Costs at most ``depth`` node steps per token."""
        if seq not in self.seqs:
            self.seqs[seq] = array("q")
            self._open[seq] = []
        text = self.seqs[seq]
        open_ = self._open[seq]
        first_child = self._first
        for token in tokens:
            i = len(text)
            text.append(int(token))
            open_.append(0)
            if len(open_) > self.depth:
                del open_[0]  # that occurrence reached the depth cap
            first = i + 1 - len(open_)
            for k, node in enumerate(open_):
                if first_child[node] != UNEXPANDED:  # else: this occurrence's own node, growing implicitly
                    open_[k] = self._extend(seq, text, first + k, i, node)

    def close(self, seq: int) -> None:
        """Sequence ``seq`` grows no more (forgets what ``append`` kept to extend it)."""
        self._open.pop(seq, None)

    def _extend(self, seq: int, text: array[int], start: int, i: int, node: int) -> int:
        """Count ``text[start : i + 1]``, whose prefix without ``text[i]`` is counted already and
        passes through ``node``; returns the deepest built node on its path."""
        depth = self._depth
        while depth[node] < i - start:
            if self._first[node] == UNEXPANDED:
                return node  # count 1: this occurrence's own node, its continuation implicit
            node = self._child[node * _STRIDE + text[start + depth[node]]]
        if self._first[node] == UNEXPANDED:
            return node  # the string so far occurs once, here: the new token extends it implicitly
        token = text[i]
        child = self._child.get(node * _STRIDE + token)
        if child is None:
            return self._new(node, token, seq, i + 1)
        if self._first[child] == UNEXPANDED:
            self._expand(child)
        self._count[child] += 1
        self._seq[child], self._pos[child] = seq, i + 1
        return child

    def _expand(self, node: int) -> None:
        """Build the one child of an unexpanded node (count 1) from its occurrence."""
        self._first[node] = -1
        text = self.seqs[self._seq[node]]
        pos = self._pos[node]
        if self._depth[node] < self.depth and pos < len(text):
            self._new(node, text[pos], self._seq[node], pos + 1)

    def remove(self, seq: int) -> None:
        """Forget sequence ``seq``: the trie is then the one built from the others."""
        text = self.seqs.pop(seq)
        self._open.pop(seq, None)
        for start in range(len(text)):
            node = 0
            for d in range(min(self.depth, len(text) - start)):
                if self._first[node] == UNEXPANDED:
                    break  # this occurrence's own continuation: gone with the node above
                child = self._child[node * _STRIDE + text[start + d]]
                self._count[child] -= 1
                if self._count[child] == 0:
                    self._unlink(node, child)
                    break
                node = child

    def _unlink(self, parent: int, node: int) -> None:
        """Delete ``node`` and its subtree (all of count 0) from ``parent``'s children."""
        if self._first[parent] == node:
            self._first[parent] = self._next[node]
        else:
            sibling = self._first[parent]
            while self._next[sibling] != node:
                sibling = self._next[sibling]
            self._next[sibling] = self._next[node]
        stack = [(parent, node)]
        while stack:
            up, n = stack.pop()
            del self._child[up * _STRIDE + self._token[n]]
            self._free.append(n)
            c = self._first[n]
            while c >= 0:
                stack.append((n, c))
                c = self._next[c]

    # -- reading -------------------------------------------------------------------------------

    def find(self, pattern: Sequence[int]) -> Cursor | None:
        """Where ``pattern`` (at most ``depth`` tokens) ends in the trie; None if it never occurs."""
        node, extra = 0, 0
        for token in pattern:
            if extra == 0 and self._first[node] != UNEXPANDED:
                found = self._child.get(node * _STRIDE + int(token))
                if found is None:
                    return None
                node = found
            else:
                text = self.seqs[self._seq[node]]
                p = self._pos[node] + extra
                if self._depth[node] + extra >= self.depth or p >= len(text) or text[p] != token:
                    return None
                extra += 1
        return node, extra

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (1 ≤ length ≤ ``depth``) in the sequences."""
        found = self.find(pattern)
        return self._count[found[0]] if found is not None else 0

    def continuations(self, cursor: Cursor) -> list[Continuation]:
        """The tokens that follow the string at ``cursor``, each with its string's count."""
        node, extra = cursor
        if extra == 0 and self._first[node] != UNEXPANDED:
            out = []
            c = self._first[node]
            while c >= 0:
                out.append(Continuation(self._token[c], self._count[c], (c, 0), self._pos[c] - 1))
                c = self._next[c]
            return out
        text = self.seqs[self._seq[node]]
        p = self._pos[node] + extra
        if self._depth[node] + extra >= self.depth or p >= len(text):
            return []
        return [Continuation(text[p], 1, (node, extra + 1), p)]

    def _followed(self, cursor: Cursor) -> bool:
        """Whether the string at ``cursor`` occurs followed by some token."""
        node, extra = cursor
        if extra == 0 and self._first[node] != UNEXPANDED:
            return self._first[node] >= 0
        return self._depth[node] + extra < self.depth and self._pos[node] + extra < len(
            self.seqs[self._seq[node]]
        )

    def match(self, context: Sequence[int], longest: int) -> tuple[Cursor, int] | None:
        """The longest suffix of ``context`` (at most ``longest`` tokens) that occurs in the trie
        followed by some token: its cursor and length. Example: trie over [[5, 6, 7]], context
        [1, 5, 6]: the suffix [5, 6] (followed by 7), length 2.

        A suffix that occurs followed by t has every shorter suffix occur followed by t, so the
        lengths that match are 1 .. m* and m* is found by bisection: the longest length first
        (a long repeat, one look-up), then about log2(``longest``) look-ups, not one per length.
        """

        def at(m: int) -> Cursor | None:
            cursor = self.find(context[len(context) - m :])
            return cursor if cursor is not None and self._followed(cursor) else None

        top = min(longest, self.depth - 1, len(context))
        found = at(top) if top > 0 else None
        if found is not None:
            return found, top
        lo, hi = 0, top  # the suffix of length lo matches (0: trivially), that of length hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            cursor = at(mid)
            if cursor is None:
                hi = mid
            else:
                lo, found = mid, cursor
        return (found, lo) if found is not None else None


@dataclass(frozen=True)
class Candidate:
    """A draft tree grown from a match: nodes in topological order."""

    tokens: tuple[int, ...]  # [nodes]
    parents: tuple[int, ...]  # [nodes], -1 = the root
    probabilities: tuple[float, ...]  # [nodes] empirical P(path), the product along it
    conditionals: tuple[float, ...]  # [nodes] count(node) / Σ count(siblings)
    supports: tuple[int, ...]  # [nodes] Σ count(siblings): how many occurrences the choice saw
    sources: tuple[int, ...]  # [nodes] the token's position in its latest occurrence's sequence

    @property
    def score(self) -> float:
        """Expected accepted tokens if the empirical probabilities were right: Σ P(path)."""
        return sum(self.probabilities)


def grow(trie: SuffixTrie, cursor: Cursor, max_nodes: int, min_probability: float) -> Candidate:
    """The draft tree below ``cursor``: the likeliest continuations first, each node's probability
    the product of count(child) / Σ count(children) along its path, until ``max_nodes`` nodes or
    until the next likeliest is below ``min_probability``.

    Example: below [5] the trie saw 6 three times and 8 once, and 7 always after [5, 6]: with
    max_nodes 3 the tree is 6 (0.75), 7 (0.75), 8 (0.25).
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    conds: list[float] = []
    supports: list[int] = []
    sources: list[int] = []
    heap: list[tuple[float, int, int, Continuation, float, int]] = []
    order = 0

    def push(parent: int, at: Cursor, prob: float) -> None:
        nonlocal order
        options = trie.continuations(at)
        total = sum(c.count for c in options)
        for c in options:
            p = prob * c.count / total
            if p >= min_probability:
                heapq.heappush(heap, (-p, order, parent, c, c.count / total, total))
                order += 1

    push(-1, cursor, 1.0)
    while heap and len(tokens) < max_nodes:
        neg, _, parent, c, cond, total = heapq.heappop(heap)
        tokens.append(c.token)
        parents.append(parent)
        probs.append(-neg)
        conds.append(cond)
        supports.append(total)
        sources.append(c.source)
        push(len(tokens) - 1, c.cursor, -neg)
    return Candidate(
        tuple(tokens), tuple(parents), tuple(probs), tuple(conds), tuple(supports), tuple(sources)
    )


class SuffixStore:
    """What a worker's ``suffix`` mode learned from finished requests: one ``SuffixTrie`` per
    tenant, all under one bound on stored tokens (worker configuration, never a request's).
    Adding past the bound evicts the oldest sequences first, whatever their tenant; a tenant whose
    sequences are all gone is forgotten. ``lock`` guards it: every spelling of the mode (each its
    own drafter and lock) shares the store."""

    def __init__(self, max_tokens: int = SUFFIX_MAX_TOKENS, depth: int = 32, prompt_tokens: int = 32) -> None:
        """``prompt_tokens``: how many of a finished request's last prompt tokens are kept before
        its output (what the output answered: a repeated question then matches and drafts its
        answer from the first token); -1: the whole prompt."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
        self.max_tokens = max_tokens
        self.depth = depth
        self.prompt_tokens = prompt_tokens
        self.lock = threading.Lock()
        self.tokens = 0
        self._tries: dict[str, SuffixTrie] = {}
        self._order: deque[tuple[str, int, int]] = deque()  # (tenant, sequence id, tokens), oldest first
        self._next = 0

    def add(self, tenant: str, tokens: Sequence[int], prompt_length: int) -> None:
        """Keep a finished request's text (``tokens``: its prompt, then its output) for ``tenant``."""
        keep = len(tokens) - prompt_length
        if self.prompt_tokens < 0:
            keep = len(tokens)
        else:
            keep += min(self.prompt_tokens, prompt_length)
        keep = min(keep, self.max_tokens)
        if keep <= 0:
            return
        while self._order and self.tokens + keep > self.max_tokens:
            self._evict()
        trie = self._tries.get(tenant)
        if trie is None:
            trie = self._tries[tenant] = SuffixTrie(self.depth)
        seq = self._next
        self._next += 1
        trie.append(seq, tokens[len(tokens) - keep :])
        trie.close(seq)
        self._order.append((tenant, seq, keep))
        self.tokens += keep

    def _evict(self) -> None:
        tenant, seq, size = self._order.popleft()
        trie = self._tries[tenant]
        trie.remove(seq)
        self.tokens -= size
        if not trie.seqs:
            del self._tries[tenant]

    def trie(self, tenant: str) -> SuffixTrie | None:
        """``tenant``'s trie (None: nothing kept for it)."""
        return self._tries.get(tenant)

    def tenants(self) -> list[str]:
        return list(self._tries)

    def nodes(self) -> int:
        """Built trie nodes over all tenants."""
        return sum(t.nodes for t in self._tries.values())
