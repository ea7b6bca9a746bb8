"""Batch verification (DReSD Fig. 3): the verdict on D drafts computed as D rows of one forward.

The target computes every row in full: row r is the root followed by draft r, so row r's
column c holds the target's distribution after the root and r's first c tokens (column 0: after
the root alone). The verdict is not taken row by row but on the rows' **trie**
(``DraftBatch.trie``), with each trie node's logits read from the first row containing it, by the
same rules as a tree (``verify_greedy`` / ``verify_sampling``). The chosen row is the first row
holding the accepted path; its root and accepted columns are committed, and the bonus token is
the one drawn from its column after the last accepted token.

Example: rows r0 = (5, 6, 7), r1 = (5, 8). Trie: 5 (col 1 of r0), 6 (col 2 of r0), 7 (col 3 of
r0), 8 (col 2 of r1). If the target accepts 5 then 8, the chosen row is r1 and the cache gets r1's
columns 0..2 (root, 5, 8); the bonus comes from r1's column 2.

**Greedy.** The trie rule accepts a child iff it is the argmax at its parent, so it follows the
one path of argmaxes as deep as the drafts reach. A row's own greedy prefix (its leading tokens
that match its own argmaxes) is a prefix of that path, so the trie's accepted path is the longest
accepted prefix of any row, and "first row holding it" is the tie rule "first row of maximal
length". The bonus is the argmax after it. This is plain greedy decoding, as for a tree.

**Sampling is exact.** In exact arithmetic a position's logits depend only on the committed
prefix and the tokens before it in its row, so two rows sharing a prefix have *the same*
distributions along it: the D·(1 + L) distributions the batch computes are a function on the
trie's nodes, and the trie with those distributions is exactly the draft tree a tree forward of
the merged rows would produce. The verdict on it matches each node against the target's
position-coupled sample (``llm_worker.verify.verifier``), so the emitted tokens are plain
sampling's. On the fast backend the batch runs as its equivalent tree, so "in exact arithmetic"
holds bit for bit.

What would *not* be exact: a rejection chain per row with its own random draws, keeping the
longest acceptance. That selects the luckiest of D draws and over-weights draft tokens; here
every row meets the same sample at each position.
"""

from __future__ import annotations

import torch

from llm_worker.types import BatchTrie, VerifyResult


def trie_logits(logits: torch.Tensor, trie: BatchTrie) -> torch.Tensor:
    """Per trie row, the batch logits it is read from: [1 + num_nodes, vocab].

    logits: [D, 1 + L, vocab]. Row 0 is the root (column 0 of batch row 0); row i + 1 is node i,
    read at column depth(i) of row ``first_row[i]``.
    """
    rows = torch.tensor((0, *trie.first_row), dtype=torch.long, device=logits.device)  # [1 + num_nodes]
    cols = torch.tensor((0, *trie.tree.depths()), dtype=torch.long, device=logits.device)  # [1 + num_nodes]
    return logits[rows, cols]


def chosen_row(trie: BatchTrie, result: VerifyResult) -> tuple[int, int]:
    """(row, count): the first row holding the accepted path and its columns to commit.

    ``count`` = 1 + accepted tokens (the root's column comes first). Nothing accepted: row 0,
    count 1 (every row starts with the root).
    """
    if not result.accepted:
        return 0, 1
    return trie.first_row[result.accepted[-1]], 1 + len(result.accepted)
