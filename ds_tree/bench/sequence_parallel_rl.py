"""RL steps under sequence parallelism, tree against flat in one run (``ds-tree bench --objective grpo
--sequence-parallel S``).

:func:`sequence_parallel_rl_bench` spawns ``size`` processes (one sequence-parallel group, gloo,
:func:`~ds_tree.verify.sequence_parallel.spawn_group`). Each builds one model per mode (``flat``: every
trajectory its own tree; ``tree``: each group's trie) from the same seed with Ulysses around the tree
attention, and plans the rows as the trainer does (a tree, or in flat mode a trajectory, with a path
over ``budget`` goes to rows of up to ``S x budget`` tokens sharded over the group; the others to one
rank each). A step is the trainer's RL step on every trajectory of the data: the old policy's no-grad
pass on the shards (:func:`~ds_tree.objectives.rl_rows.prepare_rl_rows`; the model before the step is the
old policy), then ``ppo_epochs`` updates (:func:`~ds_tree.objectives.rl_rows.run_rl_rows`, each rank
backpropagating its own terms), the gradients summed over the group and an AdamW step. The modes
alternate which goes first each step. Times are the slowest rank's; activation memory is the most
autograd saves for backward in one of a rank's items in the first measured update
(:class:`~ds_tree.memory.meters.SavedTensorMeter`, parameters left out), the largest over the ranks.

Both modes start from the same weights, so the first step's losses must agree (``loss_abs_err``,
``loss_rel_err``: float round-off); ``ds-tree verify --objective grpo --sequence-parallel S`` is the
exactness check. ``--modes`` does not apply: both modes always run.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ds_tree.bench.steps import BenchModels, run_measuring
from ds_tree.models.loading import parse_dtype
from ds_tree.models.ulysses import enable_sequence_parallel
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.packing.sequence_parallel import RowShard, plan_sequence_parallel_rows
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest
from ds_tree.verify.sequence_parallel import check_group, spawn_group
from ds_tree.verify.tree_vs_flat import checked_advantages

MODES = {"flat": "none", "tree": "group"}
"""Bench mode -> ``build_forest``'s ``merge``: flat is every trajectory its own single-path tree."""


def sequence_parallel_rl_bench(
    trajectories: list[Trajectory],
    model_source: str,
    objective,
    *,
    size: int = 2,
    steps: int = 3,
    warmup: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    budget: int = 4096,
    block: int = 1,
    attention: str = "torch",
    threads: int = 1,
) -> dict:
    """The report (module docstring) of ``objective`` (an RL :class:`~ds_tree.config.ObjectiveConfig`)."""
    if not trajectories:
        raise ValueError("no trajectories to bench")
    check_group(trajectories, model_source, size)
    checked_advantages(trajectories, objective.estimator, objective.normalise_advantages, objective.tempo_coef)
    options = dict(
        model_source=str(model_source),
        objective=objective,
        size=size,
        steps=steps,
        warmup=warmup,
        dtype=dtype,
        seed=seed,
        budget=budget,
        block=block,
        attention=attention,
        threads=threads,
    )
    report = spawn_group(_rank, trajectories, options)
    counts = token_counts(trajectories)
    flat, tree = report["modes"]["flat"], report["modes"]["tree"]
    return {
        "sequence_parallel_size": size,
        "objective": objective.kind,
        "estimator": objective.estimator,
        **({"tempo_coef": objective.tempo_coef} if objective.estimator == "tempo" else {}),
        "ppo_epochs": objective.ppo_epochs,
        "kl_coef": objective.kl_coef,
        "steps": steps,
        "warmup": warmup,
        "budget": budget,
        "dtype": dtype,
        "attention": attention,
        "threads_per_rank": threads,
        "n_trajectories": len(trajectories),
        "longest_trajectory": max(len(t) for t in trajectories),
        "flat_tokens": counts.flat_tokens,
        "tree_tokens": counts.tree_tokens,
        "ideal_speedup": counts.ideal_speedup,
        **report,
        "speedup": flat["step_time_s"] / tree["step_time_s"],
        "old_forward_speedup": flat["old_forward_time_s"] / tree["old_forward_time_s"],
        "updates_speedup": flat["updates_time_s"] / tree["updates_time_s"],
        "packed_token_ratio": flat["packed_tokens"] / tree["packed_tokens"],
        "activation_ratio_tree_over_flat": tree["activation_bytes_per_rank"] / flat["activation_bytes_per_rank"],
    }


def _rank(rank: int, trajectories: list[Trajectory], options: dict) -> dict:
    size, objective = options["size"], options["objective"]
    torch_dtype = parse_dtype(options["dtype"])
    source, attention, seed = options["model_source"], options["attention"], options["seed"]
    # with a KL term, a frozen copy of the initial policy per mode, as the trainer's default
    engines = dict.fromkeys(MODES, attention)
    bench = BenchModels.build(MODES, source, engines, torch_dtype, seed, 0, "cpu", kl=bool(objective.kl_coef))
    models, optimizers, references, plans = bench.models, bench.optimizers, bench.references, {}
    for mode, merge in MODES.items():
        for policy in (models[mode], references[mode]):
            if policy is not None:
                enable_sequence_parallel(policy, size)
        forest = build_forest(trajectories, merge=merge)
        plans[mode] = plan_sequence_parallel_rows(forest, size, size, options["budget"], options["block"])
    advantages = checked_advantages(
        trajectories, objective.estimator, objective.normalise_advantages, objective.tempo_coef
    ).by_trajectory()
    normalisers = StepNormalisers.of(trajectories)
    settings = objective.rl_settings()
    times: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    first_loss, activation = {}, {}
    for step in range(options["warmup"] + options["steps"]):
        order = list(MODES) if step % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            rows = plans[mode].rank_rows(rank, size)
            model, optimizer = models[mode], optimizers[mode]
            measure = step == options["warmup"]
            dist.barrier()
            started = time.perf_counter()
            prepared = prepare_rl_rows(model, rows, advantages, settings, normalisers, reference=references[mode])
            old_done = time.perf_counter()
            saved, loss = 0, 0.0
            for epoch in range(objective.ppo_epochs):
                if epoch == 0:
                    loss, saved = _measured_update(model, prepared, settings, measure)
                else:
                    run_rl_rows(model, prepared, settings, backward=torch.Tensor.backward)
                for parameter in model.parameters():  # the group's sum, as the trainer's engine reduces it
                    if parameter.grad is None:
                        parameter.grad = torch.zeros_like(parameter)
                    dist.all_reduce(parameter.grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            done = time.perf_counter()
            if step == 0:
                first_loss[mode] = loss
            if measure:
                activation[mode] = saved
            if step >= options["warmup"]:
                times[mode].append([done - started, old_done - started, done - old_done])
    return _group_report(rank, size, plans, times, first_loss, activation)


def _measured_update(model, prepared, settings, measure: bool) -> tuple[float, int]:
    """One update's forward and backward: its loss, and with ``measure`` the most one item saved
    (:func:`~ds_tree.bench.steps.run_measuring`, one item at a time, parameters left out), else 0."""
    losses = []

    def run(items):
        losses.append(run_rl_rows(model, items, settings, backward=torch.Tensor.backward).loss)

    saved = run_measuring(run, prepared, measure, exclude=model.parameters())
    return sum(losses), saved


def _group_report(rank, size, plans, times, first_loss, activation) -> dict:
    """Per mode: the slowest rank's median times, the largest activation bytes; the first step's losses."""
    modes = {}
    for mode in MODES:
        slowest = torch.tensor(times[mode], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        peak = torch.tensor([activation[mode]], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows = plans[mode].rank_rows(rank, size)
        shards = sum(isinstance(row, RowShard) and row.n_real > 0 for row in rows)
        step, old, updates = (statistics.median(column) for column in slowest.T.tolist())
        modes[mode] = {
            "step_time_s": step,
            "step_times_s": slowest[:, 0].tolist(),
            "old_forward_time_s": old,
            "updates_time_s": updates,
            "activation_bytes_per_rank": int(peak.item()),
            "packed_tokens": plans[mode].packed_tokens,
            "sharded_rows": sum(1 for rows in plans[mode].sharded for row in rows if row.n_real),
            "rank0_items": len(rows),
            "rank0_shards": shards,
        }
    losses = torch.tensor([first_loss["flat"], first_loss["tree"]], dtype=torch.float64)
    dist.all_reduce(losses)
    flat, tree = losses.tolist()
    return {
        "modes": modes,
        "first_step_loss": {"flat": flat, "tree": tree},
        "loss_abs_err": abs(tree - flat),
        # None where the flat loss is 0 (GRPO's first update, ratio 1, on trajectories of equal length)
        "loss_rel_err": abs(tree - flat) / abs(flat) if flat else None,
    }
