"""Sequence parallelism checked and measured from the command line, without a launcher.

:func:`sequence_parallel_report` spawns ``size`` processes on this machine (one sequence-parallel
group, gloo). Each builds the model from the same seed with Ulysses around the tree attention and
computes the plan's rows as the trainer does (trees with a path over ``budget`` sharded over the
group, the others on one rank each), each rank backpropagating its own loss terms; the gradients
are then summed over the ranks with plain ``all_reduce`` (no DeepSpeed engine: the trainer's
gradient scale is pinned by the 2-rank DeepSpeed test). Process 0 compares loss and gradients with
the single-process flat result and measures the single-process tree step (S = 1, one rank holding
whole rows of up to ``size x budget`` tokens) on the same rows.

Activation memory is the bytes of distinct tensors autograd saves for backward in the largest row
(:class:`~ds_tree.memory.meters.SavedTensorMeter`), parameters left out: per rank at S = ``size``
(the largest over the ranks), and at S = 1.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.comparison import TOLERANCES, gradient_errors, relative_error
from ds_tree.data.jsonl import json_text
from ds_tree.losses.sft import Normalisers, check_objective
from ds_tree.memory.meters import SavedTensorMeter
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.loading import load_model
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.models.ulysses import check_heads, enable_sequence_parallel
from ds_tree.models.vision import attach_rope_positions
from ds_tree.objectives.sft import global_normalisers, run_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.rows import PackedRow
from ds_tree.packing.sequence_parallel import plan_sequence_parallel_rows
from ds_tree.trees.trajectory import Trajectory, check_vocab
from ds_tree.trees.trie import build_forest
from ds_tree.verify.tree_vs_flat import verification_dtype


def sequence_parallel_report(
    trajectories: list[Trajectory],
    model_source: str,
    *,
    size: int = 2,
    dtype: str = "float64",
    seed: int = 0,
    budget: int = 4096,
    block: int = 1,
    attention: str = "torch",
    normalisation: str = "token_mean",
    policy: str = "exact",
    threads: int = 1,
    router_aux_loss_coef: float | None = None,
) -> dict:
    """Loss and gradient errors against the flat baseline, time and activation memory at S = 1 and S = ``size``.

    An MoE model's objective includes its router load-balancing loss (:mod:`ds_tree.models.moe`),
    weighted by ``router_aux_loss_coef`` (None: the model config's), its value compared as well."""
    check_objective(normalisation, policy)
    verification_dtype(trajectories, dtype)
    check_group(trajectories, model_source, size)
    settings = dict(
        model_source=str(model_source),
        size=size,
        dtype=dtype,
        seed=seed,
        budget=budget,
        block=block,
        attention=attention,
        normalisation=normalisation,
        policy=policy,
        threads=threads,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    return spawn_group(_rank, trajectories, settings)


def check_group(trajectories: list[Trajectory], model_source: str, size: int, *, walked: bool = False) -> None:
    """Before any rank is spawned: at least 2 ranks, heads that split over them, tokens inside the vocabulary;
    trajectories with images get their rotary positions by the model's rule (in place: the ranks inherit them),
    and are refused for the sharded dfs walk (``walked``; docs/MODELS.md, "Vision-language models")."""
    if size < 2:
        raise ValueError(f"sequence parallelism needs at least 2 ranks, got {size}")
    if walked and any(t.images for t in trajectories):
        raise ValueError(
            "--dfs-chunk with --sequence-parallel: the trajectories have images, and the walk sharded over a "
            "sequence-parallel group passes each chunk's shard its depths only, neither its images nor its "
            "multimodal rotary positions: verify sharded rows (no --dfs-chunk) or the walk on one rank "
            "(no --sequence-parallel)"
        )
    model_config = load_model_config(model_source)
    check_heads(model_config, size, str(model_source))
    check_vocab(trajectories, model_config.get_text_config().vocab_size)
    attach_rope_positions(model_config, trajectories)


def spawn_group(rank_function, trajectories: list[Trajectory], settings: dict):
    """Run ``rank_function(rank, trajectories, settings)`` in ``settings["size"]`` forked processes that
    form one sequence-parallel group (:func:`join_group`, left once every rank has returned); what
    process 0's call returns, through JSON (its report)."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "report.json"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        # fork: the entry point may be a script without a ``__main__`` guard (tools/verify.py), which
        # spawned processes would import and run again.
        torch.multiprocessing.start_processes(
            _group_member,
            args=(rank_function, trajectories, settings, port, str(out)),
            nprocs=settings["size"],
            start_method="fork",
        )
        return json.loads(out.read_text())


def _group_member(rank: int, rank_function, trajectories: list[Trajectory], settings: dict, port: int, out: str):
    """One spawned process of :func:`spawn_group`: joins the group, runs ``rank_function``, process 0
    writes what it returned to ``out``, and leaves the group with the others."""
    join_group(rank, settings, port)
    result = rank_function(rank, trajectories, settings)
    if rank == 0:
        Path(out).write_text(json_text(result))
    dist.barrier()
    dist.destroy_process_group()


def join_group(rank: int, settings: dict, port: int) -> None:
    """A spawned process joins the group (gloo) with ``settings["threads"]`` threads."""
    import deepspeed

    size = settings["size"]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(settings["threads"])
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def settings_model(settings: dict, torch_dtype: torch.dtype):
    """The model of ``settings`` (``model_source``, ``attention``, ``seed``) in ``torch_dtype``: the same
    weights in every process of the group and in process 0's single-process references."""
    return load_model(
        settings["model_source"], attention=settings["attention"], dtype=torch_dtype, seed=settings["seed"]
    )


def group_gradients(model) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient summed over the group (in place, each rank having backpropagated its
    own terms), by parameter name (with LoRA the adapters': the frozen base has none)."""
    trained = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    for parameter in trained.values():
        dist.all_reduce(parameter.grad)
    return {name: parameter.grad for name, parameter in trained.items()}


def _rank(rank: int, trajectories: list[Trajectory], settings: dict) -> dict | None:
    size = settings["size"]
    model = settings_model(settings, verification_dtype(trajectories, settings["dtype"]))
    enable_sequence_parallel(model, size)
    budget, block = settings["budget"], settings["block"]
    plan = plan_sequence_parallel_rows(build_forest(trajectories), size, size, budget, block)
    rows = plan.rank_rows(rank, size)
    normalisers = global_normalisers(rows)
    router_aux = router_aux_of(model, trajectories, settings)
    parallel = _measured_step(model, rows, normalisers, settings, router_aux)
    loss = torch.tensor([parallel["loss"], parallel["router_aux"] or 0.0], dtype=torch.float64)
    dist.all_reduce(loss)
    gradients = group_gradients(model)
    peaks = torch.tensor([parallel["activation_bytes"], parallel["time_s"]], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    aux = float(loss[1]) if router_aux is not None else None
    return _report(trajectories, settings, plan, (float(loss[0]), aux), gradients, peaks.tolist())


def router_aux_of(model, trajectories: list[Trajectory], settings: dict) -> RouterAuxLoss | None:
    """``model``'s router load-balancing loss over ``trajectories`` (None without a router), weighted by
    ``settings["router_aux_loss_coef"]`` (None: the model config's)."""
    flat_tokens = sum(len(t) for t in trajectories)
    return RouterAuxLoss.of_model(model, settings["router_aux_loss_coef"], flat_tokens)


def _measured_step(
    model, rows: list[PackedRow], normalisers: Normalisers, settings: dict, router_aux: RouterAuxLoss | None = None
) -> dict:
    """Forward and backward of ``rows``, one at a time: loss, router loss (or None), seconds, the largest
    row's saved bytes."""
    parameters = list(model.parameters())
    loss, largest, started = 0.0, 0, time.perf_counter()
    aux = None if router_aux is None else 0.0
    for row in rows:
        meter = SavedTensorMeter(exclude=parameters)
        with meter.context():
            output = run_rows(
                model,
                [row],
                normalisers,
                settings["normalisation"],
                settings["policy"],
                backward=torch.Tensor.backward,
                router_aux=router_aux,
            )
        loss += output.loss
        if aux is not None:
            aux += output.router_aux
        largest = max(largest, meter.total)
    return {"loss": loss, "router_aux": aux, "time_s": time.perf_counter() - started, "activation_bytes": largest}


def _report(trajectories, settings, plan, losses, gradients, peaks) -> dict:
    """Process 0: the flat baseline and the S = 1 tree step from the same seed, in this process."""
    torch_dtype = verification_dtype(trajectories, settings["dtype"])
    single = settings_model(settings, torch_dtype)
    size, budget, block = settings["size"], settings["budget"], settings["block"]
    flat_rows = pack_trajectories(trajectories, "flat", size * budget, block)
    router_aux = router_aux_of(single, trajectories, settings)
    flat = _measured_step(single, flat_rows, Normalisers.from_rows(flat_rows), settings, router_aux)
    flat_gradients = {name: p.grad.detach().clone() for name, p in single.named_parameters()}
    single.zero_grad(set_to_none=True)
    tree_rows = pack_trajectories(trajectories, "tree", size * budget, block)
    tree = _measured_step(single, tree_rows, Normalisers.from_rows(tree_rows), settings, router_aux)
    errors = gradient_errors(flat_gradients, gradients)
    tolerance = TOLERANCES[torch_dtype]
    loss, aux = losses
    loss_rel_err = relative_error(loss, flat["loss"])
    aux_rel_err = relative_error(aux, flat["router_aux"]) if aux is not None else 0.0
    max_rel_grad_err = max(errors.values(), default=0.0)
    sharded = [row for rows in plan.sharded for row in rows if row.n_real]
    return {
        "sequence_parallel_size": size,
        "n_trajectories": len(trajectories),
        "longest_trajectory": max(len(t) for t in trajectories),
        "budget": budget,
        "sharded_rows": len(sharded),
        "longest_sharded_row": max((row.n_tokens for row in sharded), default=0),
        "rows_per_rank": len(plan.rank_rows(0, size)),
        "dtype": settings["dtype"],
        "attention": settings["attention"],
        "loss_flat": flat["loss"],
        "loss_sequence_parallel": loss,
        "loss_rel_err": loss_rel_err,
        "max_rel_grad_err": max_rel_grad_err,
        "worst_parameter": max(errors, key=errors.get) if errors else None,
        "router_aux_loss_coef": router_aux.coefficient if router_aux else None,
        "router_aux_flat": flat["router_aux"],
        "router_aux_sequence_parallel": aux,
        "router_aux_rel_err": aux_rel_err,
        "activation_bytes_per_rank": {"1": tree["activation_bytes"], str(size): int(peaks[0])},
        "step_time_s_per_rank": {"1": tree["time_s"], str(size): peaks[1]},
        "tolerance": tolerance,
        "passed": bool(
            settings["policy"] == "exact"
            and max_rel_grad_err <= tolerance
            and loss_rel_err <= tolerance
            and aux_rel_err <= tolerance
        ),
    }
