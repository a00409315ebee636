"""dfs with sequence parallelism checked from the command line (``ds-tree verify --dfs-chunk C --sequence-parallel S``).

:func:`dfs_sequence_parallel_report` spawns ``size`` processes (one sequence-parallel group, gloo,
:func:`~ds_tree.verify.sequence_parallel.spawn_group`). Each builds the model from the same seed with
Ulysses registered (:func:`~ds_tree.models.ulysses.enable_sequence_parallel`, which makes the group)
and computes the step plan as the trainer does (``packing.mode: dfs``: every tree walked by the group,
each rank one shard of every chunk, :mod:`ds_tree.engine.dfs_sequence_parallel`); the gradients are
summed over the ranks with plain ``all_reduce`` (no DeepSpeed engine; the trainer's ZeRO-3 lockstep is
pinned by the 2-rank training test). Process 0 compares loss and gradients with the single-process
flat result, and walks the same trees alone (S = 1) for the memory figure.

Memory: the most the walk holds at once (:class:`~ds_tree.memory.meters.PeakSavedMeter`, parameters left
out) plus its cached keys and values with their gradients, per rank at S = ``size`` (the largest over
the ranks) and at S = 1.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ds_tree.comparison import TOLERANCES, gradient_errors, relative_error
from ds_tree.engine.dfs import DfsSettings, WalkStats
from ds_tree.losses.sft import Normalisers, check_objective
from ds_tree.memory.meters import PeakSavedMeter
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.models.ulysses import enable_sequence_parallel
from ds_tree.objectives.sft import global_normalisers, run_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.plan import PlanSettings, plan_step
from ds_tree.trees.trajectory import Trajectory
from ds_tree.verify.sequence_parallel import check_group, group_gradients, router_aux_of, settings_model, spawn_group
from ds_tree.verify.tree_vs_flat import verification_dtype


def dfs_sequence_parallel_report(
    trajectories: list[Trajectory],
    model_source: str,
    dfs: DfsSettings,
    *,
    size: int = 2,
    dtype: str = "float64",
    seed: int = 0,
    attention: str = "torch",
    normalisation: str = "token_mean",
    policy: str = "exact",
    threads: int = 1,
    router_aux_loss_coef: float | None = None,
) -> dict:
    """Loss and gradient errors of the sharded walk against the flat baseline; walk memory at S = 1 and S = ``size``.

    An MoE model's objective includes its router load-balancing loss (:mod:`ds_tree.models.moe`),
    weighted by ``router_aux_loss_coef`` (None: the model config's), its value compared as well."""
    check_objective(normalisation, policy)
    verification_dtype(trajectories, dtype)
    check_group(trajectories, model_source, size, walked=True)
    settings = dict(
        model_source=str(model_source),
        size=size,
        dtype=dtype,
        seed=seed,
        chunk=dfs.chunk,
        recompute=dfs.recompute,
        attention=attention,
        normalisation=normalisation,
        policy=policy,
        threads=threads,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    settings["reference"] = _reference(trajectories, settings)  # before the group: its walk is one process's
    return spawn_group(_rank, trajectories, settings)


def _rank(rank: int, trajectories: list[Trajectory], settings: dict) -> dict | None:
    size = settings["size"]
    model = settings_model(settings, verification_dtype(trajectories, settings["dtype"]))
    enable_sequence_parallel(model, size)
    dfs = DfsSettings(settings["chunk"], settings["recompute"])
    plan = PlanSettings(mode="dfs", budget=dfs.chunk, sequence_parallel_size=size, dfs_chunk=dfs.chunk)
    rows = plan_step(trajectories, plan, size).for_rank(rank).rows
    router_aux = router_aux_of(model, trajectories, settings)
    walked = _walk(model, rows, global_normalisers(rows), settings, dfs, router_aux)
    totals = torch.tensor([walked["loss"], walked["router_aux"] or 0.0], dtype=torch.float64)
    dist.all_reduce(totals)
    gradients = group_gradients(model)
    figures = torch.tensor([walked["activation_bytes"], walked["time_s"]], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    losses = (float(totals[0]), float(totals[1]) if router_aux is not None else None)
    return _report(trajectories, settings, losses, gradients, figures.tolist(), walked["calls"])


def _walk(
    model, rows, normalisers: Normalisers, settings: dict, dfs: DfsSettings, router_aux: RouterAuxLoss | None = None
) -> dict:
    """Forward and backward of ``rows`` walked with ``dfs``: loss, router loss (or None), seconds, most bytes
    held, chunks."""
    excluded = [p for p in model.parameters()]
    meter, stats = PeakSavedMeter(exclude=excluded), WalkStats()
    started = time.perf_counter()
    with meter.context():
        output = run_rows(
            model,
            rows,
            normalisers,
            settings["normalisation"],
            settings["policy"],
            backward=torch.Tensor.backward,
            dfs=dfs,
            stats=stats,
            router_aux=router_aux,
        )
    return {
        "loss": output.loss,
        "router_aux": output.router_aux,
        "time_s": time.perf_counter() - started,
        "activation_bytes": meter.peak + stats.peak_cache_bytes,
        "calls": stats.chunks,
    }


def _reference(trajectories, settings) -> dict:
    """The flat baseline's loss and gradients and the S = 1 walk's figures, from the same seed, in this process."""
    single = settings_model(settings, verification_dtype(trajectories, settings["dtype"]))
    router_aux = router_aux_of(single, trajectories, settings)
    longest = max(len(t) for t in trajectories)
    flat_rows = pack_trajectories(trajectories, "flat", longest)
    flat = run_rows(
        single,
        flat_rows,
        Normalisers.from_rows(flat_rows),
        settings["normalisation"],
        settings["policy"],
        backward=torch.Tensor.backward,
        router_aux=router_aux,
    )
    flat_gradients = {name: p.grad.detach().clone() for name, p in single.named_parameters()}
    single.zero_grad(set_to_none=True)
    dfs = DfsSettings(settings["chunk"], settings["recompute"])
    tree_rows = pack_trajectories(trajectories, "dfs", dfs.chunk)
    alone = _walk(single, tree_rows, Normalisers.from_rows(tree_rows), settings, dfs, router_aux)
    return {
        "loss": flat.loss,
        "router_aux": flat.router_aux,
        "router_aux_loss_coef": router_aux.coefficient if router_aux else None,
        "gradients": flat_gradients,
        "alone": alone,
        "walked_trees": len(tree_rows),
    }


def _report(trajectories, settings, losses, gradients, figures, calls) -> dict:
    """Process 0: the report against :func:`_reference`."""
    reference = settings["reference"]
    loss, aux = losses
    flat_loss, flat_gradients, alone = reference["loss"], reference["gradients"], reference["alone"]
    longest = max(len(t) for t in trajectories)
    errors = gradient_errors(flat_gradients, gradients)
    tolerance = TOLERANCES[verification_dtype(trajectories, settings["dtype"])]
    loss_rel_err = relative_error(loss, flat_loss)
    aux_rel_err = relative_error(aux, reference["router_aux"]) if aux is not None else 0.0
    max_rel_grad_err = max(errors.values(), default=0.0)
    size = settings["size"]
    return {
        "sequence_parallel_size": size,
        "dfs_chunk": settings["chunk"],
        "dfs_recompute": settings["recompute"],
        "n_trajectories": len(trajectories),
        "longest_trajectory": longest,
        "walked_trees": reference["walked_trees"],
        "chunks_per_rank": calls,
        "dtype": settings["dtype"],
        "attention": settings["attention"],
        "loss_flat": flat_loss,
        "loss_dfs_sequence_parallel": loss,
        "loss_rel_err": loss_rel_err,
        "max_rel_grad_err": max_rel_grad_err,
        "worst_parameter": max(errors, key=errors.get) if errors else None,
        "router_aux_loss_coef": reference["router_aux_loss_coef"],
        "router_aux_flat": reference["router_aux"],
        "router_aux_dfs_sequence_parallel": aux,
        "router_aux_rel_err": aux_rel_err,
        "walk_memory_bytes_per_rank": {"1": alone["activation_bytes"], str(size): int(figures[0])},
        "walk_memory_ratio": figures[0] / max(alone["activation_bytes"], 1),
        "step_time_s_per_rank": {"1": alone["time_s"], str(size): figures[1]},
        "tolerance": tolerance,
        "passed": bool(
            settings["policy"] == "exact"
            and max_rel_grad_err <= tolerance
            and loss_rel_err <= tolerance
            and aux_rel_err <= tolerance
        ),
    }
