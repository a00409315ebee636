"""The dfs walk's chunks (ds_tree/packing/dfs_chunks.py): packed subtrees below one parent token, chains above.

Structure on random forests (every token in one chunk of at most ``chunk`` tokens; a chunk's context,
its ancestor chunks' tokens, is exactly the path to its parent token; only chains have children;
about ``tokens / chunk`` calls), and float64 exactness against the flat baseline on the shapes the
chunker cuts differently: a bushy tree of many short nodes in one chunk, a node longer than the
chunk, and a sibling set cut between two chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds_tree.comparison import gradient_errors
from ds_tree.engine.dfs import DfsSettings, WalkStats
from ds_tree.packing.dfs_chunks import Chunks, row_chunks
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.random_trees import TreeShape
from ds_tree.trees.trajectory import Trajectory
from tests.test_dfs import EXACT, _flat, _masked, _model, _walked, forest


def check_chunks(row: PackedRow, chunks: Chunks, chunk: int) -> None:
    n = row.n_real
    assert sorted(chunks.order.tolist()) == list(range(n))
    with_children = set(chunks.parent[chunks.parent >= 0].tolist())
    for index in range(len(chunks)):
        tokens = chunks.tokens(index)
        assert 0 < tokens.size <= chunk and np.all(np.diff(tokens) > 0)
        parent_token = int(row.pred_pos[tokens[0]])
        inside = np.isin(row.pred_pos[tokens], tokens)
        assert np.all(inside | (row.pred_pos[tokens] == parent_token))  # subtrees below one token
        ancestors, parent = [], int(chunks.parent[index])
        while parent >= 0:
            ancestors.extend(chunks.tokens(parent).tolist())
            parent = int(chunks.parent[parent])
        k = np.arange(n)
        path = k[(k <= parent_token) & (row.kv_end[:n] > parent_token)] if parent_token >= 0 else k[:0]
        assert sorted(ancestors) == path.tolist()  # the cached context is exactly the parent token's path
        if index in with_children:  # a chain: held while its children run
            assert np.all(row.pred_pos[tokens[1:]] == tokens[:-1])
        local = chunks.local(tokens)
        assert local.tolist() == list(range(tokens.size)) and np.all(chunks.of_tokens(tokens) == index)


@pytest.mark.parametrize("chunk", [1, 7, 40, 1000])
def test_chunks_are_subtrees_below_one_path(chunk: int) -> None:
    for seed in range(4):
        trajectories = forest(TreeShape(1, 4, (0, 4), (1, 12), prefixes=0.3, duplicates=0.2), seed, groups=1)
        (row,) = pack_trajectories(trajectories, "dfs", 10_000)
        chunks = row_chunks(row, chunk)
        check_chunks(row, chunks, chunk)
        if chunk >= row.n_real:
            assert len(chunks) == 1  # a tree within the chunk is one call


def test_bushy_tree_is_about_tokens_over_chunk_calls() -> None:
    """Many short nodes (the old chunks, runs of one node chain, made a call per node). Bound: every
    packed chunk but one per sibling set is over half full (first-fit decreasing), and a sibling set
    hangs below each chain chunk (one per node whose subtree is over the chunk: no node is longer)."""
    trajectories = forest(TreeShape(1, 5, (3, 4), (1, 6)), seed=3, groups=1)
    (row,) = pack_trajectories(trajectories, "dfs", 10_000)
    n = row.n_real
    nodes = int(np.sum(row.pred_pos[:n] != np.arange(n) - 1))
    for chunk in (32, 64, 128):
        chunks = row_chunks(row, chunk)
        big = [t for t in range(n) if row.kv_end[t] - t > chunk and (t == 0 or row.pred_pos[t] != t - 1)]
        assert nodes > 100 and n > 4 * chunk
        assert len(chunks) <= 2 * -(-n // chunk) + 2 * len(big) + 1, (chunk, len(chunks), n, len(big))
        assert len(chunks) < nodes / 3


def _tokens(*paths: list[int]) -> list[Trajectory]:
    return [Trajectory(np.array(p), np.ones(len(p)), group_id="g", source=f"g/{i}") for i, p in enumerate(paths)]


def _shapes() -> dict[str, tuple[list[Trajectory], int]]:
    rng = np.random.default_rng(11)

    def ids(n: int) -> list[int]:
        return rng.integers(3, 1000, n).tolist()

    stem = ids(5)
    long_node = ids(23)
    siblings = [stem + ids(4) + tail for tail in ([], ids(3), ids(2))] + [stem + ids(n) for n in (3, 4, 5, 2, 6)]
    return {
        # 12 short nodes and a root: with chunk 40 the whole tree is one call
        "bushy, one chunk": (forest(TreeShape(1, 3, (3, 3), (1, 3)), seed=5, groups=1), 40),
        # a 23-token node with three children, chunk 6: a chain of 6-token calls, children packed
        "node longer than the chunk": (_tokens(long_node + ids(3), long_node + ids(4), long_node + ids(2) + ids(2)), 6),
        # six siblings below a 5-token stem (one with children), 37 tokens below it, chunk 12:
        # the sibling set is cut between packed chunks
        "chunk boundary in a sibling set": (_tokens(*siblings), 12),
    }


@pytest.mark.parametrize("case", list(_shapes()))
def test_new_chunk_shapes_equal_flat_float64(case: str) -> None:
    trajectories, chunk = _shapes()[case]
    trajectories = _masked(trajectories, seed=len(case))
    (row,) = pack_trajectories(trajectories, "dfs", 10_000)
    chunks = row_chunks(row, chunk)
    check_chunks(row, chunks, chunk)
    parents = chunks.parent.tolist()
    if case.startswith("bushy"):
        assert len(chunks) == 1 and row.n_real > 10
    elif case.startswith("node longer"):
        assert chunks.size(0) == chunk and parents[:4] == [-1, 0, 1, 2]  # the long node cut into a chain
    else:  # two packed chunks below the stem's chain share its last token as parent
        below = [i for i, p in enumerate(parents) if p == 0]
        assert sum(chunks.local_kv_end(row, i) is not None for i in below) >= 2  # each several subtrees
    model = _model("llama")
    flat_loss, flat_gradients, normalisers = _flat(model, trajectories, "token_mean")
    for recompute in (False, True):
        stats = WalkStats()
        loss, gradients = _walked(model, [row], normalisers, "token_mean", DfsSettings(chunk, recompute), stats)
        assert stats.chunks == len(chunks)
        assert abs(loss - flat_loss) <= EXACT * abs(flat_loss), (recompute, loss, flat_loss)
        errors = gradient_errors(flat_gradients, gradients)
        assert max(errors.values()) < EXACT, (recompute, max(errors.items(), key=lambda item: item[1]))


def test_packed_chunk_mask_is_the_rows() -> None:
    """A packed chunk's own mask is the row's tree mask restricted to its tokens (``kv_end`` in its indices)."""
    trajectories, chunk = _shapes()["chunk boundary in a sibling set"]
    (row,) = pack_trajectories(trajectories, "dfs", 10_000)
    chunks = row_chunks(row, chunk)
    for index in range(len(chunks)):
        tokens = chunks.tokens(index)
        local = chunks.local_kv_end(row, index)
        local = np.full(tokens.size, tokens.size) if local is None else local
        q, k = np.meshgrid(np.arange(tokens.size), np.arange(tokens.size), indexing="ij")
        own = (k <= q) & (q < local[k])
        rq, rk = tokens[q], tokens[k]
        assert np.array_equal(own, (rk <= rq) & (rq < row.kv_end[rk]))


def test_random_forest_walks_equal_flat_float64() -> None:
    """Random bushy forests walked with chunks smaller than a tree: packed and chain chunks mixed."""
    trajectories = _masked(forest(TreeShape(1, 4, (1, 3), (1, 10), prefixes=0.3), seed=21, groups=2), seed=2)
    rows = pack_trajectories(trajectories, "dfs", 10_000)
    model = _model("llama")
    flat_loss, flat_gradients, normalisers = _flat(model, trajectories, "sequence_mean")
    chunks = [row_chunks(row, 16) for row in rows]
    assert any(c.local_kv_end(r, i) is not None for r, c in zip(rows, chunks, strict=True) for i in range(len(c)))
    assert any((c.parent >= 0).any() for c in chunks)
    loss, gradients = _walked(model, rows, normalisers, "sequence_mean", DfsSettings(16))
    assert abs(loss - flat_loss) <= EXACT * abs(flat_loss)
    assert max(gradient_errors(flat_gradients, gradients).values()) < EXACT
