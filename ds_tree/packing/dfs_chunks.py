"""The dfs walk's chunks: how a walked row is cut into model calls (docs/DESIGN.md section 5).

A chunk is a set of a row's tokens forwarded at once on its ancestors' cached keys and values
(:mod:`ds_tree.engine.dfs`). Every chunk hangs below one *parent token* (a root's chunk below none):
its tokens are subtrees below that token, and its context, the cached keys and values, is the path
from the root to that token inclusive, which its parent chunk and the parent chunk's ancestors hold
and every token of the chunk sees. The chunks are of two shapes:

- a *chain* chunk: up to ``chunk`` consecutive tokens of one node chain (a node and, when it has one
  child, that child, ...) starting at a token whose subtree is over ``chunk`` tokens. Its children
  hang below its last token. Only chain chunks have children, so the graphs the walk holds while
  a chunk runs (its ancestors', waiting for their backward) are pieces of one root-to-leaf path;
- a *packed* chunk: whole subtrees of at most ``chunk`` tokens each, all below one parent token,
  bin-packed first-fit decreasing into chunks of at most ``chunk`` tokens (so a set of siblings may
  be cut between two chunks), laid out in row (DFS) order and masked with their ``kv_end`` as a
  packed row is. It has no children: it is forwarded and backwarded at once.

The chunker is greedy top-down: below a parent token, each child subtree of at most ``chunk`` tokens
goes into a packed chunk, and each larger one starts a chain chunk (its node cut every ``chunk``
tokens, as a long node always was) whose last token's children are placed the same way. A tree of
at most ``chunk`` tokens is one call; a bushy tree of ``T`` tokens about ``T / chunk`` calls plus one
per node whose subtree is over ``chunk`` tokens; a chain of ``P`` tokens ``P / chunk`` calls. Memory:
the held graphs and the cache follow one root-to-leaf path (the chain chunks above), plus one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_tree.packing.bins import first_fit_decreasing
from ds_tree.packing.rows import PackedRow


@dataclass
class Chunks:
    """A row's chunks: chunk ``i`` is the row tokens ``order[start[i]:end[i]]`` (ascending), below chunk
    ``parent[i]`` (``-1``: below no token). A parent comes before its children."""

    start: np.ndarray
    end: np.ndarray
    parent: np.ndarray
    order: np.ndarray
    """Row indices of the real tokens, chunk by chunk."""

    def __post_init__(self) -> None:
        n = self.order.size
        self.position = np.empty(n, dtype=np.int64)
        """Where each row token is in ``order``."""
        self.position[self.order] = np.arange(n)
        self.chunk_of = np.repeat(np.arange(len(self)), self.end - self.start)
        """The chunk of each position of ``order``."""

    def __len__(self) -> int:
        return int(self.start.size)

    def tokens(self, index: int) -> np.ndarray:
        """Row indices of chunk ``index``'s tokens, ascending."""
        return self.order[self.start[index] : self.end[index]]

    def size(self, index: int) -> int:
        return int(self.end[index] - self.start[index])

    def of_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """The chunk holding each of ``tokens`` (row indices)."""
        return self.chunk_of[self.position[tokens]]

    def local(self, tokens: np.ndarray) -> np.ndarray:
        """Each of ``tokens``' index inside its chunk's inputs."""
        positions = self.position[tokens]
        return positions - self.start[self.chunk_of[positions]]

    def local_kv_end(self, row: PackedRow, index: int) -> np.ndarray | None:
        """``kv_end`` of chunk ``index``'s tokens in its own indices (query ``q`` sees its key ``k`` iff
        ``k <= q < kv_end[k]``); None where that is plain causal attention (a chain chunk)."""
        tokens = self.tokens(index)
        local = np.searchsorted(tokens, row.kv_end[tokens], side="left")
        return None if bool((local == tokens.size).all()) else local


def row_chunks(row: PackedRow, chunk: int) -> Chunks:
    """The chunks of the real tokens of ``row`` (module docstring) of at most ``chunk`` tokens each."""
    if chunk < 1:
        raise ValueError(f"the dfs chunk size must be >= 1, got {chunk}")
    n = row.n_real
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Chunks(empty, empty, empty, empty)
    tokens = np.arange(n)
    pred_pos, subtree_end = row.pred_pos[:n], np.minimum(row.kv_end[:n], n)
    # A token continues the chain of the token before it when that one predicts it and both have the
    # same subtree end (the same node, or a node's only child).
    continues = np.zeros(n, dtype=bool)
    continues[1:] = (pred_pos[1:] == tokens[1:] - 1) & (subtree_end[1:] == subtree_end[:-1])
    chain_end = _chain_ends(continues)
    by_parent = np.argsort(pred_pos, kind="stable")  # tokens grouped by the token predicting them
    bounds = np.searchsorted(pred_pos[by_parent], np.arange(-1, n + 1))  # children of t: bounds[t+1]..bounds[t+2]

    def children(token: int) -> np.ndarray:
        return by_parent[bounds[token + 1] : bounds[token + 2]]

    pieces: list[np.ndarray] = []
    parents: list[int] = []
    pending = [(-1, children(-1))]  # (parent chunk, first tokens of the subtrees below one token)
    while pending:
        parent, starts = pending.pop()
        sizes = subtree_end[starts] - starts
        small = starts[sizes <= chunk]
        for members in first_fit_decreasing((subtree_end[small] - small).tolist(), chunk):
            pieces.append(np.concatenate([np.arange(small[i], subtree_end[small[i]]) for i in members]))
            parents.append(parent)
        for first in starts[sizes > chunk]:
            last = min(first + chunk, chain_end[first]) - 1
            pieces.append(np.arange(first, last + 1))
            parents.append(parent)
            pending.append((len(pieces) - 1, children(last)))
    return _ordered(pieces, parents)


def _chain_ends(continues: np.ndarray) -> np.ndarray:
    """For each token, the end (exclusive) of the run of continuing tokens it belongs to."""
    n = continues.size
    breaks = np.flatnonzero(~continues)  # first tokens of chains
    ends = np.append(breaks[1:], n)
    return np.repeat(ends, np.diff(np.append(breaks, n)))


def _ordered(pieces: list[np.ndarray], parents: list[int]) -> Chunks:
    """Chunks sorted by their first token (a parent's first token precedes its children's)."""
    rank = sorted(range(len(pieces)), key=lambda i: int(pieces[i][0]))
    new_index = np.empty(len(pieces), dtype=np.int64)
    new_index[rank] = np.arange(len(pieces))
    sizes = np.array([pieces[i].size for i in rank], dtype=np.int64)
    end = np.cumsum(sizes)
    parent = np.array([new_index[parents[i]] if parents[i] >= 0 else -1 for i in rank], dtype=np.int64)
    return Chunks(end - sizes, end, parent, np.concatenate([pieces[i] for i in rank]).astype(np.int64))
