"""The scale simulator: a step's host work on each of ``W`` ranks, one rank at a time (``ds-tree plan --host``).

For step ``STEP`` of ``data.path`` with the config's ``data.groups_per_step`` and packing, every simulated rank
does what it does in a run (:mod:`ds_tree.packing.distributed`): it reads and summarises its share of the
step's groups; the summaries are gathered (a list here, one ``all_gather_object`` in a run); then each rank
balances them and reads and builds its own items. Each rank's two phases are timed (reads included: a
converted dataset is read lazily, :class:`~ds_tree.data.dataset_reader.TreeDatasetReader`; a tokens JSONL is
loaded whole first, untimed), beside today's whole-step :func:`~ds_tree.packing.plan.plan_step` on one rank.
Times are the process's CPU seconds (``time.process_time``): on a machine shared with other work, wall time
counts the time the simulator waits for a core (measured 2x-5x on a 2-core machine at load 10), CPU time does
not; on an idle machine the two agree for this single-threaded work. With ``repeat > 1`` the whole simulation
runs again and each figure is its minimum over the runs (the first run pays the allocator's first touch of
fresh memory).

The figures (:func:`simulate_host`):

- ``per_rank_seconds_max``: the slowest rank's host work; ``global_seconds``: ``plan_step`` of the step;
- ``balance`` and ``global_balance``: max / mean of the ranks' predicted costs, new plan and today's;
- ``exchange_bytes``: the pickled summaries of all ranks, what the all-gather delivers to every rank;
- ``dataset_bytes_per_rank``: the most that one rank reads of the step's data (its summary share and its
  items' groups; Arrow bytes of a converted dataset, numpy bytes of trajectories in memory);
  ``global_dataset_bytes_per_rank``: the whole step's, what every rank holds today;
- ``bytes_per_rank_max``: the most that one rank receives per step, its exchange plus its data.

And were the step's groups online rollouts, each held by the rank that sampled it (group ``g`` on rank
``g mod W``, as slots are dealt, :func:`~ds_tree.rollout.loop.rank_slots`):

- ``rollout_bytes_per_rank_max``: the most that one rank receives, its exchange plus the pickled groups its
  items need from the ranks that hold them (:mod:`ds_tree.packing.step_units`);
- ``rollout_all_gather_bytes_per_rank``: what each rank received before, the whole step's trajectories pickled
  (an ``all_gather_object`` of every rank's share).
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import numpy as np

from ds_tree.data import load_trajectories
from ds_tree.data.dataset_reader import DatasetGroups, TreeDatasetReader
from ds_tree.data.sampler import StepSampler
from ds_tree.packing.distributed import GroupUnits, RankPlanner, StepUnits
from ds_tree.packing.plan import PlanSettings, balance, plan_step
from ds_tree.trees.trajectory import group_trajectories


def step_units(path: str | Path, groups_per_step: int, seed: int, step: int) -> StepUnits:
    """The groups of ``step`` of the data at ``path``: read lazily from a converted dataset, else loaded whole."""
    path = Path(path)
    if path.is_dir():
        reader = TreeDatasetReader(path)
        return DatasetGroups(reader, StepSampler(reader.n_groups, groups_per_step, seed).groups_for_step(step))
    groups = group_trajectories(load_trajectories(path))
    rows = StepSampler(len(groups), groups_per_step, seed).groups_for_step(step)
    return GroupUnits.of_step([t for row in rows for t in groups[row]])


def _timed(function, *args):
    """``function(*args)`` and the CPU seconds it took (module docstring: why CPU time)."""
    started = time.process_time()
    result = function(*args)
    return result, time.process_time() - started


def simulate_host(units: StepUnits, settings: PlanSettings, world_size: int, repeat: int = 1) -> dict:
    """The ``host`` figures (module docstring) of one step's ``units`` on ``world_size`` simulated ranks."""
    every = list(range(len(units.sizes())))
    trajectories = [t for group in units.read(every) for t in group]
    global_seconds = []
    for _ in range(repeat):
        plan, seconds = _timed(plan_step, trajectories, settings, world_size)
        global_seconds.append(seconds)
        global_balance = balance(plan.rank_costs())
        del plan
    count = len(trajectories)
    del trajectories  # a rank never holds the whole step
    needed = _units_needed(units, settings, world_size)
    pickled = [len(pickle.dumps(group, protocol=5)) for group in units.read(every)]  # a group as it travels
    runs = [_ranks_once(units, settings, world_size, needed) for _ in range(repeat)]
    seconds = np.min([run["seconds"] for run in runs], axis=0)  # per rank, its fastest run
    first = runs[0]
    dataset_bytes = first["dataset_bytes"]
    return {
        "world_size": world_size,
        "groups": len(every),
        "trajectories": count,
        "flat_tokens": first["flat_tokens"],
        "tree_tokens": first["tree_tokens"],
        "parts": first["parts"],
        "repeat": repeat,
        "clock": "cpu",
        "per_rank_seconds_max": float(seconds.max()),
        "per_rank_seconds_mean": float(seconds.mean()),
        "summarise_seconds_max": float(np.min([run["summarise"] for run in runs], axis=0).max()),
        "materialise_seconds_max": float(np.min([run["materialise"] for run in runs], axis=0).max()),
        "global_seconds": float(min(global_seconds)),
        "speedup": float(min(global_seconds) / seconds.max()),
        "balance": first["balance"],
        "global_balance": global_balance,
        "exchange_bytes": first["exchange_bytes"],
        "dataset_bytes_per_rank": int(max(dataset_bytes)),
        "global_dataset_bytes_per_rank": units.nbytes(every),
        "bytes_per_rank_max": int(first["exchange_bytes"] + max(dataset_bytes)),
        "rollout_bytes_per_rank_max": int(first["exchange_bytes"] + max(_sent_groups(pickled, needed))),
        "rollout_all_gather_bytes_per_rank": int(sum(pickled)),
    }


def _sent_groups(pickled: list[int], needed: list[set[int]]) -> list[int]:
    """Per rank, the pickled bytes of the groups its items need that another rank holds (group ``g`` on rank
    ``g mod W``)."""
    world = len(needed)
    return [sum(pickled[unit] for unit in units if unit % world != rank) for rank, units in enumerate(needed)]


def _units_needed(units: StepUnits, settings: PlanSettings, world_size: int) -> list[set[int]]:
    """Per rank, the units its items hold (an untimed pass: summaries, trees dropped at once, the balance)."""
    summaries = [RankPlanner(units, settings, world_size, rank).summarise() for rank in range(world_size)]
    assignment = RankPlanner(units, settings, world_size, 0).balance(summaries)
    return [set(assignment.units_of(rank)) for rank in range(world_size)]


def _ranks_once(units: StepUnits, settings: PlanSettings, world_size: int, needed: list[set[int]]) -> dict:
    """One simulated step: every rank's summarise, the exchange, every rank's balance and materialise.

    Between its two phases a simulated rank keeps only the trees its items need (``needed``), as a rank of a
    run keeps only its own: the simulator would otherwise hold the whole step's trees at once, and the memory
    it touches for them (page faults: CPU time) would be charged to the ranks."""
    planners = [RankPlanner(units, settings, world_size, rank) for rank in range(world_size)]
    summaries, summarise = [], []
    for planner, keep in zip(planners, needed, strict=True):
        summary, seconds = _timed(planner.summarise)
        summaries.append(summary)
        summarise.append(seconds)
        planner.built = {unit: trees for unit, trees in planner.built.items() if unit in keep}
    materialise, dataset_bytes = [], []
    for planner in planners:
        (assignment, plan), seconds = _timed(_balanced_items, planner, summaries)
        materialise.append(seconds)
        dataset_bytes.append(planner.units.nbytes(sorted(planner.read_units)))
        planner.built.clear()
        del plan
    return {
        "seconds": np.add(summarise, materialise),
        "summarise": np.array(summarise),
        "materialise": np.array(materialise),
        "flat_tokens": assignment.flat_tokens,
        "tree_tokens": assignment.tree_tokens,
        "parts": len(assignment.table),
        "balance": balance(assignment.rank_costs().tolist()),
        "exchange_bytes": len(pickle.dumps(summaries)),
        "dataset_bytes": dataset_bytes,
    }


def _balanced_items(planner: RankPlanner, summaries):
    assignment = planner.balance(summaries)
    return assignment, planner.materialise(assignment)
