"""The RL objective under sequence parallelism, checked against the flat baseline (``ds-tree verify
--objective grpo --sequence-parallel S``).

:func:`sequence_parallel_rl_report` spawns ``size`` processes (one sequence-parallel group, gloo,
:func:`~ds_tree.verify.sequence_parallel.spawn_group`). Each builds the old policy (the model at
``seed``) and the trained policy (moved off it by ``perturbation`` times each parameter's spread, as
:func:`~ds_tree.verify.tree_vs_flat.compare_rl` does) with Ulysses around the tree attention, plans the
rows as the trainer does (trees with a path over ``budget`` sharded over the group) and runs the
trainer's two RL passes on its items: :func:`~ds_tree.objectives.rl_rows.prepare_rl_rows` (the old and
reference policies' no-grad forwards on the shards, per-token sums of the trajectories whose
targets each shard predicts) and :func:`~ds_tree.objectives.rl_rows.run_rl_rows` (each rank
backpropagating its own shard's terms). Loss, gradients and metric sums are then summed over the
ranks, and the old log-probs of every trained token gathered. Process 0 compares them with the
single-process flat result (:func:`~ds_tree.verify.tree_vs_flat.run_rl_mode` in the flat layout).

With ``dfs`` (``--dfs-chunk C``) the plan is ``packing.mode: dfs``'s instead: every tree walked by the
group in chunks of ``C`` tokens, each rank forwarding one shard of every chunk
(:mod:`ds_tree.engine.dfs_sequence_parallel`), in both passes (the old and reference policies'
no-grad walks, then the loss walk). The two passes and the sums are the same code; only the plan
and the walk settings differ.

With ``estimator: gae`` the ranks also hold PPO's two critics (:class:`~ds_tree.verify.critic.CriticCheck`, Ulysses
around a critic of its own; a head on the policy's trunk runs on the sequence-parallel trunk): the old critic's
values are scored on the shards and merged over the group (each token by the one rank predicting it) for GAE, and
the trained critic's value loss and gradients are summed over the group and compared with flat too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.comparison import TOLERANCES, gradient_errors, relative_error
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.runners import StepOutput
from ds_tree.losses.rl import SUMMED_METRICS, RLSettings
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.ulysses import check_heads, enable_sequence_parallel
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows, trajectory_copies
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.plan import PlanSettings, plan_step
from ds_tree.packing.sequence_parallel import plan_sequence_parallel_rows
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest
from ds_tree.verify.sequence_parallel import check_group, group_gradients, router_aux_of, spawn_group
from ds_tree.verify.tree_vs_flat import (
    checked_advantages,
    metric_errors,
    perturb_parameters,
    rl_policies,
    run_rl_mode,
    verification_dtype,
)


def sequence_parallel_rl_report(
    trajectories: list[Trajectory],
    model_source: str,
    *,
    size: int = 2,
    estimator: str = "grpo",
    normalise_advantages: bool = False,
    tempo_coef: float = 1.0,
    settings: RLSettings | None = None,
    dtype: str = "float64",
    seed: int = 0,
    budget: int = 4096,
    block: int = 1,
    attention: str = "torch",
    perturbation: float = 0.5,
    threads: int = 1,
    dfs: DfsSettings | None = None,
    router_aux_loss_coef: float | None = None,
    critic=None,
    gamma: float = 1.0,
    lam: float = 0.95,
    lora=None,
) -> dict:
    """Loss, gradient, metric and old log-prob errors of the RL objective at S = ``size`` against flat
    (``dfs``: every tree walked by the group, its chunks sharded). An MoE model's objective includes its
    router load-balancing loss (docs/RL.md), weighted by ``router_aux_loss_coef`` (None: the model
    config's), its value compared as well. ``estimator: gae``: ``critic`` (:class:`ds_tree.config.CriticSettings`),
    ``gamma`` and ``lam`` as :func:`~ds_tree.verify.tree_vs_flat.compare_rl` (module docstring). ``lora``
    (:class:`ds_tree.config.LoraSettings`): adapters on both policies, their gradients compared
    (:func:`~ds_tree.verify.tree_vs_flat.rl_policies`)."""
    verification_dtype(trajectories, dtype)
    check_group(trajectories, model_source, size, walked=dfs is not None)
    gae = estimator == "gae"
    if gae and not critic.on_policy_trunk:  # a critic of its own is split over the group too
        check_heads(load_model_config(critic.source), size, critic.source)
    if gae:  # bad rewards fail before spawning (the critic's values are not known yet)
        checked_advantages(trajectories, estimator, values={id(t): np.zeros(len(t)) for t in trajectories})
    else:
        checked_advantages(trajectories, estimator, normalise_advantages, tempo_coef)
    options = dict(
        model_source=str(model_source),
        size=size,
        estimator=estimator,
        normalise_advantages=normalise_advantages,
        tempo_coef=tempo_coef,
        settings=settings or RLSettings(),
        dtype=dtype,
        seed=seed,
        budget=budget,
        block=block,
        attention=attention,
        perturbation=perturbation,
        threads=threads,
        dfs=dfs,
        router_aux_loss_coef=router_aux_loss_coef,
        critic=(critic.source, critic.value_clip) if gae else None,
        gamma=gamma,
        lam=lam,
        lora=lora,
    )
    return spawn_group(_rank, trajectories, options)


def _policies(options: dict, torch_dtype: torch.dtype):
    """The old policy (no gradients) and the trained one, moved off it (:func:`rl_policies`)."""
    return rl_policies(
        options["model_source"],
        options["attention"],
        torch_dtype,
        options["seed"],
        options["perturbation"],
        lora=options["lora"],
    )


def _critics(options: dict, old, model, torch_dtype: torch.dtype):
    """The check's old and trained critic (:class:`~ds_tree.verify.critic.CriticCheck`), None without ``gae``."""
    if options["critic"] is None:
        return None
    from ds_tree.verify.critic import CriticCheck

    source, value_clip = options["critic"]
    return CriticCheck.of(
        source,
        old_policy=old,
        policy=model,
        attention=options["attention"],
        dtype=torch_dtype,
        seed=options["seed"],
        perturbation=options["perturbation"],
        value_clip=value_clip,
        gamma=options["gamma"],
        lam=options["lam"],
        perturb=perturb_parameters,
    )


def _rank(rank: int, trajectories: list[Trajectory], options: dict) -> dict | None:
    size, settings = options["size"], options["settings"]
    torch_dtype = verification_dtype(trajectories, options["dtype"])
    old, model = _policies(options, torch_dtype)
    for policy in (old, model):
        enable_sequence_parallel(policy, size)
    rows, sharded = _plan(trajectories, options, rank)
    critics = _critics(options, old, model, torch_dtype)
    values = None
    if critics is None:
        advantages = checked_advantages(
            trajectories, options["estimator"], options["normalise_advantages"], options["tempo_coef"]
        ).by_trajectory()
    else:
        from ds_tree.verify.critic import policy_advantages

        for critic in (critics.old, critics.trained):
            if hasattr(critic, "scorer"):  # a critic of its own scores the same shards; a head's trunk already does
                enable_sequence_parallel(critic.scorer, size)
        values = critics.values(trajectories, rows, options["dfs"])  # merged over the group
        returns_from = critics.advantages(trajectories, values)
        advantages = policy_advantages(trajectories, returns_from, options["normalise_advantages"])
    reference = old if settings.kl_coef else None
    normalisers = StepNormalisers.of(trajectories)
    dfs = options["dfs"]
    prepared = prepare_rl_rows(old, rows, advantages, settings, normalisers, reference=reference, dfs=dfs)
    router_aux = router_aux_of(model, trajectories, options)
    output = run_rl_rows(model, prepared, settings, backward=torch.Tensor.backward, dfs=dfs, router_aux=router_aux)
    losses, metrics = _group_sums(output)
    gradients = group_gradients(model)
    old_logprobs = _gathered_old_logprobs(trajectories, prepared)
    critic = None
    if critics is not None:
        from ds_tree.losses.values import VALUE_METRICS
        from ds_tree.verify.critic import CriticResult

        critic_output = critics.run(trajectories, rows, values, returns_from, settings, dfs)
        value_metrics = critic_output.metrics or {}
        sums = [critic_output.loss] + [value_metrics.get(name, 0.0) for name in VALUE_METRICS]
        sums = torch.tensor(sums, dtype=torch.float64)
        dist.all_reduce(sums)
        summed = sums.tolist()
        critic = CriticResult(
            values, summed[0], group_gradients(critics.trained), dict(zip(VALUE_METRICS, summed[1:], strict=True))
        )
    if rank != 0:
        return None
    report = _report(trajectories, options, advantages, losses, gradients, metrics, old_logprobs, sharded)
    return report if critic is None else _with_critic(report, trajectories, options, critic)


def _with_critic(report: dict, trajectories: list[Trajectory], options: dict, parallel) -> dict:
    """Process 0: the report with the critic's errors against its flat run from the same weights, in this process."""
    from ds_tree.verify.critic import critic_errors

    torch_dtype = verification_dtype(trajectories, options["dtype"])
    old, model = _policies(options, torch_dtype)
    critics = _critics(options, old, model, torch_dtype)
    longest = max(len(t) for t in trajectories)
    rows = pack_trajectories(trajectories, "flat", max(options["size"] * options["budget"], longest), options["block"])
    values = critics.values(trajectories, rows, None, merged=False)  # the other ranks have returned
    flat = critics.result(
        trajectories, rows, values, critics.advantages(trajectories, values), options["settings"], None
    )
    errors = critic_errors(flat, parallel)
    errors["critic_loss_sequence_parallel"] = errors.pop("critic_loss_tree")
    tolerance = report["tolerance"]
    source, value_clip = options["critic"]
    passed = report["passed"] and all(value <= tolerance for name, value in errors.items() if name.endswith("_err"))
    fields = {"critic": source, "gamma": options["gamma"], "lam": options["lam"], "value_clip": value_clip}
    return {**report, **fields, **errors, "passed": passed}


def _plan(trajectories: list[Trajectory], options: dict, rank: int) -> tuple[list, list]:
    """This rank's items, and the whole rows the group shares (sharded rows, or walked trees), as the trainer
    plans them: ``packing.over_budget: sequence_parallel``, or with ``dfs`` ``packing.mode: dfs``."""
    size, dfs = options["size"], options["dfs"]
    if dfs is not None:
        settings = PlanSettings(mode="dfs", budget=dfs.chunk, sequence_parallel_size=size, dfs_chunk=dfs.chunk)
        rows = plan_step(trajectories, settings, size).for_rank(rank).rows
        return rows, rows
    plan = plan_sequence_parallel_rows(build_forest(trajectories), size, size, options["budget"], options["block"])
    return plan.rank_rows(rank, size), [row for rows in plan.sharded for row in rows if row.n_real]


def _group_sums(output: StepOutput) -> tuple[tuple[float, float | None], dict[str, float]]:
    """The loss and router loss (None without one), and the metric sums over the group (``ratio_max`` by max)."""
    metrics = output.metrics or {}
    sums = torch.tensor(
        [output.loss, output.router_aux or 0.0] + [metrics.get(name, 0.0) for name in SUMMED_METRICS],
        dtype=torch.float64,
    )
    dist.all_reduce(sums)
    top = torch.tensor([metrics.get("ratio_max", 0.0)], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    values = sums.tolist()
    aux = values[1] if output.router_aux is not None else None
    return (values[0], aux), {**dict(zip(SUMMED_METRICS, values[2:], strict=True)), "ratio_max": float(top.item())}


def _gathered_old_logprobs(trajectories: list[Trajectory], prepared) -> tuple[np.ndarray, np.ndarray]:
    """``(values, counts)`` over the concatenated tokens of ``trajectories``: the old log-prob of every
    token some rank scored (an owned target of one of its items), summed over the group with how often."""
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in trajectories])])
    index_of = {id(t): i for i, t in enumerate(trajectories)}
    values, counts = np.zeros(offsets[-1]), np.zeros(offsets[-1])
    for item in prepared:
        by_token = np.full(item.row.n_tokens, np.nan)
        by_token[item.targets] = item.logp_old
        by_token[~item.row.owned] = np.nan  # a context copy (CPPO scores a split tree's prefix copies for its mask)
        for trajectory, path in trajectory_copies(item.row):
            here = np.flatnonzero(path[1:] >= 0) + 1
            scored = here[~np.isnan(by_token[path[here]])]
            flat = offsets[index_of[id(trajectory)]] + scored
            values[flat] += by_token[path[scored]]
            counts[flat] += 1
    gathered = torch.tensor(np.stack([values, counts]))
    dist.all_reduce(gathered)
    return gathered[0].numpy(), gathered[1].numpy()


def _report(trajectories, options, advantages, losses, gradients, metrics, old_logprobs, sharded) -> dict:
    """Process 0: the flat baseline from the same weights, in this process, and the errors."""
    from ds_tree.losses.sft import Normalisers
    from ds_tree.objectives.sft import run_rows

    settings, size, budget, block = options["settings"], options["size"], options["budget"], options["block"]
    torch_dtype = verification_dtype(trajectories, options["dtype"])
    old, model = _policies(options, torch_dtype)
    reference = old if settings.kl_coef else None
    longest = max(len(t) for t in trajectories)
    flat_budget = max(size * budget, longest)  # a walked tree's paths may be longer than S x budget
    router_aux = router_aux_of(model, trajectories, options)
    flat = run_rl_mode(
        model, old, reference, trajectories, "flat", flat_budget, block, advantages, settings, router_aux=router_aux
    )
    with torch.no_grad():
        rows = pack_trajectories(trajectories, "flat", flat_budget, block)
        flat_old = run_rows(old, rows, Normalisers(1.0, 1.0, 1.0), collect_logprobs=True).trajectory_logprobs
    values, counts = old_logprobs
    expected = np.concatenate([np.concatenate([[np.nan], flat_old[id(t)]]) for t in trajectories])
    scored = counts > 0
    logprob_err = float(np.abs(values[scored] - expected[scored]).max(initial=0.0))
    errors = gradient_errors(flat.gradients, gradients)
    errors_of_metrics = metric_errors(flat.metrics, metrics)
    tolerance = TOLERANCES[torch_dtype]
    loss, aux = losses
    loss_rel_err = relative_error(loss, flat.loss)
    aux_rel_err = relative_error(aux, flat.router_aux) if aux is not None else 0.0
    max_rel_grad_err = max(errors.values(), default=0.0)
    max_metric_err = max(errors_of_metrics.values(), default=0.0)
    trained = sum(int((t.loss_mask[1:] != 0).sum()) for t in trajectories)
    return {
        "sequence_parallel_size": size,
        "n_trajectories": len(trajectories),
        "longest_trajectory": longest,
        **_layout(options, sharded),
        "dtype": options["dtype"],
        "attention": options["attention"],
        "lora_rank": options["lora"].rank if options["lora"] is not None else 0,
        "parameters_compared": len(errors),
        "estimator": options["estimator"],
        **({"tempo_coef": options["tempo_coef"]} if options["estimator"] == "tempo" else {}),
        "aggregation": settings.aggregation,
        "loss_flat": flat.loss,
        "loss_sequence_parallel": loss,
        "loss_rel_err": loss_rel_err,
        "max_rel_grad_err": max_rel_grad_err,
        "worst_parameter": max(errors, key=errors.get) if errors else None,
        "old_logprobs_scored": int(scored.sum()),
        "trained_tokens": trained,
        "max_abs_old_logprob_err": logprob_err,
        "max_rel_metric_err": max_metric_err,
        "metrics_flat": flat.metrics,
        "metrics_sequence_parallel": metrics,
        "router_aux_loss_coef": router_aux.coefficient if router_aux else None,
        "router_aux_flat": flat.router_aux,
        "router_aux_sequence_parallel": aux,
        "router_aux_rel_err": aux_rel_err,
        "tolerance": tolerance,
        "passed": bool(
            max_rel_grad_err <= tolerance
            and loss_rel_err <= tolerance
            and logprob_err <= tolerance
            and max_metric_err <= tolerance
            and aux_rel_err <= tolerance
            and counts.max(initial=0.0) <= 1
        ),
    }


def _layout(options: dict, sharded: list) -> dict:
    """The report's fields on how the group shared the work: its sharded rows, or its walked trees."""
    dfs = options["dfs"]
    if dfs is None:
        return {
            "budget": options["budget"],
            "sharded_rows": len(sharded),
            "longest_sharded_row": max((row.n_tokens for row in sharded), default=0),
        }
    return {
        "dfs_chunk": dfs.chunk,
        "dfs_recompute": dfs.recompute,
        "walked_trees": len(sharded),
        "largest_walked_tree": max((row.n_real for row in sharded), default=0),
    }
