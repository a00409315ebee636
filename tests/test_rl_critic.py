"""PPO with a learned critic (``objective.estimator: gae``): the objective's step on trees equals its flat baseline.

The policy-gradient objective prepares a step (the critic's values before the updates, GAE along each path, the
value loss's (path, token) pairs), then each update runs the policy's and the critic's forward and backward by the
runners of the items' kinds. Both models are moved off their state at the preparation (ratios and values leave
their clip ranges), and every update's policy and critic gradients, losses and the step's metrics must equal the
flat layout's in float64: packed trees split into parts, walked trees (dfs), a critic of its own and a value head on
the policy's trunk. Through ``verify``: tests/test_verify_rl.py; under sequence parallelism:
tests/test_sequence_parallel_rl.py (``verify --sequence-parallel 2``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ds_tree.comparison import TOLERANCES, gradient_errors, relative_error
from ds_tree.config import ConfigError, load_config
from ds_tree.data.dataset_reader import LoadedGroups
from ds_tree.data.sampler import StepSampler
from ds_tree.engine.layout import StepLayout
from ds_tree.losses.values import ValuePairs, gae, value_loss
from ds_tree.model_roles.values import TrunkValueHead, load_value_model, policy_trunk
from ds_tree.models.loading import load_model
from ds_tree.objectives.base import StepContext
from ds_tree.registries import OBJECTIVES
from ds_tree.trees.trajectory import Trajectory, group_trajectories
from ds_tree.verify.tree_vs_flat import perturb_parameters
from tests.helpers import ROOT
from tests.helpers.processes import one_rank_group
from tests.helpers.rollouts import rl_trajectories
from tests.helpers.runs import prepare

MODEL = "configs/models/tiny_llama.json"
TOLERANCE = TOLERANCES[torch.float64]
GAE = ["objective.kind=ppo", "objective.estimator=gae", "objective.gamma=0.97", "objective.lam=0.9"]


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """A 1-rank process group: the objectives sum their normalisers and metrics over the ranks."""
    with one_rank_group():
        yield


class PlainUpdates:
    """Each update's ``backward`` as plain autograd, and no optimizer step (the gradients are compared)."""

    @staticmethod
    def backward_for(n_rows: int):
        return torch.Tensor.backward

    @staticmethod
    def apply(step: int, loss: float) -> tuple[float, None]:
        return loss, None


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_gae(mode: str, critic_source: str) -> tuple[list[tuple], dict[str, float], object]:
    """One step of three groups in layout ``mode``: each update's policy loss and gradient, critic loss and
    gradient (both models moved between the preparation and the updates), then the step's metrics."""
    overrides = [*GAE, f"objective.critic.source={critic_source}", "objective.critic.value_clip=0.02"]
    overrides += ["objective.mini_batches=2", "objective.eps_low=0.05", "data.groups_per_step=3"]
    overrides += ["packing.budget=64", f"packing.mode={mode}"] + (["packing.dfs_chunk=16"] if mode == "dfs" else [])
    config = load_config("configs/tiny_cpu.yaml", overrides)
    trajectories = rl_trajectories(seed=1, groups=3, per_group=4)
    model = load_model(MODEL, attention="torch", dtype=torch.float64, seed=0)
    if critic_source == "policy":
        critic = TrunkValueHead(policy_trunk(model), model.config.hidden_size, torch.float64, seed=3)
    else:
        critic = load_value_model(critic_source, attention="torch", dtype=torch.float64, seed=3)
    groups = group_trajectories(trajectories)
    context = StepContext(
        config,
        model,
        PlainUpdates(),
        StepLayout(config, {}, pad_id=0, world_size=1),
        None,
        rank=0,
        groups=LoadedGroups(groups),
        sampler=StepSampler(len(groups), len(groups), seed=0),
    )
    objective = OBJECTIVES.get("ppo")(config)
    objective.check_data(trajectories)
    objective.critic.engine, objective.critic.updates = critic, PlainUpdates()
    prepared = objective.prepare_step(0, context)
    perturb_parameters(model, 0.5, 1)
    perturb_parameters(critic.score if critic_source == "policy" else critic, 0.05, 2)
    results, outputs = [], []
    for update in prepared.updates:
        model.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
        outputs.append(objective.run_update(update, context))
        critic_output = objective.critic.outputs[-1]
        results.append((outputs[-1].loss, gradients(model), critic_output.loss, gradients(critic)))
    losses = [result[0] for result in results]
    return results, objective.step_metrics(prepared, outputs, losses, context), prepared


@pytest.mark.parametrize("critic_source", [MODEL, "policy"])
@pytest.mark.parametrize("mode", ["tree", "dfs"])
def test_gae_with_a_critic_on_trees_equals_the_flat_baseline(mode: str, critic_source: str) -> None:
    flat, flat_scalars, _ = run_gae("flat", critic_source)
    tree, tree_scalars, prepared = run_gae(mode, critic_source)
    kinds = {row.kind for update in prepared.updates for row in update.plan.rows}
    assert kinds == ({"walked"} if mode == "dfs" else {"packed"}), kinds
    if mode == "tree":  # the budget splits trees into parts: prefixes copied, each token owned once
        assert any(row.n_real and len(row.parts) > 1 for update in prepared.updates for row in update.plan.rows)
    assert len(tree) == len(flat) == 2
    for tree_update, flat_update in zip(tree, flat, strict=True):
        for loss, expected in ((tree_update[0], flat_update[0]), (tree_update[2], flat_update[2])):
            assert expected != 0 and relative_error(loss, expected) <= TOLERANCE, (loss, expected)
        for grads, expected in ((tree_update[1], flat_update[1]), (tree_update[3], flat_update[3])):
            assert set(grads) == set(expected) and expected
            worst = max(gradient_errors(expected, grads).values())
            assert worst <= TOLERANCE, worst
    if critic_source == "policy":  # the head alone trains on the value loss
        assert set(flat[0][3]) == {"score.weight", "score.bias"}
    assert set(tree_scalars) == set(flat_scalars)
    for key, value in flat_scalars.items():
        if np.isnan(value):  # the gradient norm: no optimizer step here
            assert np.isnan(tree_scalars[key]), key
            continue
        assert abs(tree_scalars[key] - value) <= TOLERANCE * max(abs(value), 1.0), (key, tree_scalars[key], value)
    assert 0 < flat_scalars["critic/clip_frac"] < 1, flat_scalars  # the value clip acts, on some pairs only
    assert flat_scalars["rl/clip_frac_low"] + flat_scalars["rl/clip_frac_high"] > 0, flat_scalars


def test_gae_by_hand_skips_untrained_tokens_inside_a_path() -> None:
    """Two turns with an environment token between: the chain goes from one trained token to the next."""
    values = np.array([9.0, 0.5, 0.25, 9.0, 1.0])
    mask = np.array([0, 1, 1, 0, 1])
    advantages, returns = gae(values, mask, reward=2.0, gamma=0.5, lam=0.5)
    d4 = 2.0 - 1.0  # last trained token: reward, no next value
    d2 = 0.5 * 1.0 - 0.25  # next trained token is 4, the untrained 3 is skipped
    d1 = 0.5 * 0.25 - 0.5
    expected = {4: d4, 2: d2 + 0.25 * d4, 1: d1 + 0.25 * (d2 + 0.25 * d4)}
    for t, value in expected.items():
        assert advantages[t] == pytest.approx(value, abs=1e-15) and returns[t] == pytest.approx(value + values[t])
    assert advantages[0] == advantages[3] == returns[0] == returns[3] == 0.0


def test_value_clip_counts_only_values_outside_its_range() -> None:
    """Inside the range the clipped term equals the unclipped one but for round-off (0.23 + (0.05 - 0.23) is not
    0.05 in float64): such a pair is not clipped, else the count differs between tree and flat in the last bit."""
    values = torch.tensor([0.05, 0.1], dtype=torch.float64)
    pairs = ValuePairs(np.array([1, 2]), np.array([0, 1]), np.ones(2), np.zeros(2), np.ones(2))  # returns G = 0
    loss, metrics = value_loss(values, np.array([0.23, 0.9]), pairs, np.array([0, 1]), value_clip=0.5)
    assert 0.23 + (0.05 - 0.23) > 0.05  # the round-off the count must not follow
    # the second value moved 0.8 towards its return: the clip holds it at 0.4, the larger term
    assert metrics["value_pairs"] == 2 and metrics["value_clipped"] == 1, metrics
    np.testing.assert_allclose(loss.item(), 0.5 * (0.05**2 + 0.4**2), rtol=1e-15)


def test_gae_lambda_one_is_the_return_minus_the_value() -> None:
    values = np.array([0.0, 0.1, -0.3, 0.7])
    advantages, returns = gae(values, np.array([0, 1, 1, 1]), reward=1.5, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(advantages[1:], 1.5 - values[1:], rtol=0, atol=1e-15)
    np.testing.assert_allclose(returns[1:], 1.5, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["objective.kind=ppo", "objective.estimator=gae"], "estimator gae needs a learned critic"),
        (["objective.kind=ppo", f"objective.critic.source={MODEL}"], r"critic\.source: only with .*estimator gae"),
        (["objective.kind=grpo", "objective.lam=0.5"], r"objective\.lam: only with objective\.estimator gae"),
        (["objective.critic.lr=1e-3"], r"objective\.critic: only with objective\.kind grpo or ppo"),
        ([*GAE, "objective.critic.source=policy", "objective.critic.lr=0"], "lr must be > 0"),
        ([*GAE, "objective.critic.source=policy", "objective.gamma=0"], r"gamma must be in \(0, 1\]"),
    ],
)
def test_bad_critic_settings_are_refused_at_config_time(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny_cpu.yaml", overrides)


def test_gae_estimator_needs_the_critics_values() -> None:
    from ds_tree.losses.advantages import estimate

    trajectory = Trajectory([1, 2, 3], [0, 1, 1], group_id="g", reward=1.0)
    with pytest.raises(ValueError, match="needs the critic's values"):
        estimate([trajectory], "gae")
    computed = estimate([trajectory], "gae", values={id(trajectory): np.zeros(3)}, gamma=1.0, lam=1.0)
    assert computed.values[0].tolist() == [0.0, 1.0, 1.0] and computed.singletons == 0  # no peers needed


def critic_config(tmp_path, **changes) -> str:
    """tiny_llama's config with ``changes``, as a critic's source."""
    config = json.loads((ROOT / MODEL).read_text()) | changes
    path = tmp_path / "critic.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_critic_of_a_smaller_vocabulary_is_refused(tmp_path):
    """The critic embeds the policy's token ids: a vocabulary smaller than the policy's does not fit."""
    overrides = [*GAE, f"objective.critic.source={critic_config(tmp_path, vocab_size=512)}"]
    with pytest.raises(ConfigError, match=r"objective\.critic\.source: .* has a vocabulary of 512 tokens, model\.sou"):
        prepare(ROOT / "configs/tiny_cpu.yaml", *overrides, f"data.path={tmp_path / 'none.jsonl'}")


def test_a_critic_with_another_tokenizer_is_refused(tmp_path, tokenizer_dir):
    from ds_tree.vocab.tokenizer import build_tokenizer

    critic = tmp_path / "critic"
    load_model(MODEL, attention="torch", seed=3).save_pretrained(critic)
    build_tokenizer(512).save_pretrained(critic)  # same model vocabulary (1024), another tokenizer
    overrides = [*GAE, f"objective.critic.source={critic}", f"model.tokenizer={tokenizer_dir}"]
    with pytest.raises(ConfigError, match=r"objective\.critic\.source: the tokenizer of .* is not the policy's"):
        prepare(ROOT / "configs/tiny_cpu.yaml", *overrides, f"data.path={tmp_path / 'none.jsonl'}")


def test_a_critic_whose_heads_do_not_split_under_sequence_parallelism_is_refused(tmp_path):
    from ds_tree.objectives.critic import Critic

    source = critic_config(tmp_path)  # 4 attention heads: not split over 3 ranks
    config = load_config("configs/tiny_cpu.yaml", [*GAE, f"objective.critic.source={source}"])
    config.parallel.sequence_parallel_size = 3
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=3: model\.source .*critic\.json has 4 attention"):
        Critic(config)
