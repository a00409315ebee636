"""The training-time tree-vs-flat self-check (``objective.self_check``; docs/LORA.md, "Self-check").

On the chosen steps the trainer takes a small sample of the step's trajectories (whole groups, in the
step's order, up to :data:`SAMPLE_TOKENS` flat tokens; when none fits, the first trajectories of the
smallest group, two at least: :func:`sample_groups`) and computes,
with the model as it is (the same weights for both sides), the run's own objective twice:

- the tree: the sample laid out as the run lays out a step, by the step plan itself
  (:func:`~ds_tree.packing.plan.plan_step` with the run's plan settings, over this rank's
  sequence-parallel group: :func:`tree_items`), each work item run by the runner registered for its
  kind (:mod:`ds_tree.engine.runners`: packed rows, dfs walks, sequence-parallel shards, walks sharded
  over the group), with its restoration weights and normalisers; whatever kind the run gives the
  sample's trees is the kind checked;
- the flat baseline: every trajectory its own sequence, its own loss terms (whole rows, on every rank).

Each side gives the loss, every trajectory's log-probs (from its forwards with gradients,
:attr:`~ds_tree.engine.runners.RunContext.collect_logprobs`) and the gradient of every trainable
parameter. SFT runs compare the restoration-weighted SFT loss; RL runs compare the clipped objective
with its KL and entropy terms (:mod:`ds_tree.engine.rl_step`), with the step's advantages and the
step's old log-probs (recorded before the step's updates by the tree side's no-grad forwards,
:func:`rl_inputs`) and reference log-probs. The check stops the run (:class:`SelfCheckError`) when the
loss's or a gradient's relative error, or a log-prob's absolute error, exceeds the tolerance of the
model's dtype (:data:`TOLERANCES`).

Gradients are taken with ``torch.autograd.grad`` on the trainable parameters of the bare module (not
the DeepSpeed engine): the runners hand every loss (a dfs chunk's surrogate included) to a
``backward`` function, here a :class:`GradientCollector`, so nothing is written to ``param.grad``, no
DeepSpeed gradient hook or reduction runs, the optimizer is not touched (a walk's cached keys and
values, not parameters, get their ``.grad`` as the walk needs). Under ZeRO-3 the module's own hooks
gather each layer's parameters for its forward and backward as in training, so each rank holds the
whole gradient of the sample (every data-parallel group checks the same sample: exact, no reduction
needed); under sequence parallelism each rank of a group computes its items of the group's plan (its
shard of every sharded row or walk, its own rows) and the group's gradients, losses and log-probs are
summed. The RNG state is restored afterwards.

Cost per checked step: the forwards and backwards of at most :data:`SAMPLE_TOKENS` tokens twice (tree
and flat), plus, in RL, the no-grad forwards of the old and reference policies; memory: one copy of
the trainable parameters' gradient per side (the adapters only under LoRA; the whole model's for full
fine-tuning, gathered on every rank under ZeRO-3).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ds_tree import comparison
from ds_tree.config import self_check_every
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.rl_step import StepNormalisers, prepare_rl_rows, run_rl_rows, trajectory_copies
from ds_tree.engine.runners import RunContext, runner_of
from ds_tree.engine.step import run_rows
from ds_tree.losses.rl import RLSettings
from ds_tree.losses.sft import Normalisers
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.plan import PlanSettings, plan_step
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.trajectory import Trajectory, group_trajectories

logger = logging.getLogger(__name__)

SAMPLE_TOKENS = 256
"""Flat tokens of the sample (whole groups; part of the smallest group when none fits)."""

TOLERANCES = {**comparison.TOLERANCES, torch.bfloat16: 5e-2}
"""Largest loss and gradient relative error and log-prob absolute error per dtype. float64 and
float32 are ``ds-tree verify``'s. bf16 (8 significant bits, unit round-off 2^-8 = 3.9e-3): the tree
and the flat forward round their matmuls, attention sums and gradient accumulations in different
orders, so each log-prob and gradient entry carries independent bf16 errors of round-off size
(measured on the tiny Llama, docs/LORA.md: log-probs ~2e-3 absolute, gradients ~5e-3 relative);
5e-2 leaves room for sharper trained distributions, while a broken restoration weight or mask moves
the loss and the gradients by far more (a shared token's weight off by one: tens of percent)."""


class SelfCheckError(RuntimeError):
    """The tree result differs from the flat baseline beyond the dtype's tolerance."""


@dataclass
class SelfCheckResult:
    loss_tree: float
    loss_flat: float
    loss_rel_err: float
    max_abs_logprob_err: float
    worst_trajectory: str
    trajectories: int
    tokens: int
    seconds: float
    """Wall time of the check (its cost)."""
    max_grad_rel_err: float = 0.0
    worst_parameter: str = ""
    parameters: int = 0
    """Trainable parameters whose gradients were compared."""
    items: dict[str, int] = field(default_factory=dict)
    """This rank's tree-side work items (with tokens) per execution kind: the runners the check ran."""

    def scalars(self) -> dict[str, float]:
        return {
            "selfcheck/loss_rel_err": self.loss_rel_err,
            "selfcheck/max_abs_logprob_err": self.max_abs_logprob_err,
            "selfcheck/max_grad_rel_err": self.max_grad_rel_err,
            "selfcheck/tokens": float(self.tokens),
            "selfcheck/time_s": self.seconds,
            **{f"selfcheck/{kind}_items": float(count) for kind, count in sorted(self.items.items())},
        }


@dataclass
class RLInputs:
    """What the RL objective of the sample needs, fixed before the step's updates (:func:`rl_inputs`)."""

    sample: list[Trajectory]
    settings: RLSettings
    advantages: dict[int, np.ndarray]
    """``id(trajectory) -> per-token advantages`` (the step's)."""
    old_logprobs: dict[int, np.ndarray] | None
    """``id(trajectory) -> log p`` of its tokens (index 0 unused) under the policy before the step's
    updates; None with ``old_logprobs: data`` (the sampler's, read from the trajectories)."""
    reference: object | None = None


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group, over which the tree side plans the sample (:func:`tree_items`)."""

    size: int
    position: int
    """This rank's position in the group: whose items of the group's plan it runs."""
    group: object | None = None
    """The process group (DeepSpeed's sequence-parallel group); None: the default group."""


def is_due(setting: str, step: int, first_step: int) -> bool:
    """Whether 0-based ``step`` is checked under ``objective.self_check`` (``first_step``: this run's first)."""
    every = self_check_every(setting)
    return step == first_step if every == -1 else every > 0 and step % every == 0


def sample_groups(trajectories: Sequence[Trajectory], cap: int = SAMPLE_TOKENS) -> list[Trajectory]:
    """Whole groups from the start of ``trajectories`` up to ``cap`` flat tokens; when no group fits
    the cap, the first trajectories of the smallest group up to the cap, two at least (they share the
    group's prompt: the tree still has a shared prefix), so that the flat side stays small however
    large the groups are. Any group may be taken: the step plan places it as it places the step's
    (packed, walked or sharded, :func:`tree_items`)."""
    groups = group_trajectories(trajectories)
    sample: list[Trajectory] = []
    tokens = 0
    for group in groups:
        size = sum(len(t) for t in group)
        if tokens + size <= cap:
            sample.extend(group)
            tokens += size
    if not sample and groups:
        for trajectory in min(groups, key=lambda g: sum(len(t) for t in g)):
            if len(sample) >= 2 and tokens + len(trajectory) > cap:
                break
            sample.append(trajectory)
            tokens += len(trajectory)
    return sample


def _name(trajectory: Trajectory) -> str:
    return trajectory.source or f"group {trajectory.group_id!r}"


# ----------------------------------------------------------------------------------- gradients
def _graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the autograd graph of ``loss`` accumulates gradients into (parameters, and the dfs
    walk's key/value leaves and scale probe)."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        else:
            stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class GradientCollector:
    """A ``backward(loss)`` that sums the trainable parameters' gradients into :attr:`gradients` by
    name with ``torch.autograd.grad``: ``param.grad`` and DeepSpeed's gradient hooks are left alone.
    Other leaves (the dfs walk's keys, values and probe) get their ``.grad`` as ``backward`` would."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.names = {id(p): name for name, p in self.trainable.items()}
        self.gradients: dict[str, torch.Tensor] = {}

    def all_gradients(self) -> dict[str, torch.Tensor]:
        """:attr:`gradients` with zeros for the trainable parameters that received none (a shard that
        routed no token to an expert), so that every rank of a group reduces the same tensors."""
        for name, p in self.trainable.items():
            if name not in self.gradients:
                self.gradients[name] = torch.zeros(
                    tuple(getattr(p, "ds_shape", p.shape)), dtype=p.dtype, device=p.device
                )
        return self.gradients

    def __call__(self, loss: torch.Tensor) -> None:
        if not loss.requires_grad:
            return
        leaves = _graph_leaves(loss)
        for leaf, grad in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True), strict=True):
            if grad is None:
                continue
            name = self.names.get(id(leaf))
            if name is None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
            elif name in self.gradients:
                self.gradients[name] += grad
            else:
                self.gradients[name] = grad.detach().clone()


def gradient_errors(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, float]:
    """``ds-tree verify``'s measure per parameter (:func:`ds_tree.comparison.gradient_errors`), in name order;
    a parameter with a gradient on one side only counts zero on the other."""
    names = sorted(set(reference) | set(other))

    def filled(side: dict[str, torch.Tensor], twin: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: side[name] if name in side else torch.zeros_like(twin[name]) for name in names}

    return comparison.gradient_errors(filled(reference, other), filled(other, reference))


# ----------------------------------------------------------------------------------- the two sides
@dataclass
class _Side:
    loss: float
    logprobs: list[np.ndarray]
    """Per trajectory of the sample, in order: ``log p`` of its tokens 1.. (NaN where this rank scored none)."""
    gradients: dict[str, torch.Tensor]


def tree_items(
    sample: Sequence[Trajectory], plan: PlanSettings, sequence_parallel: SequenceParallel | None
) -> tuple[list[PackedRow], list[PackedRow]]:
    """The sample planned as the run plans a step (:func:`~ds_tree.packing.plan.plan_step` with the run's
    own ``plan`` settings) over this rank's sequence-parallel group alone: ``(this rank's work items,
    every item of the group)``. Every rank of a group computes the same plan, each taking its own items
    (a walked tree's shards: the same chunks, the same collective calls), and every data-parallel group
    the same one."""
    size, position = (sequence_parallel.size, sequence_parallel.position) if sequence_parallel else (1, 0)
    if plan.sequence_parallel_size != size:
        raise ValueError(
            f"the self-check's plan settings have sequence_parallel_size {plan.sequence_parallel_size}, "
            f"its sequence-parallel group has {size} ranks"
        )
    ranks = plan_step(sample, plan, world_size=size).ranks
    return ranks[position], [row for rows in ranks for row in rows]


def _by_trajectory(sample: Sequence[Trajectory], logprobs: dict[int, np.ndarray]) -> list[np.ndarray]:
    """``id(trajectory) -> log p`` as a list in sample order (all NaN for a trajectory not reported)."""
    return [logprobs.get(id(t), np.full(len(t) - 1, np.nan)) for t in sample]


def _merge_over_group(values: list[np.ndarray], group) -> list[np.ndarray]:
    """Each entry where a rank of ``group`` knows it (each is known by one rank: the one predicting it),
    NaN where none does."""
    import torch.distributed as dist

    if not values:
        return values
    flat = np.concatenate(values)
    known = torch.as_tensor(~np.isnan(flat), dtype=torch.float64)
    summed = torch.as_tensor(np.nan_to_num(flat, nan=0.0), dtype=torch.float64)
    dist.all_reduce(known, group=group)
    dist.all_reduce(summed, group=group)
    merged = np.where(known.numpy() > 0, summed.numpy(), np.nan)
    offsets = np.cumsum([0] + [v.size for v in values])
    return [merged[offsets[i] : offsets[i + 1]] for i in range(len(values))]


def _sum_over_group(side: _Side, sequence_parallel: SequenceParallel) -> _Side:
    """The group's sums: each rank holds its items' loss terms and a share of every gradient; a log-prob
    is reported by the one rank that predicts it (NaN elsewhere)."""
    import torch.distributed as dist

    group = sequence_parallel.group
    loss = torch.tensor([side.loss], dtype=torch.float64)
    dist.all_reduce(loss, group=group)
    for name in sorted(side.gradients):  # every trainable parameter's (:meth:`GradientCollector.all_gradients`)
        dist.all_reduce(side.gradients[name], group=group)
    return _Side(float(loss.item()), _merge_over_group(side.logprobs, group), side.gradients)


def _run_side(
    model,
    sample: Sequence[Trajectory],
    items: list[PackedRow],
    normalisers: Normalisers,
    *,
    normalisation: str,
    rl: RLInputs | None,
    dfs: DfsSettings | None,
    device,
    head_chunk: int,
    router_aux: RouterAuxLoss | None = None,
    every_parameter: bool = False,
) -> _Side:
    """One side's loss, log-probs and gradients of the sample: ``items`` run with their kinds' runners
    (:mod:`ds_tree.engine.runners`), gradients taken by a :class:`GradientCollector`; ``router_aux``: an MoE
    model's router load-balancing loss over the sample, added to either objective."""
    collector = GradientCollector(model)
    if rl is None:
        output = run_rows(
            model,
            items,
            normalisers,
            normalisation,
            backward=collector,
            dfs=dfs,
            collect_logprobs=True,
            device=device,
            head_chunk=head_chunk,
            router_aux=router_aux,
        )
    else:
        prepared = prepare_rl_rows(
            model,
            items,
            rl.advantages,
            rl.settings,
            StepNormalisers.of(rl.sample),
            reference=rl.reference,
            device=device,
            head_chunk=head_chunk,
            dfs=dfs,
            old_logprobs=rl.old_logprobs,
        )
        output = run_rl_rows(
            model,
            prepared,
            rl.settings,
            backward=collector,
            dfs=dfs,
            device=device,
            head_chunk=head_chunk,
            collect_logprobs=True,
            router_aux=router_aux,
        )
    gradients = collector.all_gradients() if every_parameter else collector.gradients
    return _Side(output.loss, _by_trajectory(sample, output.trajectory_logprobs), gradients)


def rl_inputs(
    model,
    trajectories: Sequence[Trajectory],
    advantages: dict[int, np.ndarray],
    settings: RLSettings,
    *,
    plan: PlanSettings,
    reference=None,
    dfs: DfsSettings | None = None,
    sequence_parallel: SequenceParallel | None = None,
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
) -> RLInputs:
    """Before the step's updates: the sample, its advantages, and its old log-probs from the model as
    the step's rollouts saw it (the tree side's no-grad forwards, its items run by their kinds' runners,
    shared by both sides so that both compute the same objective; with ``old_logprobs: data`` the
    sampler's, read later)."""
    sample = sample_groups(trajectories)
    old = None
    if settings.old_logprobs != "data" and sample:
        items, _ = tree_items(sample, plan, sequence_parallel)
        values = _tree_logprobs(model, sample, items, RunContext(device, head_chunk, dfs))
        if sequence_parallel is not None:
            values = _merge_over_group(values, sequence_parallel.group)
        old = {id(t): v for t, v in zip(sample, values, strict=True)}
    return RLInputs(sample, settings, {id(t): advantages[id(t)] for t in sample}, old, reference)


@torch.no_grad()
def _tree_logprobs(model, sample: Sequence[Trajectory], items: list[PackedRow], run: RunContext) -> list[np.ndarray]:
    """Per trajectory of the sample, ``log p`` of its tokens (index 0 unused, NaN) where this rank's items
    predict them: each item's runner scores the tokens the item owns (a shard: those predicted from it)."""
    index = {id(t): i for i, t in enumerate(sample)}
    values = [np.full(len(t), np.nan) for t in sample]
    for row in items:
        targets = np.flatnonzero(row.owned & (row.pred_pos >= 0))
        by_token = np.full(row.n_tokens + 1, np.nan)  # the last entry: tokens absent from the row
        by_token[targets] = runner_of(row).logprobs(model, row, targets, run)
        for trajectory, path in trajectory_copies(row):
            found = by_token[path]  # -1 (absent) reads the NaN entry
            known = ~np.isnan(found)
            values[index[id(trajectory)]][known] = found[known]
    return values


@contextlib.contextmanager
def zero3_leaf_hooks_suspended(optimizer) -> Iterator[None]:
    """ZeRO-3's backward hooks on its leaf modules (MoE blocks: ``set_z3_leaf_modules``) taken off the
    modules while the check runs, then put back under the same ids.

    They are module backward hooks, so unlike the parameters' gradient-accumulation hooks they also fire
    in the check's ``torch.autograd.grad``: they would reduce the check's gradients into training's
    partitions, and DeepSpeed's hook-counting in them fails inside ``autograd.grad`` ("A leaf node was
    passed to _will_engine_execute_node"). Any other optimizer (ZeRO-0..2, no MoE): nothing to do."""
    taken = []
    for handle in getattr(optimizer, "_leaf_module_hooks", ()):
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            taken.append((hooks, handle.id, hooks.pop(handle.id)))
    try:
        yield
    finally:
        for hooks, key, hook in taken:
            hooks[key] = hook


def check_sample(
    model,
    sample: Sequence[Trajectory],
    *,
    plan: PlanSettings,
    normalisation: str = "token_mean",
    dfs: DfsSettings | None = None,
    device: torch.device | str = "cpu",
    rl: RLInputs | None = None,
    sequence_parallel: SequenceParallel | None = None,
    head_chunk: int = 0,
    router_aux_loss_coef: float | None = None,
) -> SelfCheckResult:
    """Tree against flat on ``sample`` (module docstring): loss, log-probs and the trainable parameters'
    gradients, with the SFT objective or, given ``rl``, the RL objective (``rl.sample`` is the sample).
    ``model``: the bare module (not a DeepSpeed engine, whose backward hooks would count the check's
    backwards as training's). The tree side is the sample planned with the run's ``plan`` settings over
    ``sequence_parallel`` (this rank's group; None without sequence parallelism, :func:`tree_items`),
    its items run by their kinds' runners, walked ones as ``dfs`` says. An MoE model's objective includes
    its router load-balancing loss over the sample (``router_aux_loss_coef``, None: the model config's),
    as training adds it."""
    started = time.perf_counter()
    sample = list(rl.sample if rl is not None else sample)
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        longest = max((len(t) for t in sample), default=1)
        flat_rows = pack_trajectories(sample, "flat", max(plan.budget, longest))  # whole rows, on every rank
        items, group_items = tree_items(sample, plan, sequence_parallel)
        router_aux = RouterAuxLoss.of_model(model, router_aux_loss_coef, sum(len(t) for t in sample))
        common = dict(normalisation=normalisation, rl=rl, device=device, head_chunk=head_chunk, router_aux=router_aux)
        flat = _run_side(model, sample, flat_rows, Normalisers.from_rows(flat_rows), dfs=None, **common)
        normalisers = Normalisers.from_rows(group_items)  # the group's sums (as global_normalisers' over ranks)
        tree = _run_side(
            model, sample, items, normalisers, dfs=dfs, every_parameter=sequence_parallel is not None, **common
        )
        if sequence_parallel is not None:
            tree = _sum_over_group(tree, sequence_parallel)
    finally:
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    worst, worst_name = 0.0, ""
    for trajectory, a, b in zip(sample, tree.logprobs, flat.logprobs, strict=True):
        if rl is not None:  # the RL objective scores its targets only: compare where both sides did
            both = ~np.isnan(a) & ~np.isnan(b)
            a, b = a[both], b[both]
        error = float(np.abs(a - b).max(initial=0.0))
        if not error <= worst:  # NaN (a log-prob one side did not give) counts as the worst
            worst, worst_name = error, _name(trajectory)
    worst_parameter, grad_err = "", 0.0
    errors = gradient_errors(flat.gradients, tree.gradients)
    for name, error in errors.items():
        if not error <= grad_err:  # NaN counts as the worst
            worst_parameter, grad_err = name, error
            if math.isnan(error):
                break
    return SelfCheckResult(
        loss_tree=tree.loss,
        loss_flat=flat.loss,
        loss_rel_err=comparison.relative_error(tree.loss, flat.loss),
        max_abs_logprob_err=worst,
        worst_trajectory=worst_name,
        trajectories=len(sample),
        tokens=sum(len(t) for t in sample),
        seconds=time.perf_counter() - started,
        max_grad_rel_err=grad_err,
        worst_parameter=worst_parameter,
        parameters=len(errors),
        items=dict(Counter(row.kind for row in items if row.n_real)),
    )


def verdict(result: SelfCheckResult, step: int, dtype: torch.dtype) -> None:
    """Log the check's line; raise :class:`SelfCheckError` naming the step, the failing quantity, the
    worst trajectory or parameter, and the tolerance when an error exceeds ``dtype``'s (NaN included)."""
    tolerance = TOLERANCES[dtype]
    logger.info(
        "self-check step %d: tree vs flat on %d trajectories (%d tokens; tree items %s): loss rel err %.2e, max "
        "log-prob err %.2e, max gradient rel err %.2e over %d parameters (%s) (tolerance %.0e), %.2f s",
        step,
        result.trajectories,
        result.tokens,
        ", ".join(f"{count} {kind}" for kind, count in sorted(result.items.items())) or "-",
        result.loss_rel_err,
        result.max_abs_logprob_err,
        result.max_grad_rel_err,
        result.parameters,
        result.worst_parameter or "-",
        tolerance,
        result.seconds,
    )
    failures = []
    if not result.loss_rel_err <= tolerance:
        failures.append(
            f"loss relative error {result.loss_rel_err:.3e} (tree {result.loss_tree:.9g}, flat {result.loss_flat:.9g})"
        )
    if not result.max_grad_rel_err <= tolerance:
        failures.append(f"gradient relative error {result.max_grad_rel_err:.3e} (parameter {result.worst_parameter})")
    if not result.max_abs_logprob_err <= tolerance:
        failures.append(
            f"log-prob absolute error {result.max_abs_logprob_err:.3e} (worst trajectory: {result.worst_trajectory})"
        )
    if failures:
        raise SelfCheckError(
            f"step {step}: the tree result differs from the flat baseline on the self-check sample: "
            f"{'; '.join(failures)}; tolerance {tolerance:.0e} for {str(dtype).removeprefix('torch.')}. "
            "Run `ds-tree verify` on this data and model to locate it (objective.self_check: off skips the check)"
        )
