"""dfs with sequence parallelism: the plan's walked shards and each rank's view of the chunks
(single process; the sharded walk itself: ``tests/test_sequence_parallel.py``, the 2-rank run and verify)."""

from __future__ import annotations

import numpy as np
import pytest

from ds_tree.engine.dfs_sequence_parallel import ShardedChunks
from ds_tree.losses.sft import Normalisers
from ds_tree.packing.dfs_chunks import row_chunks
from ds_tree.packing.dfs_shards import DfsRowShard, chunk_shard_of
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.plan import PlanSettings, plan_step
from tests.test_sequence_parallel import random_trees


@pytest.mark.parametrize("chunk", [7, 48, 10**6])
def test_walked_shards_hold_each_term_once_and_follow_the_walks_chunks(chunk: int) -> None:
    trajectories, _ = random_trees(3)
    world, size = 4, 2
    settings = PlanSettings(mode="dfs", budget=256, sequence_parallel_size=size, dfs_chunk=chunk)
    plan = plan_step(trajectories, settings, world)
    rows = [row for items in plan.ranks for row in items]
    assert rows and all(isinstance(row, DfsRowShard) and row.chunk == chunk for row in rows)
    # Ranks of a group walk the same trees; the two groups share the trees out.
    for group in (0, 2):
        first, second = plan.ranks[group], plan.ranks[group + 1]
        assert [r.input_ids.tolist() for r in first] == [r.input_ids.tolist() for r in second]
        assert [r.position for r in first + second] == [0] * len(first) + [1] * len(second)
    assert plan.ranks[0] and plan.ranks[2]
    whole = pack_trajectories(trajectories, "tree", 10**6)
    assert Normalisers.from_rows(rows).as_tensor().tolist() == pytest.approx(
        Normalisers.from_rows(whole).as_tensor().tolist(), rel=1e-12
    )
    for first, second in zip(plan.ranks[0], plan.ranks[1], strict=True):
        chunks = row_chunks(first, chunk)
        shard_of = chunk_shard_of(chunks, first.n_tokens, size)
        assert set(np.unique(shard_of).tolist()) <= {0, 1}
        views = [ShardedChunks(chunks, size, position, group=None) for position in range(size)]
        targets = np.flatnonzero(first.mask_sum + second.mask_sum)
        predictors = first.pred_pos[targets]
        # Each weighted target is on the shard that forwards its predictor, there at a shard-local index.
        for shard, view in zip((first, second), views, strict=True):
            mine = targets[shard.mask_sum[targets] > 0]
            here = view.of_tokens(shard.pred_pos[mine])
            np.testing.assert_array_equal(here, chunks.of_tokens(shard.pred_pos[mine]))
            local = view.local(shard.pred_pos[mine])
            assert np.all((local >= 0) & (local < view.length[here]))
        assert np.all(sum(view.of_tokens(predictors) >= 0 for view in views) == 1)
        for index in range(len(chunks)):
            inputs = [view.chunk_inputs(first, index, None) for view in views]
            joined = np.concatenate([i.input_ids for i in inputs])
            n = chunks.size(index)
            assert joined.size == size * views[0].length[index] and joined.size - n < size
            np.testing.assert_array_equal(joined[:n], first.input_ids[chunks.tokens(index)])
            kv_end = inputs[0].shards.kv_end
            if kv_end is not None:  # padding sees only itself
                np.testing.assert_array_equal(kv_end[0, n:].numpy(), np.arange(n + 1, joined.size + 1))
