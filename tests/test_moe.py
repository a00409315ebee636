"""Mixture-of-experts: float64 routing and the router load-balancing loss, tree vs flat (ds_tree/models/moe.py).

The aux loss is per trajectory, so the tree must weight each shared token's router statistics by
the trajectories through it. Tree and flat must agree on its value and on every gradient in
float64, whole and split; its value must be transformers' own ``load_balancing_loss_func`` on each
trajectory alone; and counting each tree token once instead must fail.
"""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from ds_tree.comparison import gradient_errors
from ds_tree.config import ConfigError, load_config
from ds_tree.engine.dfs import DfsSettings
from ds_tree.models.loading import load_model
from ds_tree.models.moe import RouterAuxLoss, router_modules
from ds_tree.trees.random_trees import TreeShape, random_forest
from ds_tree.verify.tree_vs_flat import run_mode
from tests.test_engine import launch_training, prepare, write_config, write_forest

EXACT = 1e-10
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    num_experts_per_tok=2,
)
MODELS = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=16),
    "mixtral": dict(model_type="mixtral", num_local_experts=4),
}


@functools.cache
def _model(name: str, directory: str):
    source = f"{directory}/{name}.json"
    with open(source, "w") as handle:
        json.dump({**BASE, **MODELS[name]}, handle)
    return load_model(source, attention="torch", dtype=torch.float64, seed=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("moe"))
    return lambda name: _model(name, directory)


@pytest.fixture(scope="module")
def forest():
    shape = TreeShape(trees=2, depth=3, children=(1, 3), node_tokens=(1, 5), alphabet=(3, 127), duplicates=0.2)
    return random_forest(random.Random(3), shape)


def _run(model, forest, mode, budget, coefficient=1.0, dfs=None):
    aux = RouterAuxLoss.of_model(model, coefficient, sum(len(t) for t in forest))
    return run_mode(model, forest, mode, budget, 1, "token_mean", "exact", router_aux=aux, dfs=dfs)


def _gate_names(model):
    return [name for name, _ in model.named_parameters() if name.endswith("gate.weight")]


@pytest.mark.parametrize("name", list(MODELS))
def test_float64_routing(name, models):
    model = models(name)
    assert model.config._experts_implementation == "eager"  # grouped_mm refuses float64
    routers = router_modules(model)
    assert len(routers) == 2
    _, scores, _ = routers[0](torch.randn(3, 32, dtype=torch.float64))
    assert scores.dtype == torch.float64  # transformers' routers compute (Mixtral: return) float32


@pytest.mark.parametrize("name", list(MODELS))
def test_router_aux_loss_tree_equals_flat(name, models, forest):
    model = models(name)
    flat = _run(model, forest, "flat", 4096)
    assert flat.router_aux > 1.0  # E * sum_e f_e P_e: K = 2 when balanced, more when not
    for budget in (4096, 16):  # whole trees, then parts carrying their ancestor paths
        tree = _run(model, forest, "tree", budget)
        assert abs(tree.router_aux - flat.router_aux) <= EXACT * flat.router_aux
        assert abs(tree.loss - flat.loss) <= EXACT * abs(flat.loss)
        errors = gradient_errors(flat.gradients, tree.gradients)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= EXACT, (budget, worst, errors[worst])

    # the aux loss reaches the router gradients (not only the next-token loss's share of them)
    without = _run(model, forest, "flat", 4096, coefficient=0.0)
    assert without.router_aux == pytest.approx(flat.router_aux, rel=EXACT)
    assert flat.loss - without.loss == pytest.approx(flat.router_aux, rel=1e-9)
    for gate in _gate_names(model):
        assert (flat.gradients[gate] - without.gradients[gate]).norm() > 0.1 * flat.gradients[gate].norm()

    # transformers' own loss on each trajectory alone, token-weighted (its accumulators are float32)
    expected = 0.0
    for trajectory in forest:
        with torch.no_grad():
            output = model(
                input_ids=torch.as_tensor(trajectory.input_ids)[None],
                kv_end=torch.tensor([[len(trajectory)] * len(trajectory)]),
                output_router_logits=True,
            )
        aux = load_balancing_loss_func(output.router_logits, 4, 2)
        expected += len(trajectory) * float(aux) / sum(len(t) for t in forest)
    assert flat.router_aux == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("dfs", [DfsSettings(2), DfsSettings(1, recompute=True), DfsSettings(64)])
def test_router_aux_loss_walked_equals_flat(models, forest, dfs):
    """dfs mode: each chunk adds its tokens' share once the walk leaves it (every trajectory through
    it forwarded by then): value, loss and every gradient as flat, in chunks that cut nodes, a token
    at a time with recompute, and whole nodes."""
    model = models("qwen3_moe")
    flat = _run(model, forest, "flat", 4096)
    walked = _run(model, forest, "dfs", 4096, dfs=dfs)
    assert abs(walked.router_aux - flat.router_aux) <= EXACT * flat.router_aux
    assert abs(walked.loss - flat.loss) <= EXACT * abs(flat.loss)
    errors = gradient_errors(flat.gradients, walked.gradients)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= EXACT, (worst, errors[worst])


def test_counting_each_tree_token_once_fails(models, forest, monkeypatch):
    """The mutation the multiplicity weighting guards against: a shared token's statistics once."""
    model = models("qwen3_moe")
    flat = _run(model, forest, "flat", 4096)

    def once(self, counts, row):
        weights = torch.zeros_like(counts)
        for _, _, path in row.trajectory_paths():
            index = torch.as_tensor(path)
            weights[index] = counts[index].sum(0) / len(path)  # the last trajectory through a token wins
        return weights

    monkeypatch.setattr(RouterAuxLoss, "trajectory_weights", once)
    tree = _run(model, forest, "tree", 4096)
    assert abs(tree.router_aux - flat.router_aux) > 1e-3 * flat.router_aux
    assert max(gradient_errors(flat.gradients, tree.gradients)[gate] for gate in _gate_names(model)) > 1e-4


def test_coefficient_config(tmp_path):
    data = write_forest(tmp_path / "forest.jsonl", groups=2)
    assert load_config(write_config(tmp_path, data)).model.router_aux_loss_coef is None
    config = write_config(tmp_path, data, model={"router_aux_loss_coef": "1e-3"})
    assert load_config(config).model.router_aux_loss_coef == 1e-3
    with pytest.raises(ConfigError, match=r"model.router_aux_loss_coef must be >= 0"):
        load_config(write_config(tmp_path, data, model={"router_aux_loss_coef": -1}))
    with pytest.raises(ConfigError, match=r"model.router_aux_loss_coef must be float"):
        load_config(write_config(tmp_path, data, model={"router_aux_loss_coef": "much"}))
    rl = write_config(tmp_path, data, model={"router_aux_loss_coef": 0.01}, objective={"kind": "grpo"})
    with pytest.raises(ConfigError, match=r"model.router_aux_loss_coef: .* SFT objective only"):
        prepare(rl)


@pytest.mark.distributed
def test_two_rank_training_logs_the_flat_router_aux_loss(tmp_path):
    """A 2-rank ZeRO-3 step of tiny Qwen3-MoE logs loss/router_aux, and its loss and aux loss are the
    single-process flat baseline's (float32)."""
    data = write_forest(tmp_path / "forest.jsonl", groups=4)
    source = "configs/models/tiny_qwen3_moe.json"
    model_section = {"source": source, "router_aux_loss_coef": 0.5}
    config = write_config(tmp_path, data, model=model_section, packing={"budget": 300})
    process = launch_training(config)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the first step's self-check ran its gradients with ZeRO-3's leaf-module (MoE block) hooks taken off
    assert "self-check step 1: tree vs flat" in output and "max gradient rel err" in output, output[-4000:]
    assert record["selfcheck/max_grad_rel_err"] < 1e-5

    trainer = prepare(config, f"output_dir={tmp_path / 'plan'}")
    trajectories = [t for g in trainer.sampler.groups_for_step(0) for t in trainer.groups[g]]
    model = load_model(source, attention="torch", seed=trainer.config.model.seed)
    aux = RouterAuxLoss.of_model(model, 0.5, sum(len(t) for t in trajectories))
    flat = run_mode(model, trajectories, "flat", 4096, 1, "token_mean", "exact", router_aux=aux)
    assert record["loss/router_aux"] == pytest.approx(flat.router_aux, rel=1e-5)
    assert record["loss/train"] == pytest.approx(flat.loss, rel=1e-5)
