"""The dfs mode on sliding windows and attention soft-capping: walked trees equal flat, in float64.

The model matrix's windowed entries (tests/test_model_matrix.py: window 4; Gemma 2 with an attention
cap of 1 that a wide init reaches) walk trees whose paths are several windows long, in chunks
shorter and longer than the window, so the window cuts into the cached ancestors and into the chunk
itself. Loss and every parameter's gradient must equal the flat baseline's to 1e-10 relative.
"""

from __future__ import annotations

import json

import pytest
import torch

from ds_tree.attention.cached import PathCache
from ds_tree.comparison import gradient_errors
from ds_tree.engine.dfs import DfsSettings, chunk_attention
from ds_tree.models.loading import load_model
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.random_trees import TreeShape
from tests.test_dfs import EXACT, _flat, _masked, _walked, comb, forest
from tests.test_model_matrix import BASE, MODELS, WINDOW

WINDOWED = ["mistral", "qwen2_sliding", "gemma2", "gemma3"]
CHUNKS = (3, 7)
"""Chunk sizes below and above the window."""
assert min(CHUNKS) < WINDOW < max(CHUNKS)


def _load(tmp_path_factory, name: str):
    source = tmp_path_factory.mktemp(name) / "model.json"
    source.write_text(json.dumps({**BASE, **MODELS[name], "vocab_size": 1024}))  # the forests' token ids
    return load_model(source, attention="reference", dtype=torch.float64, seed=7)


@pytest.fixture(scope="module")
def trajectories():
    walked = _masked(forest(TreeShape(1, 3, (1, 3), (2, 7), prefixes=0.3), seed=11), seed=3)
    walked += comb(teeth=5, step=3, seed=12)  # a short branch every 3 tokens along a 15-token stem
    assert max(len(t) for t in walked) > 3 * WINDOW  # the window cuts every long path
    return walked


@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_and_capped_models_walk_exactly(name, tmp_path_factory, trajectories):
    model = _load(tmp_path_factory, name)
    assert model.config.sliding_window == WINDOW
    if name == "gemma2":
        assert model.config.attn_logit_softcapping == 1.0
    flat_loss, flat_gradients, normalisers = _flat(model, trajectories, "token_mean")
    rows = pack_trajectories(trajectories, "dfs", 10_000)
    for chunk in CHUNKS:
        for recompute in (False, True) if chunk == min(CHUNKS) else (False,):
            settings = DfsSettings(chunk, recompute)
            loss, gradients = _walked(model, rows, normalisers, "token_mean", settings)
            assert abs(loss - flat_loss) <= EXACT * abs(flat_loss), (chunk, recompute, loss, flat_loss)
            errors = gradient_errors(flat_gradients, gradients)
            worst = max(errors, key=errors.get)
            assert errors[worst] < EXACT, (chunk, recompute, worst, errors[worst])
            assert set(gradients) == set(flat_gradients)


def test_window_needs_depths_that_continue_the_path(tmp_path_factory):
    """The window rule reads the chunk's depths: they must follow its cached ancestors'."""
    model = _load(tmp_path_factory, "mistral")
    cache = PathCache()
    ids = torch.tensor([[5, 6, 7]])
    with chunk_attention(model), torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(3)[None], path_cache=cache)
        cache.ancestors.append(cache.take_recorded())
        model(input_ids=ids[:, :2], position_ids=torch.tensor([[3, 4]]), path_cache=cache)  # continues: fine
        with pytest.raises(ValueError, match="position_ids must continue"):
            model(input_ids=ids[:, :2], position_ids=torch.tensor([[0, 1]]), path_cache=cache)
