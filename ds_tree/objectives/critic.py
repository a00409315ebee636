"""PPO's learned critic through a run (``objective.estimator: gae``, ``objective.critic``; docs/RL.md, "PPO with a
learned critic").

Built once the policy's engine exists (:meth:`Critic.build`): a value model (:mod:`ds_tree.model_roles.values`) in its
own DeepSpeed engine (the policy's DeepSpeed config: ZeRO stage, dtype, partitioned under ``model.zero_init``) with
its own AdamW at ``objective.critic.lr`` and its own :class:`~ds_tree.engine.updates.Updates`. A step:

1. :meth:`Critic.estimate`: before the step's updates (the host work, done ahead, plans the step without
   advantages), a no-grad forward of the critic over this rank's items of every mini-batch, each item's runner
   scoring the trained tokens it owns (a value per tree token), merged per trajectory over the ranks holding its
   group (:func:`merged_over_holders`): GAE (:func:`ds_tree.losses.values.gae`) needs a path's later values, which
   another part, rank or shard may hold; then the advantages of the groups this rank holds and the step's
   statistics (:func:`gae_advantages`);
2. :meth:`Critic.terms`: per item, the value loss's (path, token) pairs with their returns ``G = A + V_old`` and
   coefficients, the old values per target (:class:`~ds_tree.losses.values.ValuePairs`);
3. :meth:`Critic.run_update`, after each policy update: the critic's forward and backward of the same items, each by
   its kind's runner with the value head (:func:`~ds_tree.model_roles.values.values_at`), then its optimizer update.

Every checkpoint carries the critic's engine under :data:`CRITIC_TAG` (module, optimizer and schedule), which a
resumed run loads back, so it continues with the same values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.config import Config
from ds_tree.engine.build import build_engine, model_dtype
from ds_tree.engine.runners import RunContext, StepOutput, add_metrics, run_items
from ds_tree.engine.updates import Updates
from ds_tree.losses.rl import RLSettings
from ds_tree.losses.terms import RowTerms
from ds_tree.losses.values import VALUE_METRICS, ValuePairs, value_loss
from ds_tree.model_roles.values import TrunkValueHead, check_critic, load_value_model, policy_trunk, values_at
from ds_tree.models.ulysses import enable_sequence_parallel
from ds_tree.objectives.base import Components, StepContext, Update
from ds_tree.objectives.rl_rows import (
    StepNormalisers,
    copy_coefficients,
    merged_over_ranks,
    row_token_values,
    trajectory_copies,
    trajectory_scores,
)
from ds_tree.objectives.rl_statistics import (
    AdvantageRule,
    HeldAdvantages,
    HeldGroup,
    Key,
    StepStatistics,
    held_advantages,
    in_step_order,
    step_sums,
)
from ds_tree.packing.exchange import Collectives
from ds_tree.packing.plan import RankPlan
from ds_tree.run import checkpoint
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.weights import predicted_mask

logger = logging.getLogger(__name__)

CRITIC_TAG = "critic"
"""The critic's DeepSpeed checkpoint inside each checkpoint directory (``<checkpoint>/critic/``)."""


@dataclass
class CriticUpdate(Update):
    """A policy update with the critic's share of the same items."""

    critic_terms: list[RowTerms] = field(default_factory=list)
    """The value loss of each item, in ``plan.rows`` order."""
    step: int = 0
    """The 1-based step the update belongs to (the critic's update's error messages)."""


def critic_terms(pairs: ValuePairs, old_values: np.ndarray, value_clip: float) -> RowTerms:
    """The value loss's share of one item (:func:`~ds_tree.losses.values.value_loss`): a sum over its targets'
    pairs, so any runner may score its targets in pieces."""

    def loss(values: torch.Tensor, entropy, select: np.ndarray):
        return value_loss(values, old_values, pairs, select, value_clip)

    return RowTerms(pairs.targets, loss)


def critic_values(
    model, trajectories: list[Trajectory], rows, run: RunContext, merged: bool = True
) -> dict[int, np.ndarray]:
    """``id(trajectory) -> the value of ``model`` (a value model) at each of its trained tokens``, NaN elsewhere:
    each rank's items score the trained tokens they own, no gradients, merged over the ranks (``merged``; False:
    ``rows`` hold every trajectory, scored by this process alone)."""
    scores = trajectory_scores(model, trajectories, rows, run, trained_only=True)
    scores = merged_over_ranks(scores) if merged else scores
    return {id(t): v for t, v in zip(trajectories, scores, strict=True)}


def value_item_terms(
    rows,
    normalisers: StepNormalisers,
    returns: dict[int, np.ndarray],
    values: dict[int, np.ndarray],
    settings: RLSettings,
    value_clip: float,
) -> list[RowTerms]:
    """The value loss of each of ``rows`` (one update's items; ``normalisers``: its mini-batch's, which the
    coefficients take), with the old values ``values`` and the returns ``returns`` per trajectory."""
    terms = []
    for row in rows:
        pairs = item_pairs(row, returns, settings, normalisers)
        old = row_token_values(row.n_tokens, trajectory_copies(row), values)[pairs.targets]
        terms.append(critic_terms(pairs, old, value_clip))
    return terms


def item_pairs(row, returns: dict[int, np.ndarray], settings: RLSettings, normalisers: StepNormalisers) -> ValuePairs:
    """The (path, trained token) pairs of ``row``'s owned tokens, each with its return and the policy loss's
    coefficient (:func:`~ds_tree.losses.rl.trajectory_coefficients` of the update's normalisers)."""
    copies = trajectory_copies(row)
    coefficients = copy_coefficients(copies, settings, normalisers)
    return ValuePairs.of_row(
        row.owned,
        [path for _, path in copies],
        coefficients,
        [returns[id(t)] for t, _ in copies],
        [t.loss_mask for t, _ in copies],
    )


def returns_of(
    trajectories: list[Trajectory], advantages: dict[int, np.ndarray], values: dict[int, np.ndarray]
) -> dict[int, np.ndarray]:
    """``G = A + V_old`` at each trajectory's trained tokens (0 elsewhere): the value loss's targets."""
    return {id(t): np.where(_trained(t), advantages[id(t)] + np.nan_to_num(values[id(t)]), 0.0) for t in trajectories}


def value_statistics(
    trajectories: list[Trajectory], values: dict[int, np.ndarray], returns: dict[int, np.ndarray]
) -> dict[str, float]:
    """``critic/value_mean`` and ``critic/explained_variance`` over the step's (trajectory, trained token) pairs,
    as the flat batch counts them: the mean value, and ``1 - Var(G - V) / Var(G)`` (NaN when the returns are
    constant)."""
    trained = [_trained(t) for t in trajectories]
    v = np.concatenate([np.zeros(0)] + [values[id(t)][m] for t, m in zip(trajectories, trained, strict=True)])
    g = np.concatenate([np.zeros(0)] + [returns[id(t)][m] for t, m in zip(trajectories, trained, strict=True)])
    if v.size == 0:
        return {"critic/value_mean": float("nan"), "critic/explained_variance": float("nan")}
    spread = g.var()
    explained = 1.0 - (g - v).var() / spread if spread > 0 else float("nan")
    return {"critic/value_mean": float(v.mean()), "critic/explained_variance": float(explained)}


def step_value_statistics(
    counted: list[tuple[Key, list[Trajectory], list[np.ndarray]]],
    values: dict[int, np.ndarray],
    returns: dict[int, np.ndarray],
    comm: Collectives | None = None,
) -> dict[str, float]:
    """:func:`value_statistics` of the whole step from the groups each rank counts
    (:attr:`~ds_tree.objectives.rl_statistics.HeldAdvantages.counted`): per trajectory its trained tokens' count
    and sums of ``V``, ``G`` and ``G - V`` gathered in step order, then its squared deviations from the step's
    means (two gathers of a few numbers a trajectory, as :func:`~ds_tree.objectives.rl_statistics.step_sums`)."""
    comm = comm or Collectives()
    pairs = {
        key: [(values[id(t)][m], returns[id(t)][m]) for t in group for m in [_trained(t)]] for key, group, _ in counted
    }
    sums = {key: [(v.size, v.sum(), g.sum(), (g - v).sum()) for v, g in paths] for key, paths in pairs.items()}
    terms = np.array([x for _, group in in_step_order(comm, sums) for x in group] or np.zeros((0, 4)))
    count = terms[:, 0].sum()
    if count == 0:
        return {"critic/value_mean": float("nan"), "critic/explained_variance": float("nan")}
    mean_v, mean_g, mean_d = (terms[:, 1:].sum(axis=0) / count).tolist()
    squares = {
        key: [(((g - mean_g) ** 2).sum(), ((g - v - mean_d) ** 2).sum()) for v, g in paths]
        for key, paths in pairs.items()
    }
    spread_g, spread_d = np.array([x for _, group in in_step_order(comm, squares) for x in group]).sum(axis=0)
    explained = 1.0 - spread_d / spread_g if spread_g > 0 else float("nan")
    return {"critic/value_mean": float(mean_v), "critic/explained_variance": float(explained)}


def place_in_step(trajectories: list[Trajectory]) -> list[tuple[str | int, int]]:
    """Each trajectory's place in the step, the same on every rank for its copies: its group id and its index
    among the group's trajectories (a group's trajectories come in step order wherever they are held)."""
    seen: dict[str | int, int] = {}
    places = []
    for trajectory in trajectories:
        index = seen.get(trajectory.group_id, 0)
        places.append((trajectory.group_id, index))
        seen[trajectory.group_id] = index + 1
    return places


def merged_over_holders(
    groups: list[HeldGroup], scores: dict[int, np.ndarray], comm: Collectives
) -> dict[tuple[str | int, int], np.ndarray]:
    """Every held trajectory's values by its :func:`place_in_step`, each token's from the one rank whose item
    scored it (NaN on the others): a group's parts may lie on several ranks (its shards on a sequence-parallel
    group), so each rank sends its groups' values and keeps each known entry."""
    mine = {}
    for group in groups:
        for place, trajectory in zip(place_in_step(group.trajectories), group.trajectories, strict=True):
            mine[place] = scores[id(trajectory)]
    merged: dict[tuple[str | int, int], np.ndarray] = {}
    for sent in comm.all_gather(mine):
        for place, array in sent.items():
            if place not in merged:
                merged[place] = array.copy()
                continue
            known = ~np.isnan(array)
            merged[place][known] = array[known]
    return merged


@dataclass
class Estimated:
    """``gae``'s advantages of a step (:meth:`Critic.estimate`)."""

    values: dict[int, np.ndarray]
    """``id(trajectory) -> the critic's value at each trained token`` of the held and the sample's trajectories."""
    held: HeldAdvantages
    statistics: StepStatistics
    sample_advantages: dict[int, np.ndarray]


def gae_advantages(
    groups: list[HeldGroup],
    scores: dict[int, np.ndarray],
    sample: list[list[Trajectory]],
    rule: AdvantageRule,
    mini_batches: int,
    comm: Collectives,
) -> Estimated:
    """``gae``'s advantages of the groups this rank holds and of the self-check's ``sample`` groups, and the step's
    statistics (:func:`~ds_tree.objectives.rl_statistics.step_sums`), from ``scores``: ``id(trajectory) -> the
    critic's values`` where this rank's items scored them (NaN elsewhere), merged over the ranks per group
    (:func:`merged_over_holders`) before GAE runs along each path."""
    merged = merged_over_holders(groups, scores, comm)
    values = {}
    for group in [*(g.trajectories for g in groups), *sample]:
        values.update((id(t), merged[place]) for t, place in zip(group, place_in_step(group), strict=True))
    rule = replace(rule, values=values)
    held = held_advantages(groups, rule, comm)
    _, statistics = step_sums(held, mini_batches, comm)
    sample_advantages = {}
    for group in sample:  # the step's whitening too (held.rule's)
        sample_advantages.update(zip(map(id, group), held.rule.of(group), strict=True))
    return Estimated(values, held, statistics, sample_advantages)


def _trained(trajectory: Trajectory) -> np.ndarray:
    return predicted_mask(trajectory.loss_mask) != 0


class Critic:
    """The critic of one run (module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        if self.enabled and not config.objective.critic.on_policy_trunk:
            check_critic(config)  # before any model is built
        self.engine = None
        """The critic's DeepSpeed engine; None without ``estimator: gae``, or a plain module (tests, ``verify``)."""
        self.updates: Updates | None = None
        """The critic's optimizer updates (its own, the policy's non-finite policy)."""
        self.outputs: list[StepOutput] = []
        """This step's critic updates' outputs (their global losses in :attr:`losses`)."""
        self.losses: list[float] = []
        self.grad_norm: float | None = None
        """The last critic update's gradient norm."""

    @property
    def enabled(self) -> bool:
        return self.config.objective.is_rl and self.config.objective.estimator == "gae"

    # ------------------------------------------------------------------ building and checkpoints
    def build(self, components: Components) -> None:
        """The critic's model and engine, on every rank (``components.policy``: the policy's engine)."""
        if not self.enabled:
            return
        model = self.model(components)
        self.engine = build_engine(model, self.config, components.ds_config, lr=self.config.objective.critic.lr)
        directory = Path(self.config.output_dir) / "checkpoints"
        self.updates = Updates(self.engine, self.config.optimizer.non_finite, directory)

    def model(self, components: Components) -> torch.nn.Module:
        """The value model (:mod:`ds_tree.model_roles.values`): a head on the policy's trunk, or a model of its own,
        built partitioned under ``model.zero_init`` (the policy's ``HfDeepSpeedConfig`` made current again)."""
        config = self.config
        settings = config.objective.critic
        dtype = model_dtype(config)
        if settings.on_policy_trunk:
            text = components.policy.module.config.get_text_config()
            return TrunkValueHead(policy_trunk(components.policy), text.hidden_size, dtype, config.model.seed)
        holder = None
        if config.model.zero_init:
            from transformers.integrations import HfDeepSpeedConfig

            holder = HfDeepSpeedConfig(components.ds_config)
        try:
            model = load_value_model(
                settings.source,
                attention=config.model.attention,
                dtype=dtype,
                seed=config.model.seed,
                checkpoint_every=config.model.checkpointed_every,
                recurrent_kernels=config.model.recurrent_kernels,
            )
        finally:
            if holder is not None and components.hf_deepspeed_config is not None:
                from transformers.integrations.deepspeed import set_hf_deepspeed_config

                set_hf_deepspeed_config(components.hf_deepspeed_config)
        if config.parallel.sequence_parallel_size > 1:  # it scores the same shards as the policy
            enable_sequence_parallel(model.scorer, config.parallel.sequence_parallel_size)
        return model

    def check_resumable(self, path: Path, step: int) -> None:
        """Checkpoint ``path`` of ``step`` holds the critic (found at the dry run)."""
        if self.enabled and not (path / CRITIC_TAG).is_dir():
            raise checkpoint.CheckpointError(
                f"{path} holds no {CRITIC_TAG}/: objective.estimator gae trains a critic, and this checkpoint of step "
                f"{step} was saved without one (by a run with another estimator?). Resume from a checkpoint of a gae "
                "run, or start a new run (checkpoint.resume: never)"
            )

    def save(self, path: Path, step: int) -> None:
        """The critic's engine into checkpoint directory ``path`` (every rank)."""
        if self.engine is not None:
            self.engine.save_checkpoint(str(path), tag=CRITIC_TAG, client_state={"step": step}, save_latest=False)

    def load(self, path: Path, step: int) -> None:
        """The critic's engine back from checkpoint ``path`` (every rank), its files verified with the checkpoint's."""
        if self.engine is None:
            return
        self.check_resumable(path, step)
        with checkpoint.weights_only_loads():
            self.engine.load_checkpoint(str(path), tag=CRITIC_TAG)

    # ------------------------------------------------------------------ a step
    def run_context(self, context: StepContext) -> RunContext:
        """How the critic's items run: the policy's layout (its dfs walks), the value head."""
        device = getattr(self.engine, "device", context.policy.device)
        return RunContext(device, 0, context.layout.dfs_settings(), head=values_at)

    def estimate(
        self,
        groups: list[HeldGroup],
        plans: list[RankPlan],
        sample: list[list[Trajectory]],
        rule: AdvantageRule,
        context: StepContext,
    ) -> Estimated:
        """The step's GAE advantages (module docstring): the critic's values at the trained tokens of this rank's
        items of every plan, no grad, then :func:`gae_advantages` (collectives)."""
        self.outputs, self.losses, self.grad_norm = [], [], None
        held = [t for group in groups for t in group.trajectories]
        rows = [row for plan in plans for row in plan.rows]
        scores = trajectory_scores(self.engine, held, rows, self.run_context(context), trained_only=True)
        scored = dict(zip(map(id, held), scores, strict=True))
        return gae_advantages(groups, scored, sample, rule, self.config.objective.mini_batches, Collectives())

    def terms(
        self,
        plan: RankPlan,
        normalisers: StepNormalisers,
        returns: dict[int, np.ndarray],
        values: dict[int, np.ndarray],
        settings: RLSettings,
    ) -> list[RowTerms]:
        """The value loss of each of ``plan``'s items (``normalisers``: its mini-batch's, over the ranks)."""
        clip = self.config.objective.critic.value_clip
        return value_item_terms(plan.rows, normalisers, returns, values, settings, clip)

    def run_update(self, update: CriticUpdate, context: StepContext) -> None:
        """The critic's forward and backward of ``update``'s items, then its optimizer update."""
        run = self.run_context(context)
        output = run_items(self.engine, update.plan.rows, update.critic_terms, run, self.updates.backward_for)
        loss, self.grad_norm = self.updates.apply(update.step, output.loss)
        self.outputs.append(output)
        self.losses.append(loss)

    def step_metrics(self, statistics: dict[str, float]) -> dict[str, float]:
        """``critic/`` scalars of the step (every rank alike: the metric sums are all-reduced)."""
        metrics = None
        for output in self.outputs:
            if output.metrics is not None:
                metrics = add_metrics(metrics, output.metrics)
        sums = torch.tensor([(metrics or {}).get(name, 0.0) for name in VALUE_METRICS], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(sums)
        totals = dict(zip(VALUE_METRICS, sums.tolist(), strict=True))
        pairs = totals["value_pairs"]
        return {
            "critic/loss": float(np.mean(self.losses)) if self.losses else float("nan"),
            "critic/clip_frac": totals["value_clipped"] / pairs if pairs else 0.0,
            "critic/grad_norm": self.grad_norm if self.grad_norm is not None else float("nan"),
            **statistics,
        }
