"""The online loop's step on one rank, whatever a slot samples (prompt trees, :mod:`ds_tree.rollout.online`;
episode trees, :mod:`ds_tree.rollout.multiturn`): docs/RL.md, *Online RL*.

- the step's groups come from ``(rollout.prompt_seed, step)`` as a dataset's groups do
  (:class:`~ds_tree.data.sampler.StepSampler`): ``prompts_per_step`` slots, slot ``j`` sampled by rank
  ``j mod world_size`` (:func:`rank_slots`), with its own ``torch.Generator`` seeded from
  ``(rollout.seed, step, slot)`` (:func:`slot_generator`): the samples are a function of the weights and
  the step only, so a resumed run samples exactly what the uninterrupted run did, with no generator
  state to save, and the result does not depend on the number of ranks;
- the sampling engine (``rollout.engine``, :data:`ds_tree.registries.SAMPLING_ENGINES`) is built before
  the policy (:meth:`StepRollouts.build_model`) and gets the policy's weights at the run's first step and
  every ``rollout.sync_every``-th step that samples with them (:meth:`StepRollouts.begin_step`, a
  collective); with ``rollout.max_staleness > 0`` a background sampler (:mod:`ds_tree.rollout.ahead`)
  samples the rank's slots ahead of training;
- each rank keeps the trajectories of its own slots (:meth:`StepRollouts.step_units`: the step's units, one
  per slot that kept a trajectory, in slot order, each held by the rank that sampled it); the ranks exchange
  only each slot's summary (:class:`SlotSummary`: the figures of the ``rollout/`` metrics, the kept
  trajectories' count, tokens and policy versions), so the metrics are the whole step's, and the trainer's
  per-rank planner sends each group to the rank whose items hold it (:mod:`ds_tree.packing.step_units`). A
  sampling failure on any rank is raised on every rank, and trajectories older than the staleness bound are
  dropped and counted.

What an engine can do is its declared capabilities (:mod:`ds_tree.sampling.interface`), checked at
config time (:func:`check_engine_config`): the loop never asks for an engine by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.data.convert import load_tokenizer
from ds_tree.data.sampler import StepSampler
from ds_tree.errors import ConfigError, DataError
from ds_tree.packing.step_units import HeldUnits, StepData
from ds_tree.registries import SAMPLING_ENGINES, missing_capability
from ds_tree.rollout.ahead import (
    AheadSampler,
    drop_stale,
    sampling_version,
    staleness_bound,
    sync_due,
    version_used,
)
from ds_tree.sampling.interface import EngineError, SamplingEngine
from ds_tree.trees.trajectory import Trajectory


@dataclass
class SlotSummary:
    """What a rank sends the others of one slot it sampled (module docstring)."""

    slot: int
    rank: int
    figures: object
    """The rollout's figures of the slot for the ``rollout/`` metrics (:meth:`StepRollouts.slot_figures`)."""
    kept: int
    """Trajectories kept to train (a reward, fresh enough)."""
    kept_tokens: int
    versions: list[int]
    """The kept trajectories' policy versions."""
    stale: int
    """Trajectories dropped as older than the staleness bound."""


def slot_generator(seed: int, step: int, slot: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one prompt slot of one step: a function of ``(seed, step, slot)`` only."""
    state = np.random.SeedSequence([seed, step, slot]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state))


def rank_slots(n_slots: int, rank: int, world_size: int) -> list[int]:
    """The slots ``rank`` samples: every ``world_size``-th, starting at ``rank``."""
    return list(range(rank, n_slots, world_size))


def raise_any(*failures: str | None, gather: bool = True) -> None:
    """Raise the first failure of any rank on every rank (``gather``: each rank passes its own; a collective)."""
    found = [f for f in failures if f]
    if gather and dist.is_initialized():
        every: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, found[0] if found else None)
        found = [f"rank {rank}: {f}" for rank, f in enumerate(every) if f]
    if found:
        raise EngineError(found[0] + (f" (and {len(found) - 1} more rank(s))" if len(found) > 1 else ""))


def version_scalars(step: int, summaries: list[SlotSummary]) -> dict[str, float]:
    """The kept trajectories' policy versions over every rank's slots, and how many were dropped as stale."""
    versions = [version for summary in summaries for version in summary.versions]
    return {
        "rollout/policy_version": float(np.mean(versions)) if versions else float("nan"),
        "rollout/staleness_max": float(step - min(versions)) if versions else 0.0,
        "rollout/stale_dropped": float(sum(summary.stale for summary in summaries)),
    }


def kept_groups(summaries: list[SlotSummary]) -> int:
    """The step's groups that kept a trajectory to train (one per slot)."""
    return sum(summary.kept > 0 for summary in summaries)


def engine_scalars(engine: SamplingEngine) -> dict[str, float]:
    """The engine's ``rollout/`` metrics over all ranks (a collective where it has any, on every rank alike):
    ``resubmitted_trees`` summed, ``servers_alive`` the fewest any rank samples on."""
    mine = engine.step_scalars()
    if not mine:
        return {}
    every: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    combined = {key: sum(scalars[key] for scalars in every) for key in mine}
    if "rollout/servers_alive" in mine:
        combined["rollout/servers_alive"] = min(scalars["rollout/servers_alive"] for scalars in every)
    return combined


def check_engine_config(config) -> None:
    """What ``rollout.engine`` needs from the config: the sampler's log-probs where training uses them
    (``objective.old_logprobs: data``, ``objective.importance_truncation``), declared by the engine; then
    the engine's own check (a ``vllm`` server's URL or venv, its ``max_model_len``)."""
    rollout, objective = config.rollout, config.objective
    if objective.old_logprobs == "data" or objective.importance_truncation:
        missing = missing_capability(rollout.engine, "logprobs")
        if missing:
            raise ConfigError(
                f"objective.old_logprobs: {objective.old_logprobs} / importance_truncation: "
                f"{objective.importance_truncation} train with the sampler's log-probs, and rollout.engine: "
                f"{rollout.engine} returns none: {missing}"
            )
    SAMPLING_ENGINES.get(rollout.engine).check_config(config)


def run_tokenizer(config):
    """``model.tokenizer`` (a :class:`ConfigError` naming the field if it does not load)."""
    try:
        return load_tokenizer(config.model.tokenizer)
    except DataError as error:
        raise ConfigError(f"model.tokenizer: {error}") from None


class StepRollouts:
    """What every online rollout does on one rank each step (module docstring); a subclass says what a
    slot is: :meth:`sample_share` samples the rank's slots, :meth:`trainable` and :meth:`slot_figures` say what
    a slot trains on and reports."""

    def __init__(self, config, model_config, tokenizer, stop_ids: list[int], groups: int) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        """Where a completion (a turn) ends."""
        self.settings = config.rollout.sampler_settings()
        self.sampler = StepSampler(groups, config.rollout.prompts_per_step, config.rollout.seed)
        """Which of the ``groups`` prompts (tasks) each step samples, slot by slot."""
        self.engine: SamplingEngine | None = None
        """Where groups are sampled (``rollout.engine``), built by :meth:`build_model`."""
        self.scalars: dict[str, float] = {}
        """The ``rollout/`` metrics of the last step sampled."""
        self.start: int | None = None
        """The run's first step (0, or the checkpoint's): the engine starts with that version."""
        self.ahead: AheadSampler | None = None
        """The background sampler of ``rollout.max_staleness > 0`` (:mod:`ds_tree.rollout.ahead`)."""
        self.begun: int | None = None
        """The last step :meth:`begin_step` started (it runs once a step)."""
        self.sync_s = 0.0
        """This step's weight sync time (``rollout/sync_s``; 0 on a step without a sync)."""
        self.wait_s = 0.0
        """This step's wait for the background sampler before its sync."""
        self.synced_at: int | None = None
        """The step whose start weights an evaluation synced into the engine (:meth:`sync_for_eval`)."""

    def build_model(self) -> None:
        """The sampling engine (:meth:`~ds_tree.sampling.interface.SamplingEngine.for_run`), built before the
        policy, outside any ZeRO-3 ``zero.Init``: ``hf``'s generation model (the policy's architecture and
        dtype, its own unpartitioned weights), or a ``vllm`` engine whose server starts at the first sync."""
        self.engine = SAMPLING_ENGINES.get(self.config.rollout.engine).for_run(
            self.config, self.model_config, self.tokenizer
        )

    def warming_up(self, step: int) -> bool:
        """Whether ``step`` (0-based) trains on demonstrations instead of samples (never by default: a
        multi-turn run's warm-up and refresh steps do)."""
        return False

    def samples(self, step: int) -> bool:
        """Whether ``step`` samples (every step but a warm-up's)."""
        return not self.warming_up(step)

    def demonstrations(self, step: int, update: int) -> list[Trajectory]:
        """The SFT trajectories of one update of a warm-up ``step`` (only a rollout that warms up has them)."""
        raise NotImplementedError(f"{type(self).__name__} does not warm up on demonstrations")

    def slot_figures(self, result) -> object:
        """A sampled slot's figures for the ``rollout/`` metrics (small: no tokens)."""
        raise NotImplementedError

    def figure_scalars(self, summaries: list[SlotSummary]) -> dict[str, float]:
        """The ``rollout/`` metrics from every rank's slots' summaries (in rank order)."""
        raise NotImplementedError

    def trainable(self, results: list) -> list[list[Trajectory]]:
        """Per result of this rank, the trajectories it trains on (before the staleness check)."""
        raise NotImplementedError

    def check_groups(self, step: int, results: list, summaries: list[SlotSummary]) -> None:
        """Raise on every rank when too few groups are left to train (``summaries``: every rank's)."""

    def after_sampling(self, step: int, results: list) -> None:
        """Anything to do with this rank's results of ``step`` besides training on them (every rank)."""

    def sample_share(self, step: int, version: int) -> list:
        """This rank's slots of ``step`` sampled with policy ``version`` (no collective: the background
        sampler runs it too)."""
        raise NotImplementedError

    def sync_needed(self, step: int) -> bool:
        """Whether the weights go into the engine as ``step`` starts: the run's first step and every
        ``rollout.sync_every``-th, if a step samples with them (:func:`~ds_tree.rollout.ahead.version_used`:
        a multi-turn run's SFT steps sample nothing, and none samples past the run's end)."""
        rollout = self.config.rollout
        if step != self.start and not sync_due(step, self.start, rollout.sync_every):
            return False
        return version_used(
            step, self.start, rollout.max_staleness, rollout.sync_every, self.config.max_steps, self.samples
        )

    def begin_step(self, step: int, policy: torch.nn.Module) -> None:
        """``step`` starts (every rank; once a step, whether it samples or not): the weight sync when one
        is needed (a collective; with a background sampler, after every step the old weights sample),
        then the background sampler may run ``rollout.max_staleness`` steps ahead."""
        rollout = self.config.rollout
        if self.begun == step:
            return
        self.begun = step
        if self.start is None:
            self.start = step
        self.sync_s, self.wait_s = 0.0, 0.0  # no sync: 0
        if self.sync_needed(step) and self.synced_at != step:  # an evaluation after the last step synced them
            synced = time.perf_counter()
            if self.ahead is not None:  # every step that samples with the old weights is sampled first
                failure = self.ahead.before_sync(step)
                self.wait_s = time.perf_counter() - synced
                raise_any(failure)
            self.engine.sync_weights(policy)  # the first sync starts a server engine
            if self.ahead is not None:
                self.ahead.synced(step)
            self.sync_s = time.perf_counter() - synced - self.wait_s
        if rollout.max_staleness and self.ahead is None:
            self.ahead = AheadSampler(
                self.sample_share, start=self.start, max_staleness=rollout.max_staleness,
                sync_every=rollout.sync_every, end=self.config.max_steps, samples=self.samples,
                join_timeout_s=self.join_timeout_s(),
            )  # fmt: skip
        if self.ahead is not None:
            self.ahead.begin(step)

    def sync_for_eval(self, step: int, policy: torch.nn.Module) -> None:
        """The policy's weights after ``step`` steps into the engine for an evaluation (a collective; docs/EVAL.md):
        the weights step ``step`` starts with, so it skips its own sync. Only with ``rollout.sync_every: 1`` and
        ``max_staleness: 0`` (the config's check), where every step that samples syncs first: the training run
        samples exactly what it would without the evaluation."""
        if self.synced_at != step:
            self.engine.sync_weights(policy)
            self.synced_at = step

    def join_timeout_s(self) -> float:
        """How long closing waits for the background sampler's step to stop (an engine request's bound)."""
        return 5.0

    def own_share(self, step: int, policy: torch.nn.Module) -> tuple[list, float, str | None, float]:
        """This rank's :meth:`sample_share` of ``step`` (sampled now or ahead), its time, its failure, and the
        time training waited for the background sampler."""
        rollout = self.config.rollout
        self.begin_step(step, policy)
        version = sampling_version(step, self.start, rollout.max_staleness, rollout.sync_every)
        started = time.perf_counter()
        failure, waited = None, self.wait_s
        if self.ahead is not None:
            sampled, failure = self.ahead.take(step)
            mine, seconds = (sampled.results, sampled.seconds) if sampled is not None else ([], 0.0)
            waited += time.perf_counter() - started
        else:
            try:
                mine = self.sample_share(step, version)
            except EngineError as error:  # raised on every rank below, not only here (no rank left waiting)
                mine, failure = [], f"{type(error).__name__}: {error}"
            seconds = time.perf_counter() - started
        return mine, seconds, failure, waited

    def step_units(self, step: int, policy: torch.nn.Module) -> StepData:
        """``step``'s units: each rank's slots sampled and scored, kept where they were sampled, their summaries
        exchanged (a collective; module docstring). A sampling failure on any rank is raised on every rank.
        Sets the ``rollout/`` scalars."""
        rollout, rank = self.config.rollout, dist.get_rank()
        mine, seconds, failure, waited = self.own_share(step, policy)
        bound = staleness_bound(rollout.max_staleness, rollout.sync_every)
        kept_by_slot, summaries = {}, []
        for result, trainable in zip(mine, self.trainable(mine), strict=True):
            kept, stale = drop_stale(trainable, step, bound)
            kept_by_slot[result.slot] = kept
            versions = [t.policy_version for t in kept]
            figures = self.slot_figures(result)
            tokens = sum(len(t) for t in kept)
            summaries.append(SlotSummary(result.slot, rank, figures, len(kept), tokens, versions, stale))
        gathered: list[tuple[list[SlotSummary], float, str | None] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (summaries, seconds, failure))
        raise_any(*[f"rank {r}: {failed}" for r, (_, _, failed) in enumerate(gathered) if failed], gather=False)
        every = [summary for share, _, _ in gathered for summary in share]  # rank order
        self.scalars = {
            "rollout/time_s": max(seconds for _, seconds, _ in gathered),  # the slowest rank's
            "rollout/sync_s": self.sync_s,
            **engine_scalars(self.engine),
            **self.figure_scalars(every),
            **version_scalars(step, every),
        }
        if rollout.max_staleness:
            self.scalars["rollout/wait_s"] = waited  # the time this rank's training waited for sampling
        self.check_groups(step, mine, every)
        self.after_sampling(step, mine)
        units = sorted((summary for summary in every if summary.kept), key=lambda summary: summary.slot)
        sizes = np.array([summary.kept_tokens for summary in units], dtype=np.int64)
        held = {unit: kept_by_slot[summary.slot] for unit, summary in enumerate(units) if summary.rank == rank}
        return StepData(HeldUnits(sizes, held), np.array([summary.rank for summary in units], dtype=np.int64))

    def close(self) -> None:
        """Stop the background sampler and the engine (a managed vLLM server); idempotent."""
        if self.ahead is not None:
            self.ahead.close()
        if self.engine is not None:
            self.engine.close()
