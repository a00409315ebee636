"""Memory modes: activation checkpointing and the chunked LM head change memory, never numbers.

The chunked head (``head_chunk``) gives the unchunked head's log-probs, entropies and gradients
(float64, 1e-12); checkpointed layers really are recomputed, with the tree's ``kv_end`` and
``position_ids`` (tree attention refuses a forward without ``kv_end``); tree mode with either or
both modes still equals the flat baseline without them; the RL objective too; and a 2-rank ZeRO-3
step with both modes on still gives the single-process flat gradient.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.comparison import TOLERANCES, gradient_errors
from ds_tree.config import ConfigError, ModelConfig
from ds_tree.losses.rl import RLSettings
from ds_tree.models import logprobs as logprobs_module
from ds_tree.models.loading import load_model
from ds_tree.models.logprobs import logprobs_and_entropy_at, predicted_tokens
from ds_tree.packing.modes import pack_trajectories
from ds_tree.verify.tree_vs_flat import compare_rl, run_mode
from tests.helpers.configs import write_accumulating_ds_config, write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import torchrun
from tests.helpers.rollouts import rl_trajectories

MODELS = {name: f"configs/models/tiny_{name}.json" for name in ("llama", "qwen2")}  # qwen2 ties its embeddings
EXACT = 1e-12
"""Chunked against unchunked head, float64: the same per-target arithmetic, measured <= 5e-15."""


@functools.cache
def _forest():
    return rl_trajectories(seed=4)


def _model(name: str, checkpoint_every: int = 0):
    return load_model(MODELS[name], attention="torch", dtype=torch.float64, seed=7, checkpoint_every=checkpoint_every)


@pytest.fixture
def chunk_calls(monkeypatch) -> list:
    """Counts the chunks the head runs (forward and recompute), calling the real function."""
    calls = []
    real = logprobs_module._chunk_outputs
    monkeypatch.setattr(logprobs_module, "_chunk_outputs", lambda *args: calls.append(1) or real(*args))
    return calls


def _head(model, row, targets, head_chunk):
    """Log-probs, entropies and the gradient of a loss that weights both unevenly."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = logprobs_and_entropy_at(
        model, row, row.pred_pos[targets], row.input_ids[targets], head_chunk=head_chunk
    )
    weights = torch.linspace(-1.0, 2.0, len(targets), dtype=torch.float64)
    ((weights * logprobs).sum() + (weights.flip(0) * entropy).sum()).backward()
    return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_chunked_head_equals_unchunked(name, chunk_calls):
    model = _model(name)
    row = pack_trajectories(_forest(), "tree", 4096)[0]
    targets = predicted_tokens(row)
    assert len(np.unique(row.pred_pos[targets])) < len(targets)  # fork positions predict several targets
    logprobs, entropy, gradients = _head(model, row, targets, 0)
    assert not chunk_calls
    for head_chunk in (1, 7, len(targets) - 1, 10 * len(targets)):
        chunk_calls.clear()
        chunked = _head(model, row, targets, head_chunk)
        assert len(chunk_calls) == 2 * -(-len(targets) // head_chunk)  # each chunk again in the backward
        np.testing.assert_allclose(chunked[0], logprobs, rtol=0, atol=EXACT)
        np.testing.assert_allclose(chunked[1], entropy, rtol=0, atol=EXACT)
        errors = gradient_errors(gradients, chunked[2])
        assert set(errors) == {n for n, _ in model.named_parameters()}
        assert max(errors.values()) < EXACT, (head_chunk, max(errors.items(), key=lambda item: item[1]))
    nothing = np.zeros(0, dtype=np.int64)  # no target: empty outputs, as unchunked
    assert [t.shape for t in logprobs_and_entropy_at(model, row, nothing, nothing, head_chunk=4)] == [(0,), (0,)]


def test_chunked_head_refuses_transformed_logits(monkeypatch):
    model = _model("llama")
    monkeypatch.setattr(model.config, "logit_scale", 0.5, raising=False)  # Cohere's scaling
    row = pack_trajectories(_forest(), "tree", 4096)[0]
    targets = predicted_tokens(row)
    with pytest.raises(ValueError, match="logit_scale"):
        logprobs_and_entropy_at(model, row, row.pred_pos[targets], row.input_ids[targets], head_chunk=8)
    logprobs_and_entropy_at(model, row, row.pred_pos[targets], row.input_ids[targets], head_chunk=0)


@pytest.mark.parametrize(("every", "recomputed"), [(1, [True, True]), (2, [True, False])])
def test_checkpointed_layers_are_recomputed(every, recomputed):
    """Each checkpointed layer's MLP starts twice per forward and backward, the others once.

    Counted by a pre-hook: the recompute stops once the last saved tensor is made again (torch's
    early stop), inside the MLP, so a post-forward hook would not see it."""
    model = _model("llama", checkpoint_every=every)
    calls = [0] * len(model.model.layers)
    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    row = pack_trajectories(_forest(), "tree", 4096)[0]
    _head(model, row, predicted_tokens(row), 0)
    assert calls == [2 if again else 1 for again in recomputed]


def test_config_memory_modes():
    source = MODELS["llama"]
    assert ModelConfig(source=source, checkpoint_every=3).checkpointed_every == 0
    assert ModelConfig(source=source, activation_checkpointing=True, checkpoint_every=3).checkpointed_every == 3
    for bad in ({"checkpoint_every": 0}, {"head_chunk": -1}):
        with pytest.raises(ConfigError, match="model.checkpoint_every"):
            ModelConfig(source=source, **bad)


@pytest.mark.parametrize(
    ("name", "every", "head_chunk", "budget"),
    [("llama", 1, 0, 64), ("qwen2", 0, 16, 64), ("llama", 2, 5, 4096), ("qwen2", 1, 64, 64)],
)
def test_tree_with_memory_modes_equals_plain_flat(name, every, head_chunk, budget, chunk_calls):
    """Tree mode with the memory modes against the flat baseline without them (float64)."""
    tolerance = TOLERANCES[torch.float64]
    trajectories = _forest()
    plain = run_mode(_model(name), trajectories, "flat", budget, 1, "token_mean", "exact")
    model = _model(name, checkpoint_every=every)
    for mode in ("flat", "tree"):
        result = run_mode(model, trajectories, mode, budget, 1, "token_mean", "exact", head_chunk=head_chunk)
        assert abs(result.loss - plain.loss) <= tolerance * abs(plain.loss)
        assert set(result.logprobs) == set(plain.logprobs)
        for key, expected in plain.logprobs.items():
            np.testing.assert_allclose(result.logprobs[key], expected, rtol=0, atol=tolerance)
        errors = gradient_errors(plain.gradients, result.gradients)
        assert set(errors) == set(plain.gradients) and max(errors.values()) <= tolerance, (mode, errors)
    assert bool(chunk_calls) == (head_chunk > 0)


def test_rl_with_memory_modes(chunk_calls):
    settings = RLSettings(aggregation="seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01)
    plain = compare_rl(_forest(), MODELS["llama"], estimator="rloo", settings=settings, budget=64)
    chunked = compare_rl(
        _forest(), MODELS["llama"], estimator="rloo", settings=settings, budget=64, head_chunk=16, checkpoint_every=1
    )
    assert chunked["passed"], chunked
    assert chunk_calls  # the chunked head ran (old log-probs, reference and loss passes)
    for side in ("loss_flat", "loss_tree"):
        assert abs(chunked[side] - plain[side]) <= EXACT * abs(plain[side]), (side, chunked[side], plain[side])


@pytest.mark.distributed
def test_two_ranks_zero3_with_memory_modes(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "forest.jsonl")
    ds_path = write_accumulating_ds_config(tmp_path / "ds.json", 3)
    config = write_config(tmp_path, data, deepspeed=str(ds_path), packing={"budget": 200})
    out = tmp_path / "report.json"
    overrides = ("model.activation_checkpointing=true", "model.head_chunk=64")
    torchrun("tests/distributed/grad_check.py", "--config", str(config), "--out", str(out), *overrides)
    report = json.loads(out.read_text())
    assert report["zero_stage"] == 3 and report["world_size"] == 2
    assert report["min_micro_batches_per_rank"] >= 2
    # the bounds of test_engine's 2-rank test: float32 round-off against the flat single process
    assert report["max_rel_grad_err"] < 1e-5, report
    assert report["max_rel_param_err"] < 1e-5, report
