"""How a run lays a step out over its ranks and runs the items, read from the config as it is now (a
check script may change ``packing`` between steps): the plan settings, the dfs walk's settings, each
rank's plan."""

from __future__ import annotations

from dataclasses import dataclass

from ds_tree.config import Config
from ds_tree.engine import dfs
from ds_tree.packing.plan import PlanSettings, RankPlan, plan_step
from ds_tree.trees.trajectory import Trajectory


@dataclass
class StepLayout:
    config: Config
    ds_config: dict
    """The resolved DeepSpeed config (under ZeRO-3 the walks run in lockstep)."""
    pad_id: int
    """The model's padding token."""
    world_size: int

    def plan_settings(self) -> PlanSettings:
        """What the step plan depends on."""
        return PlanSettings.of_config(self.config, pad_id=self.pad_id)

    def dfs_settings(self) -> dfs.DfsSettings | None:
        """How walked items are walked (None: no tree is walked)."""
        packing = self.config.packing
        return dfs.settings_of(packing, self.ds_config) if packing.uses_dfs else None

    def plan(self, trajectories: list[Trajectory], rank: int) -> RankPlan:
        """Rank ``rank``'s items for ``trajectories`` by the whole-step plan (:func:`~ds_tree.packing.plan.plan_step`,
        no process group: checks and tests; the trainer plans with the per-rank planner,
        :meth:`~ds_tree.objectives.base.StepContext.host_step`)."""
        return plan_step(trajectories, self.plan_settings(), self.world_size).for_rank(rank)
