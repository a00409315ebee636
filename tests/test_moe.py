"""Mixture-of-experts: float64 routing and the router load-balancing loss, tree vs flat (ds_tree/models/moe.py).

The aux loss is per trajectory, so the tree must weight each shared token's router statistics by
the trajectories through it. Tree and flat must agree on its value and on every gradient in
float64, whole and split; its value must be transformers' own ``load_balancing_loss_func`` on each
trajectory alone; and counting each tree token once instead must fail. With an RL objective the same
term is added to the clipped objective (docs/RL.md): tree, walk and flat agree on Qwen3-MoE and the
hybrid Qwen3-Next, and the tree equals an oracle built on stock transformers, one trajectory at a time.
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
from ds_tree.losses.advantages import estimate
from ds_tree.losses.rl import RLSettings, trajectory_coefficients
from ds_tree.models.loading import keep_norms_in_float64, load_model
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.moe import RouterAuxLoss, router_modules, use_float64_routing
from ds_tree.trees.random_trees import TreeShape, random_forest
from ds_tree.verify.tree_vs_flat import compare_rl, rl_policies, run_mode, run_rl_mode
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import launch_training
from tests.helpers.rollouts import rl_trajectories
from tests.helpers.runs import prepare
from tests.test_rl_engine import write_rollouts

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
    source = "configs/models/tiny_qwen3_moe.json"  # RL objectives add the loss too (no longer refused)
    rollouts = write_rollouts(tmp_path / "rollouts.jsonl")
    model = {"source": source, "router_aux_loss_coef": 0.01}
    rl = write_config(tmp_path, rollouts, model=model, objective={"kind": "grpo"})
    assert prepare(rl, f"output_dir={tmp_path / 'rl'}").config.model.router_aux_loss_coef == 0.01
    walked = ["packing.mode=dfs", "parallel.sequence_parallel_size=2", f"output_dir={tmp_path / 'walked'}"]
    assert prepare(rl, *walked, world_size=2).layout.dfs_settings() is not None  # sharded walks too (no longer refused)


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


# ------------------------------------------------------------------------------------------ RL
RL_MODELS = {"qwen3_moe": "configs/models/tiny_qwen3_moe.json", "qwen3_next": "configs/models/tiny_qwen3_next.json"}


@pytest.mark.parametrize("name", list(RL_MODELS))
def test_rl_router_aux_loss_tree_and_walk_equal_flat(name):
    """GRPO with the router loss (float64, the trained policy moved off the old one): split tree parts and
    a walk in chunks of 16 tokens give the flat loss, router loss, metrics and every gradient."""
    report = compare_rl(rl_trajectories(), RL_MODELS[name], budget=64, router_aux_loss_coef=0.5, dfs=DfsSettings(16))
    assert report["passed"] and report["rows_tree"] > 1 and report["router_aux_loss_coef"] == 0.5, report
    assert report["router_aux_flat"] > 1.0  # E * sum_e f_e P_e: K = 2 when balanced
    metrics = report["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0, metrics
    # float64: measured 0 to 6e-15
    for error in ("loss_rel_err", "router_aux_rel_err", "max_rel_grad_err", "dfs_loss_rel_err"):
        assert report[error] <= EXACT, (error, report)
    for error in ("dfs_router_aux_rel_err", "dfs_max_rel_grad_err"):
        assert report[error] <= EXACT, (error, report)
    if name == "qwen3_moe":  # the term is in the loss: with coefficient 0 the loss drops by 0.5 * aux
        without = compare_rl(rl_trajectories(), RL_MODELS[name], budget=64, router_aux_loss_coef=0.0)
        assert report["loss_flat"] - without["loss_flat"] == pytest.approx(0.5 * report["router_aux_flat"], rel=1e-9)


def _stock_model(source: str, weights: torch.nn.Module) -> torch.nn.Module:
    """transformers' own model class with SDPA attention (its eager one takes the softmax in float32) and
    ``weights``' parameters, in float64 throughout: its RMSNorms' and routers' float32 casts lifted
    (:func:`keep_norms_in_float64`, :func:`use_float64_routing`), the only changes to its code."""
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_config(load_model_config(source), attn_implementation="sdpa")
    stock = stock.to(torch.float64)
    stock.load_state_dict(weights.state_dict())
    keep_norms_in_float64(stock)
    use_float64_routing(stock)
    return stock


def _per_trajectory_aux(router_logits, experts: int, top_k: int) -> torch.Tensor:
    """``E * sum_e f_e P_e`` of one sequence (docs/MODELS.md), in float64: ``f`` the top-k counts and ``P`` the
    router probabilities, each summed over layers and tokens and divided by ``L |i|``."""
    probabilities = torch.stack([torch.softmax(logits, dim=-1) for logits in router_logits])  # [L, T, E]
    chosen = torch.topk(probabilities, top_k, dim=-1).indices
    counts = torch.nn.functional.one_hot(chosen, experts).sum(-2).to(probabilities.dtype)
    scale = probabilities.shape[0] * probabilities.shape[1]
    return experts * ((counts.sum((0, 1)) / scale) * (probabilities.sum((0, 1)) / scale)).sum()


def test_rl_router_aux_loss_equals_a_stock_transformers_oracle():
    """The tree's GRPO loss with the router loss and its gradients equal an oracle on stock transformers
    (Qwen3-MoE, SDPA attention, one trajectory at a time, float64): per trajectory the clipped objective
    of its own forward's log-probs, plus ``coefficient * |i| / N_flat`` times its load-balancing loss from
    the router logits that forward returns (transformers' ``load_balancing_loss_func`` to its float32
    accumulators)."""
    source, coefficient = RL_MODELS["qwen3_moe"], 0.5
    trajectories = rl_trajectories(seed=2)
    settings = RLSettings(eps_low=0.1, eps_high=0.2)
    old, model = rl_policies(source, "torch", torch.float64, 0, 0.5)
    advantages = estimate(trajectories, "grpo", False)
    flat_tokens = sum(len(t) for t in trajectories)
    aux = RouterAuxLoss.of_model(model, coefficient, flat_tokens)
    tree = run_rl_mode(
        model, old, None, trajectories, "tree", 64, 1, advantages.by_trajectory(), settings, router_aux=aux
    )
    assert tree.rows > 1

    stock_old, stock = _stock_model(source, old), _stock_model(source, model)
    experts, top_k = aux.num_experts, aux.top_k
    trained = [t.trained_tokens for t in trajectories]
    total, sequences = sum(trained), sum(n > 0 for n in trained)
    loss, clipped = torch.zeros((), dtype=torch.float64), 0
    for trajectory, advantage in zip(trajectories, advantages.values, strict=True):
        ids = torch.as_tensor(trajectory.input_ids)[None]
        with torch.no_grad():
            logits_old = stock_old(input_ids=ids, use_cache=False).logits[0, :-1]
        output = stock(input_ids=ids, use_cache=False, output_router_logits=True)
        logp = torch.log_softmax(output.logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        logp_old = torch.log_softmax(logits_old, -1).gather(-1, ids[0, 1:, None])[:, 0]
        c = torch.as_tensor(
            trajectory_coefficients(trajectory.loss_mask, settings.aggregation, total_tokens=total, sequences=sequences)
        )[1:]
        a = torch.as_tensor(advantage[1:])
        ratio = torch.exp(logp - logp_old)
        bounded = torch.clamp(ratio, 1 - settings.eps_low, 1 + settings.eps_high)
        clipped += int(((bounded != ratio) & (c != 0)).sum())
        loss = loss - (c * torch.minimum(ratio * a, bounded * a)).sum()
        router = _per_trajectory_aux(output.router_logits, experts, top_k)
        with torch.no_grad():  # the definition is transformers' function on this trajectory alone
            assert float(router) == pytest.approx(
                float(load_balancing_loss_func(output.router_logits, experts, top_k)), rel=1e-6
            )
        loss = loss + coefficient * len(trajectory) / flat_tokens * router
    loss.backward()
    assert clipped > 0  # the clip is exercised

    loss = float(loss.detach())
    assert abs(tree.loss - loss) <= EXACT * abs(loss), (tree.loss, loss)
    expected = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
    errors = gradient_errors(expected, tree.gradients)
    worst = max(errors, key=errors.get)
    assert set(errors) == set(expected) and errors[worst] <= EXACT, (worst, errors[worst])
    assert all(expected[gate].norm() > 0 for gate in _gate_names(stock))


@pytest.mark.distributed
def test_two_rank_grpo_training_adds_the_flat_router_aux_loss(tmp_path):
    """A 2-rank ZeRO-3 GRPO step of tiny Qwen3-MoE with the router loss and the self-check on: the step's
    router loss and loss (one update, so at the initial weights, ratio 1) are the single-process flat
    baseline's (float32), and the self-check (both sides with the router loss) passes."""
    data = write_rollouts(tmp_path / "rollouts.jsonl")
    source = "configs/models/tiny_qwen3_moe.json"
    model_section = {"source": source, "router_aux_loss_coef": 0.5}
    objective = {"kind": "grpo", "self_check": "first"}
    config = write_config(tmp_path, data, model=model_section, objective=objective, packing={"budget": 200})
    process = launch_training(config)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "self-check step 1: tree vs flat" in output, output[-4000:]
    assert record["selfcheck/max_grad_rel_err"] < 1e-5 and record["selfcheck/loss_rel_err"] < 1e-5, record

    trainer = prepare(config, f"output_dir={tmp_path / 'plan'}")
    trajectories = [t for g in trainer.sampler.groups_for_step(0) for t in trainer.groups[g]]
    settings = trainer.config.objective
    advantages = estimate(trajectories, settings.estimator, settings.normalise_advantages).by_trajectory()
    model = load_model(source, attention="torch", seed=trainer.config.model.seed)
    aux = RouterAuxLoss.of_model(model, 0.5, sum(len(t) for t in trajectories))
    flat = run_rl_mode(
        model, model, None, trajectories, "flat", 4096, 1, advantages, settings.rl_settings(), router_aux=aux
    )
    assert flat.router_aux > 1.0
    assert record["loss/router_aux"] == pytest.approx(flat.router_aux, rel=1e-5)
    assert record["loss/train"] == pytest.approx(flat.loss, rel=1e-5)
