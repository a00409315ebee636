"""On-policy distillation, tree against flat (``ds-tree verify --objective distill --teacher CONFIG``).

The tree side is the trainer's code (:func:`~ds_tree.objectives.distill.prepare_distill_rows`: the teacher's
no-grad pass over the items, then :func:`~ds_tree.objectives.distill.run_distill_rows`) on packed rows (trees
split into parts over the budget), with ``--dfs-chunk`` on walked trees, with ``--sequence-parallel S`` on the
items S spawned ranks plan as the trainer does (:mod:`ds_tree.verify.frozen_models`). The flat oracle takes
each trajectory alone with its whole logits under the student, the old student and the teacher, and writes
the loss out: ``sum_t c_t D(q_t, p_t)`` over the vocabulary (``kl``, ``jsd``, ``reverse_kl``), or the clipped
objective with the advantage ``log p - log q_old`` of the sampled token (``reverse_kl_sampled``), the
coefficients ``c`` the aggregation's. Compared: the loss, every parameter's gradient and the teacher's
log-prob of every trained token (from its hidden states and head on the tree side, for the full-vocabulary
losses). The student is the model at ``seed`` moved by ``perturbation`` times each parameter's spread (ratios
off 1: the clip acts); the old student the model at ``seed``; the teacher ``--teacher`` at ``seed + 1`` (a
config like ``--model``'s is then another model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.comparison import TOLERANCES
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.runners import RunContext
from ds_tree.losses.distill import divergence
from ds_tree.losses.rl import trajectory_coefficients
from ds_tree.model_roles.teacher import head_of
from ds_tree.models.ulysses import enable_sequence_parallel
from ds_tree.objectives.distill import DistillRow, DistillSettings, prepare_distill_rows, run_distill_rows
from ds_tree.objectives.rl_rows import StepNormalisers, trajectory_copies
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory, check_vocab
from ds_tree.verify.frozen_models import SideResult, flat_logits, layouts, passed, run_side, side_report
from ds_tree.verify.sequence_parallel import check_group, group_gradients, spawn_group
from ds_tree.verify.sequence_parallel_rl import _plan
from ds_tree.verify.tree_vs_flat import load_checked_model, rl_policies, verification_dtype, vocab_size

VALUE = "teacher_logprob"


@dataclass
class DistillModels:
    old: torch.nn.Module
    """The student before the updates (no gradient)."""
    model: torch.nn.Module
    """The student trained: ``old`` moved off."""
    teacher: torch.nn.Module

    @classmethod
    def build(cls, options: dict, torch_dtype: torch.dtype, lora=None) -> DistillModels:
        attention, seed = options["attention"], options["seed"]
        old, model = rl_policies(
            options["model_source"], attention, torch_dtype, seed, options["perturbation"], lora=lora
        )
        teacher = load_checked_model(options["teacher_source"], attention=attention, dtype=torch_dtype, seed=seed + 1)
        teacher.requires_grad_(False)
        return cls(old, model, teacher)


def check_vocabularies(models: DistillModels, settings: DistillSettings) -> None:
    """A full-vocabulary divergence compares two distributions over one vocabulary."""
    student, teacher = vocab_size(models.old), vocab_size(models.teacher)
    if settings.full_vocabulary and student != teacher:
        raise ValueError(
            f"--teacher has a vocabulary of {teacher} tokens, --model {student}: --distill-loss {settings.loss} "
            "compares the two distributions token by token (the teacher must have the student's tokenizer)"
        )


def token_values(trajectories: list[Trajectory], prepared, head) -> tuple[np.ndarray, np.ndarray]:
    """``(sums, counts)`` over the concatenated tokens of ``trajectories``: the teacher's log-prob of every
    token a prepared item targets, added where it is owned (each token once over every rank's items)."""
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in trajectories])])
    position = {id(t): offsets[i] for i, t in enumerate(trajectories)}
    sums, counts = np.zeros(offsets[-1]), np.zeros(offsets[-1])
    for item in prepared:
        row = item.row
        by_token = np.full(row.n_tokens, np.nan)
        by_token[item.targets] = _teacher_logprobs(item, head)
        for trajectory, path in trajectory_copies(row):
            here = np.flatnonzero(path[1:] >= 0) + 1
            here = here[row.owned[path[here]] & ~np.isnan(by_token[path[here]])]
            sums[position[id(trajectory)] + here] += by_token[path[here]]
            counts[position[id(trajectory)] + here] += 1
    return sums, counts


def _teacher_logprobs(item, head) -> np.ndarray:
    """The teacher's log-probs of an item's targets: a sampled row's, or from a full-vocabulary row's hidden
    states through the teacher's head."""
    if not isinstance(item, DistillRow):
        return item.logp_ref
    if item.targets.size == 0:
        return np.zeros(0)
    labels = torch.as_tensor(item.row.input_ids[item.targets])
    log_softmax = head.log_softmax(item.hidden)
    return log_softmax.gather(-1, labels[:, None])[:, 0].double().numpy()


def tree_side(models: DistillModels, trajectories, rows, run: RunContext, settings: DistillSettings):
    """The trainer's two passes on ``rows`` (this rank's items): the loss of this rank's items and the
    teacher's log-probs they scored (:func:`token_values`); gradients left on ``models.model``."""
    head = head_of(models.teacher) if settings.full_vocabulary else None
    normalisers = StepNormalisers.of(trajectories)
    prepared = prepare_distill_rows(models.old, models.teacher, rows, settings, normalisers, run, head)
    output = run_distill_rows(models.model, prepared, settings, run, lambda _: torch.Tensor.backward, head)
    return output.loss, token_values(trajectories, prepared, head)


def oracle(
    models: DistillModels, trajectories: list[Trajectory], settings: DistillSettings
) -> tuple[float, np.ndarray]:
    """The flat loss (module docstring), backpropagated trajectory by trajectory, and the teacher's log-prob
    of every token (NaN at each trajectory's first)."""
    rl = settings.rl
    normalisers = StepNormalisers.of(trajectories)
    total, values = 0.0, []
    for trajectory in trajectories:
        coefficients = trajectory_coefficients(
            trajectory.loss_mask,
            rl.aggregation,
            total_tokens=normalisers.total_tokens,
            sequences=normalisers.sequences,
            constant=rl.aggregation_constant,
        )[1:]
        labels = torch.as_tensor(trajectory.input_ids[1:])[:, None]
        student = torch.log_softmax(flat_logits(models.model, trajectory)[:-1], dim=-1)
        with torch.no_grad():
            teacher = torch.log_softmax(flat_logits(models.teacher, trajectory)[:-1], dim=-1)
            old = torch.log_softmax(flat_logits(models.old, trajectory)[:-1], dim=-1).gather(-1, labels)[:, 0]
        teacher_logp = teacher.gather(-1, labels)[:, 0]
        if settings.full_vocabulary:
            terms = divergence(student, teacher, settings.loss, settings.beta)
        else:
            terms = -_clipped(torch.exp(student.gather(-1, labels)[:, 0] - old), teacher_logp - old, rl)
        loss = (torch.as_tensor(coefficients, dtype=terms.dtype) * terms).sum()
        loss.backward()
        total += float(loss.detach())
        values.append(np.concatenate([[np.nan], teacher_logp.double().numpy()]))
    return total, np.concatenate(values)


def _clipped(ratio: torch.Tensor, advantage: torch.Tensor, rl) -> torch.Tensor:
    """PPO's ``min(r A, clip(r) A)``, with the dual clip ``max(., d A)`` where ``A < 0``."""
    clipped = torch.minimum(ratio * advantage, ratio.clamp(1 - rl.eps_low, 1 + rl.eps_high) * advantage)
    if rl.dual_clip is None:
        return clipped
    return torch.where(advantage < 0, torch.maximum(clipped, rl.dual_clip * advantage), clipped)


def _values(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def compare_distill(
    trajectories: list[Trajectory],
    model_source: str,
    teacher_source: str,
    *,
    settings: DistillSettings,
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
    """One process: the tree (and with ``dfs`` the walked) layout against the flat oracle (module docstring);
    ``lora``: adapters on the student (both copies; the trained one's perturbed), the teacher without."""
    torch_dtype = verification_dtype(trajectories, dtype)
    options = dict(
        model_source=model_source,
        teacher_source=teacher_source,
        attention=attention,
        seed=seed,
        perturbation=perturbation,
    )
    models = DistillModels.build(options, torch_dtype, lora)
    check_vocabularies(models, settings)
    check_vocab(trajectories, min(vocab_size(models.old), vocab_size(models.teacher)))
    flat = run_side(models.model, lambda: oracle(models, trajectories, settings))
    report = _header(trajectories, settings, dtype, lora)
    sides = layouts(trajectories, budget, block, head_chunk, dfs)
    for name, (rows, run) in sides.items():
        side = run_side(models.model, lambda rows=rows, run=run: _single(models, trajectories, rows, run, settings))
        report |= side_report(name, flat, side, VALUE)
    return _finish(report, flat, list(sides), torch_dtype)


def _single(models, trajectories, rows, run, settings) -> tuple[float, np.ndarray]:
    loss, (sums, counts) = tree_side(models, trajectories, rows, run, settings)
    return loss, _values(sums, counts)


def _header(trajectories, settings: DistillSettings, dtype: str, lora) -> dict:
    counts = token_counts(trajectories)
    return {
        "objective": "distill",
        "loss": settings.loss,
        **({"beta": settings.beta} if settings.loss == "jsd" else {}),
        "aggregation": settings.rl.aggregation,
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
    report["tolerance"] = tolerance
    report["passed"] = passed(report, sides, VALUE, tolerance)
    return report


def distill_sequence_parallel_report(
    trajectories: list[Trajectory],
    model_source: str,
    teacher_source: str,
    *,
    settings: DistillSettings,
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
    for them (sharded rows, or with ``dfs`` every tree walked by the group, its chunks sharded); process 0
    compares the group's loss, gradients and teacher log-probs with the flat oracle."""
    verification_dtype(trajectories, dtype)
    check_group(trajectories, model_source, size, walked=dfs is not None)
    check_group(trajectories, teacher_source, size, walked=dfs is not None)
    options = dict(
        model_source=str(model_source),
        teacher_source=str(teacher_source),
        settings=settings,
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
    settings, size = options["settings"], options["size"]
    models = DistillModels.build(options, torch_dtype)
    for model in (models.old, models.model, models.teacher):
        enable_sequence_parallel(model, size)
    rows, shared = _plan(trajectories, options, rank)
    run = RunContext("cpu", options["head_chunk"], options["dfs"])
    loss, (sums, counts) = tree_side(models, trajectories, rows, run, settings)
    totals = torch.as_tensor(np.concatenate([[loss], sums, counts]))
    dist.all_reduce(totals)
    gradients = group_gradients(models.model)
    if rank != 0:
        return None
    n = sums.size
    grouped = SideResult(float(totals[0]), gradients, _values(totals[1 : n + 1].numpy(), totals[n + 1 :].numpy()))
    models = DistillModels.build(options, torch_dtype)  # the same weights, without the group's Ulysses
    flat = run_side(models.model, lambda: oracle(models, trajectories, settings))
    report = _header(trajectories, settings, options["dtype"], None) | {"sequence_parallel_size": size}
    report |= side_report("tree", flat, grouped, VALUE)
    report["layout"] = "dfs" if options["dfs"] is not None else "sharded rows"
    report["shared_items"] = len(shared)  # the sharded rows, or the walked trees, the group ran together
    report["teacher_logprobs_scored_once"] = bool(totals[n + 1 :].max() <= 1)
    result = _finish(report, flat, ["tree"], torch_dtype)
    result["passed"] = result["passed"] and result["teacher_logprobs_scored_once"]
    return result
