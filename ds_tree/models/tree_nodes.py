"""The node structure of a packed row, as a recurrent (state-space, linear-attention) layer needs it.

A recurrent layer run over a tree is the same layer run per node, each node starting from its
parent's final state (docs/MODELS.md, "Hybrid models"). The packed layout already carries the tree:
``kv_end`` alone (docs/DESIGN.md section 2). The ancestors of token ``k`` are the tokens ``j < k``
with ``kv_end[j] > k`` (the tokens it attends to), so its *path predecessor* — the token before it
on every trajectory through it — is the largest such ``j`` (``-1`` for a root's first token and for
padding). In DFS order these ancestor sets nest, so one stack pass finds every predecessor.

A *node* here is a maximal run of tokens that each continue from the token before them, cut after
every fork (a token that is the predecessor of a token other than its row successor). A chain of
single-child trie nodes is one node (the recurrence does not care), and a split tree part, whose
ancestor path is carried in the same row, is a chain of nodes like any other. Each node has:

- ``parent``: the node holding its first token's predecessor (``-1``: a root, zero initial state);
- ``level``: the number of forks above it. Nodes of one level depend only on nodes of the level
  above, so a layer runs one batched scan per level (:attr:`TreeNodes.levels`): the sequential
  depth is the number of nodes on the deepest root-to-leaf path, not its token count;
- ``history``: the ``width`` tokens before its first token along its root path (nearest last;
  ``-1`` where the path is shorter), the causal convolution's window. A node shorter than the
  window draws on its grandparents: the history follows predecessors, not the parent node.

The structure depends on ``kv_end`` only; :func:`tree_nodes` caches it on the tensor, which every
layer of one forward (and the recomputation of a checkpointed layer) receives as the same object.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

LEVEL_PADDING = 2.0
"""A level's nodes are batched in groups whose padded area stays within this factor of their tokens
(rounded to the scan's chunk): one long node does not pad many short ones to its length."""


@dataclass
class LevelGroup:
    """Nodes of one level scanned together, right-padded to a common length."""

    nodes: np.ndarray
    """Node ids, ``[n]``."""
    tokens: np.ndarray
    """``[n, length]`` row indices of each node's tokens, ``-1`` past a node's end."""
    parent_slot: np.ndarray
    """``[n]`` index of each node's parent among the previous level's nodes (their final states,
    in :attr:`TreeNodes.levels` order), ``-1`` for a root."""


@dataclass
class TreeNodes:
    """A packed row's recurrent nodes (module docstring)."""

    predecessor: np.ndarray
    """``[N]`` path predecessor of every token, ``-1`` for none."""
    start: np.ndarray
    end: np.ndarray
    parent: np.ndarray
    level: np.ndarray
    _levels: dict[int, list[list[LevelGroup]]] = field(default_factory=dict)
    _windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def n_nodes(self) -> int:
        return int(self.start.size)

    @property
    def n_tokens(self) -> int:
        return int(self.predecessor.size)

    def scanned_tokens(self, chunk: int) -> int:
        """Tokens a scan with ``chunk`` runs over, padding included: each group of a level, its nodes times
        its longest node rounded up to the chunk (``ds_tree.scans.linear_scans`` pads to chunk multiples);
        what the memory plan counts per scanned token (:class:`ds_tree.memory.predict.RowNodes`)."""
        return sum(
            len(group.nodes) * -(-group.tokens.shape[1] // chunk) * chunk
            for level in self.levels(chunk)
            for group in level
        )

    def levels(self, chunk: int) -> list[list[LevelGroup]]:
        """Per level, the groups of its nodes for a scan that pads to multiples of ``chunk``."""
        if chunk not in self._levels:
            self._levels[chunk] = _level_groups(self, chunk)
        return self._levels[chunk]

    def history(self, width: int) -> np.ndarray:
        """``[n_nodes, width]``: the ``width`` path tokens before each node's first token, oldest
        first, ``-1`` where the path is shorter."""
        taps = np.empty((self.n_nodes, width), dtype=np.int64)
        current = self.start
        for column in range(width - 1, -1, -1):
            current = np.where(current >= 0, self.predecessor[np.maximum(current, 0)], -1)
            taps[:, column] = current
        return taps

    def conv_layout(self, width: int, device, context: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices that lay the row out for a causal convolution of window ``width + 1``: every node
        preceded by its ``width`` history tokens. ``gather[m]`` is the row token at position ``m``
        of that sequence (``-1``: zero input), ``place[t]`` where row token ``t`` sits in it.

        With ``context`` the row is a dfs chunk whose paths all continue the ``width`` inputs before
        it (its parent chunk's taps, nearest last): a history position beyond the row's own tokens is
        ``-2 - j`` for tap ``j`` instead of ``-1``."""
        key = (width, str(device), context)
        if key not in self._windows:
            node_of = np.repeat(np.arange(self.n_nodes), self.end - self.start)
            place = np.arange(self.n_tokens) + (node_of + 1) * width
            gather = np.full(self.n_tokens + self.n_nodes * width, -1, dtype=np.int64)
            gather[place] = np.arange(self.n_tokens)
            slots = (self.start + np.arange(self.n_nodes) * width)[:, None] + np.arange(width)
            history = self.history(width)
            if context:  # a row of m own path tokens before a node reaches taps m.. for its older columns
                own = (history >= 0).sum(1, keepdims=True)
                history = np.where(history >= 0, history, -2 - (np.arange(width)[None, :] + own))
            gather[slots] = history
            self._windows[key] = (torch.as_tensor(gather, device=device), torch.as_tensor(place, device=device))
        return self._windows[key]


def path_predecessors(kv_end: np.ndarray) -> np.ndarray:
    """``max{j < k : kv_end[j] > k}`` for every ``k`` (``-1`` if none), by one stack pass."""
    ends = kv_end.tolist()
    predecessor = [-1] * len(ends)
    stack: list[int] = []
    for k in range(len(ends)):
        while stack and ends[stack[-1]] <= k:
            stack.pop()
        if stack:
            predecessor[k] = stack[-1]
        stack.append(k)
    return np.asarray(predecessor, dtype=np.int64)


def build_nodes(kv_end: np.ndarray) -> TreeNodes:
    """The :class:`TreeNodes` of one row from its ``kv_end``."""
    kv_end = np.asarray(kv_end, dtype=np.int64)
    n = kv_end.size
    if n == 0:
        raise ValueError("an empty row has no nodes")
    if np.any(kv_end <= np.arange(n)) or np.any(kv_end > n):
        raise ValueError("kv_end must satisfy k < kv_end[k] <= row length for every token k")
    predecessor = path_predecessors(kv_end)
    index = np.arange(n)
    jumps = predecessor != index - 1
    jumps[0] = True  # the row's first token starts a root (its predecessor -1 happens to equal k - 1)
    forks = np.zeros(n, dtype=bool)
    forks[predecessor[jumps & (predecessor >= 0)]] = True
    starts = jumps.copy()
    starts[1:] |= forks[:-1]
    start = np.flatnonzero(starts)
    end = np.append(start[1:], n)
    node_of = np.cumsum(starts) - 1
    first_predecessor = predecessor[start]
    parent = np.where(first_predecessor >= 0, node_of[np.maximum(first_predecessor, 0)], -1)
    level = np.zeros(start.size, dtype=np.int64)
    for node in np.flatnonzero(parent >= 0):  # parents come first in DFS order
        level[node] = level[parent[node]] + 1
    return TreeNodes(predecessor, start, end, parent, level)


def _level_groups(nodes: TreeNodes, chunk: int) -> list[list[LevelGroup]]:
    lengths = nodes.end - nodes.start
    padded = -(-lengths // chunk) * chunk
    levels: list[list[LevelGroup]] = []
    slot_of = np.full(nodes.n_nodes, -1, dtype=np.int64)  # a node's slot among its level's final states
    for level in range(int(nodes.level.max()) + 1):
        members = np.flatnonzero(nodes.level == level)
        members = members[np.argsort(-lengths[members], kind="stable")]
        groups, begin = [], 0
        while begin < members.size:
            stop, longest = begin + 1, padded[members[begin]]
            while stop < members.size and (stop - begin + 1) * longest <= LEVEL_PADDING * (
                padded[members[begin : stop + 1]].sum()
            ):
                stop += 1
            chosen = members[begin:stop]
            width = int(lengths[chosen].max())
            offsets = np.arange(width)
            tokens = np.where(offsets < lengths[chosen][:, None], nodes.start[chosen][:, None] + offsets, -1)
            parents = nodes.parent[chosen]
            groups.append(LevelGroup(chosen, tokens, np.where(parents >= 0, slot_of[np.maximum(parents, 0)], -1)))
            begin = stop
        order = np.concatenate([group.nodes for group in groups])
        slot_of[order] = np.arange(order.size)
        levels.append(groups)
    return levels


@functools.lru_cache(maxsize=32)
def chain_nodes(n: int) -> TreeNodes:
    """The nodes of ``n`` tokens in one causal run (a dfs chain chunk: one node)."""
    return build_nodes(np.full(n, n, dtype=np.int64))


def tree_nodes(kv_end: torch.Tensor) -> TreeNodes:
    """The nodes of a one-row batch's ``kv_end`` (``[1, N]``), cached on the tensor."""
    cached = getattr(kv_end, "_ds_tree_nodes", None)
    if cached is None:
        if kv_end.dim() != 2 or kv_end.shape[0] != 1:
            raise ValueError(f"recurrent tree layers take one packed row (kv_end [1, N]), got {tuple(kv_end.shape)}")
        cached = build_nodes(kv_end[0].cpu().numpy())
        kv_end._ds_tree_nodes = cached
    return cached
