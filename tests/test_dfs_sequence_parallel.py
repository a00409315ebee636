"""dfs with sequence parallelism: the plan's walked shards and each rank's view of the chunks
(single process), and ``verify --dfs-chunk C --sequence-parallel 2`` (SFT and RL; the trainer's 2-rank
runs: ``tests/test_sequence_parallel.py`` and ``tests/test_sequence_parallel_rl.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_tree.engine.dfs_sequence_parallel import ShardedChunks
from ds_tree.losses.sft import Normalisers
from ds_tree.packing.dfs_chunks import row_chunks
from ds_tree.packing.dfs_shards import DfsRowShard, chunk_shard_of
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.plan import PlanSettings, plan_step
from tests.helpers import ROOT
from tests.helpers.launch import environment
from tests.helpers.processes import run_group
from tests.test_sequence_parallel import one_kv_head_model, random_trees
from tests.test_sequence_parallel_rl import TREEPO, write_rl_cases


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


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_walks_sharded_over_two_ranks_for_sft_and_rl(tmp_path: Path) -> None:
    """``tools/verify.py --dfs-chunk 48 --sequence-parallel 2`` itself, twice (2 spawned ranks each, ~10 s):
    SFT in float32 with recompute, GRPO in float64 with the treepo estimator, KL, entropy and dual clip
    (the old and reference policies' no-grad walks and the loss walk, all sharded). stdout is the JSON
    report alone and the exit code says it passed."""
    data = write_rl_cases(tmp_path / "rl.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    common = ["--data", str(data), "--model", str(model), "--dfs-chunk", "48", "--sequence-parallel", "2"]
    sft = run_verify([*common, "--dtype", "float32", "--dfs-recompute"])
    assert sft["passed"] and sft["tolerance"] == 1e-5 and sft["walked_trees"] == 6, sft
    # float32: measured ~5e-7 (gradients); the walk's memory per rank below a single rank's walk
    assert sft["loss_rel_err"] < 1e-5 and sft["max_rel_grad_err"] < 1e-5, sft
    assert 0 < sft["walk_memory_bytes_per_rank"]["2"] < sft["walk_memory_bytes_per_rank"]["1"], sft
    rl = run_verify([*common, "--objective", "grpo", *TREEPO])
    assert rl["passed"] and rl["estimator"] == "treepo" and rl["tolerance"] == 1e-10 and rl["walked_trees"] == 6, rl
    # float64: measured ~3e-15 (gradients), ~2e-15 (loss, old log-probs)
    for error in ("loss_rel_err", "max_rel_grad_err", "max_abs_old_logprob_err", "max_rel_metric_err"):
        assert rl[error] <= 1e-10, (error, rl[error])
    assert rl["old_logprobs_scored"] == rl["trained_tokens"] > 0  # each scored on one shard of one walk
    metrics = rl["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0 and metrics["clip_dual"] > 0, metrics
    assert metrics["kl_ref"] > 0 and metrics["entropy"] > 0, metrics


def run_verify(argv: list[str]) -> dict:
    result = run_group([sys.executable, str(ROOT / "tools/verify.py"), *argv], 300, env=environment())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout)  # the report alone: the ranks' logs and warnings go to stderr
