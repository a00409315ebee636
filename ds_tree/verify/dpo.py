"""DPO, tree against flat, pair by pair (``ds-tree verify --objective dpo``).

The data's preference pairs are its trees' sibling pairs (``--dpo-pairs siblings``, the default and the one
rule: :func:`~ds_tree.trees.pairs.preference_pairs`); a converted preference dataset gives each record's pair.
The tree side is the trainer's code (:mod:`ds_tree.objectives.dpo`): every paired sequence's summed log-prob
under the policy and the reference from the no-grad pass over the items, the pairs' derivatives from them,
then the linear surrogate's backward; on packed rows (trees split into parts over the budget), with
``--dfs-chunk`` on walked trees, with ``--sequence-parallel S`` on the items S spawned ranks plan as the
trainer does, the sums all-reduced (:mod:`ds_tree.verify.frozen_models`). The flat oracle takes each paired
trajectory alone, sums its trained tokens' log-probs with gradients, and differentiates the mean pair loss
itself. Compared: the loss, every parameter's gradient and every pair's margin ``beta x``. The policy is the
model at ``seed`` moved by ``perturbation`` times each parameter's spread; the reference is the model at
``seed`` (with ``--lora``, the policy with its adapters off, as in training).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.comparison import TOLERANCES
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.runners import RunContext, run_items
from ds_tree.losses.dpo import DPOLoss, pair_statistics
from ds_tree.models.lora import AdaptersDisabled
from ds_tree.models.ulysses import enable_sequence_parallel
from ds_tree.objectives.dpo import Pairs, linear_terms, sequence_sums
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory, check_vocab
from ds_tree.verify.frozen_models import SideResult, flat_logits, layouts, passed, run_side, side_report
from ds_tree.verify.sequence_parallel import check_group, group_gradients, spawn_group
from ds_tree.verify.sequence_parallel_rl import _plan
from ds_tree.verify.tree_vs_flat import rl_policies, verification_dtype, vocab_size

VALUE = "margin"


@dataclass
class DPOModels:
    policy: torch.nn.Module
    reference: object

    @classmethod
    def build(cls, options: dict, torch_dtype: torch.dtype, lora=None) -> DPOModels:
        reference, policy = rl_policies(
            options["model_source"],
            options["attention"],
            torch_dtype,
            options["seed"],
            options["perturbation"],
            lora=lora,
        )
        return cls(policy, AdaptersDisabled(policy) if lora is not None else reference)


def checked_pairs(trajectories: list[Trajectory], loss: DPOLoss) -> Pairs:
    """The data's pairs; none is a data error (ValueError) saying where pairs come from."""
    pairs = Pairs.of(trajectories, "group", loss)
    if not pairs.pairs:
        raise ValueError(
            "no preference pairs in the data: --objective dpo pairs the sibling branches of a tree that end one "
            "node after their fork and have different rewards (ds-tree convert --format preference gives each "
            "record's pair)"
        )
    return pairs


def tree_side(models: DPOModels, rows, run: RunContext, pairs: Pairs, loss: DPOLoss, reduce: bool):
    """The trainer's two passes on ``rows`` (this rank's items; ``reduce``: the sums over the group): ``L`` and
    every pair's margin; gradients left on the policy."""
    policy, reference = sequence_sums(models.policy, models.reference, rows, pairs, run, reduce=reduce)
    statistics = pair_statistics(policy, reference, pairs.pairs, loss)
    terms = [linear_terms(row, pairs, statistics.derivatives) for row in rows]
    run_items(models.policy, rows, terms, run, lambda _: torch.Tensor.backward)
    return statistics.loss, statistics.margins


def oracle(models: DPOModels, pairs: Pairs, loss: DPOLoss) -> tuple[float, np.ndarray]:
    """The flat loss: each paired trajectory's summed log-prob with gradients, the mean pair loss
    differentiated by autograd; and every pair's margin."""
    sums = []
    for trajectory, mask in zip(pairs.sequences, pairs.masks, strict=True):
        labels = torch.as_tensor(trajectory.input_ids[1:])[:, None]
        values = []
        for model in (models.policy, models.reference):
            with torch.set_grad_enabled(model is models.policy):
                logp = torch.log_softmax(flat_logits(model, trajectory)[:-1], dim=-1).gather(-1, labels)[:, 0]
                values.append((torch.as_tensor(mask[1:], dtype=logp.dtype) * logp).sum())
        sums.append(values[0] - values[1])
    ratios = torch.stack(sums)
    chosen, rejected = (torch.as_tensor(side) for side in zip(*pairs.pairs, strict=True))
    x = ratios[chosen] - ratios[rejected]
    total = loss.of(x).mean()
    total.backward()
    return float(total.detach()), loss.beta * x.detach().double().numpy()


def compare_dpo(
    trajectories: list[Trajectory],
    model_source: str,
    *,
    loss: DPOLoss,
    dtype: str = "float64",
    seed: int = 0,
    budget: int = 4096,
    block: int = 1,
    attention: str = "torch",
    perturbation: float = 0.5,
    head_chunk: int = 0,
    dfs: DfsSettings | None = None,
    lora=None,
) -> dict:
    """One process: the tree (and with ``dfs`` the walked) layout against the flat oracle (module docstring)."""
    torch_dtype = verification_dtype(trajectories, dtype)
    pairs = checked_pairs(trajectories, loss)
    options = dict(model_source=model_source, attention=attention, seed=seed, perturbation=perturbation)
    models = DPOModels.build(options, torch_dtype, lora)
    check_vocab(trajectories, vocab_size(models.policy))
    flat = run_side(models.policy, lambda: oracle(models, pairs, loss))
    report = _header(trajectories, pairs, loss, dtype, lora)
    sides = layouts(trajectories, budget, block, head_chunk, dfs)
    for name, (rows, run) in sides.items():
        side = run_side(models.policy, lambda rows=rows, run=run: tree_side(models, rows, run, pairs, loss, False))
        report |= side_report(name, flat, side, VALUE)
    return _finish(report, flat, list(sides), torch_dtype)


def _header(trajectories, pairs: Pairs, loss: DPOLoss, dtype: str, lora) -> dict:
    counts = token_counts(trajectories)
    return {
        "objective": "dpo",
        "dpo_loss": loss.loss,
        "beta": loss.beta,
        "label_smoothing": loss.label_smoothing,
        "pairs_from": "siblings",
        "pairs": len(pairs.pairs),
        "paired_sequences": len(pairs.sequences),
        "n_trajectories": len(trajectories),
        "flat_tokens": counts.flat_tokens,
        "tree_tokens": counts.tree_tokens,
        "ideal_speedup": counts.ideal_speedup,
        "dtype": dtype,
        "lora_rank": lora.rank if lora is not None else 0,
    }


def _finish(report: dict, flat: SideResult, sides: list[str], torch_dtype) -> dict:
    tolerance = TOLERANCES[torch_dtype]
    report["loss_flat"] = flat.loss
    report["margin_flat_mean"] = float(flat.values.mean())
    report["tolerance"] = tolerance
    report["passed"] = passed(report, sides, VALUE, tolerance)
    return report


def dpo_sequence_parallel_report(
    trajectories: list[Trajectory],
    model_source: str,
    *,
    loss: DPOLoss,
    size: int = 2,
    dtype: str = "float64",
    seed: int = 0,
    budget: int = 4096,
    block: int = 1,
    attention: str = "torch",
    perturbation: float = 0.5,
    head_chunk: int = 0,
    dfs: DfsSettings | None = None,
    threads: int = 1,
) -> dict:
    """``size`` spawned ranks (one sequence-parallel group) run the tree side on the items the trainer plans
    for them, the sums all-reduced over the group; process 0 compares with the flat oracle."""
    verification_dtype(trajectories, dtype)
    checked_pairs(trajectories, loss)
    check_group(trajectories, model_source, size, walked=dfs is not None)
    options = dict(
        model_source=str(model_source),
        loss=loss,
        size=size,
        dtype=dtype,
        seed=seed,
        budget=budget,
        block=block,
        attention=attention,
        perturbation=perturbation,
        head_chunk=head_chunk,
        dfs=dfs,
        threads=threads,
    )
    return spawn_group(_rank, trajectories, options)


def _rank(rank: int, trajectories: list[Trajectory], options: dict) -> dict | None:
    torch_dtype = verification_dtype(trajectories, options["dtype"])
    loss = options["loss"]
    pairs = Pairs.of(trajectories, "group", loss)
    models = DPOModels.build(options, torch_dtype)
    for model in (models.policy, models.reference):
        enable_sequence_parallel(model, options["size"])
    rows, shared = _plan(trajectories, options, rank)
    run = RunContext("cpu", options["head_chunk"], options["dfs"])
    value, margins = tree_side(models, rows, run, pairs, loss, True)  # the sums are the group's: L alike
    gradients = group_gradients(models.policy)
    dist.barrier()
    if rank != 0:
        return None
    grouped = SideResult(value, gradients, margins)
    models = DPOModels.build(options, torch_dtype)  # the same weights, without the group's Ulysses
    flat = run_side(models.policy, lambda: oracle(models, pairs, loss))
    report = _header(trajectories, pairs, loss, options["dtype"], None) | {"sequence_parallel_size": options["size"]}
    report |= side_report("tree", flat, grouped, VALUE)
    report["layout"] = "dfs" if options["dfs"] is not None else "sharded rows"
    report["shared_items"] = len(shared)  # the sharded rows, or the walked trees, the group ran together
    return _finish(report, flat, ["tree"], torch_dtype)
