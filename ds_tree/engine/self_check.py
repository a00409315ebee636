"""The training-time tree-vs-flat self-check (``objective.self_check``; docs/LORA.md, "Self-check").

A hook the trainer runs after each step (:class:`SelfCheck`), fed by the objective: on the steps it checks,
the objective records what its loss on a small sample needs (:class:`CheckedObjective`: the sample, whole
groups of the step's trajectories in order, up to :data:`SAMPLE_TOKENS` flat tokens, or when none fits the
first trajectories of the smallest group, two at least, :func:`sample_groups`; RL: the step's advantages and
its old log-probs, recorded before the step's updates). After the step the hook computes, with the model as
it is (the same weights for both sides), that objective twice:

- the tree: the sample laid out as the run lays out a step, by the step plan itself
  (:func:`~ds_tree.packing.plan.plan_step` with the run's plan settings, over this rank's
  sequence-parallel group: :func:`tree_items`), each work item run by the runner registered for its
  kind (:mod:`ds_tree.engine.runners`: packed rows, dfs walks, sequence-parallel shards, walks sharded
  over the group), with its restoration weights and normalisers; whatever kind the run gives the
  sample's trees is the kind checked;
- the flat baseline: every trajectory its own sequence, its own loss terms (whole rows, on every rank).

Each side gives the loss, every trajectory's log-probs (from its forwards with gradients,
:attr:`~ds_tree.engine.runners.RunContext.collect_logprobs`) and the gradient of every trainable
parameter. SFT runs compare the restoration-weighted SFT loss (:class:`ds_tree.objectives.sft.SFTCheck`);
RL runs compare the clipped objective with its KL and entropy terms, the step's advantages, old and
reference log-probs (:class:`ds_tree.objectives.policy_gradient.PolicyGradientCheck`). The check stops the run
(:class:`SelfCheckError`) when the loss's or a gradient's relative error, or a log-prob's absolute error,
exceeds the tolerance of the model's dtype (:data:`TOLERANCES`).

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ds_tree import comparison
from ds_tree.config import Config, self_check_every
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.layout import StepLayout
from ds_tree.engine.runners import RunContext, StepOutput
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


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group, over which the tree side plans the sample (:func:`tree_items`)."""

    size: int
    position: int
    """This rank's position in the group: whose items of the group's plan it runs."""
    group: object | None = None
    """The process group (DeepSpeed's sequence-parallel group); None: the default group."""


@dataclass(frozen=True)
class CheckSettings:
    """How the check lays out and runs the sample: the run's own settings at the step checked."""

    plan: PlanSettings
    dfs: DfsSettings | None = None
    device: torch.device | str = "cpu"
    sequence_parallel: SequenceParallel | None = None
    head_chunk: int = 0


class CheckedObjective(Protocol):
    """An objective's loss on the sample, as the objective records it for a checked step."""

    sample: list[Trajectory]
    targets_only: bool
    """Its loss scores only some tokens (RL: the trained ones): log-probs are compared where both sides
    scored them, not on every predicted token."""

    def run(
        self, model, items: list[PackedRow], group_items: list[PackedRow], backward: Callable, run: RunContext
    ) -> StepOutput:
        """Forward this rank's ``items`` of the sample and hand their loss to ``backward``, with the log-probs
        ``run`` collects; ``group_items`` are every item of the sample's plan (its normalisers' rows)."""


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


def sample_units(sizes: Sequence[int], cap: int = SAMPLE_TOKENS) -> list[int]:
    """The units (groups, by flat tokens ``sizes`` in step order) :func:`sample_groups` takes from: the whole
    groups it picks, or when none fits the smallest group (whose first trajectories it takes). So
    ``sample_groups`` of these units' trajectories is the step's sample, from their sizes alone."""
    picked, tokens = [], 0
    for unit, size in enumerate(sizes):
        if tokens + size <= cap:
            picked.append(unit)
            tokens += size
    if not picked and len(sizes):
        picked = [int(np.argmin(sizes))]  # the first smallest, as min() picks it
    return picked


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


def merge_over_group(values: list[np.ndarray], group) -> list[np.ndarray]:
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
    return _Side(float(loss.item()), merge_over_group(side.logprobs, group), side.gradients)


def _run_side(
    model,
    inputs: CheckedObjective,
    items: list[PackedRow],
    group_items: list[PackedRow],
    run: RunContext,
    every_parameter: bool = False,
) -> _Side:
    """One side's loss, log-probs and gradients of the sample: ``items`` run by the objective's ``inputs``
    with their kinds' runners (:mod:`ds_tree.engine.runners`), gradients taken by a :class:`GradientCollector`;
    ``run.router_aux``: an MoE model's router load-balancing loss over the sample, added to either objective."""
    collector = GradientCollector(model)
    output = inputs.run(model, items, group_items, collector, run)
    gradients = collector.all_gradients() if every_parameter else collector.gradients
    return _Side(output.loss, _by_trajectory(inputs.sample, output.trajectory_logprobs), gradients)


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
    model, inputs: CheckedObjective, settings: CheckSettings, router_aux_loss_coef: float | None = None
) -> SelfCheckResult:
    """Tree against flat on the sample of ``inputs`` (module docstring): loss, log-probs and the trainable
    parameters' gradients of the objective that recorded them. ``model``: the bare module (not a DeepSpeed
    engine, whose backward hooks would count the check's backwards as training's). The tree side is the
    sample planned with the run's plan settings over ``settings.sequence_parallel`` (this rank's group; None
    without sequence parallelism, :func:`tree_items`), its items run by their kinds' runners, walked ones as
    ``settings.dfs`` says. An MoE model's objective includes its router load-balancing loss over the sample
    (``router_aux_loss_coef``, None: the model config's), as training adds it."""
    started = time.perf_counter()
    sample = list(inputs.sample)
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        longest = max((len(t) for t in sample), default=1)
        flat_rows = pack_trajectories(sample, "flat", max(settings.plan.budget, longest))  # whole rows, on every rank
        items, group_items = tree_items(sample, settings.plan, settings.sequence_parallel)
        router_aux = RouterAuxLoss.of_model(model, router_aux_loss_coef, sum(len(t) for t in sample))
        device, head_chunk = settings.device, settings.head_chunk
        flat_run = RunContext(device, head_chunk, None, router_aux, collect_logprobs=True)
        flat = _run_side(model, inputs, flat_rows, flat_rows, flat_run)
        tree_run = RunContext(device, head_chunk, settings.dfs, router_aux, collect_logprobs=True)
        sharded = settings.sequence_parallel is not None
        tree = _run_side(model, inputs, items, group_items, tree_run, every_parameter=sharded)
        if sharded:
            tree = _sum_over_group(tree, settings.sequence_parallel)
    finally:
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    worst, worst_name = 0.0, ""
    for trajectory, a, b in zip(sample, tree.logprobs, flat.logprobs, strict=True):
        if inputs.targets_only:  # an objective scoring some targets only: compare where both sides did
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


class SelfCheck:
    """``objective.self_check`` as a hook around each training step (module docstring): the objective asks
    :meth:`wanted` and :meth:`record` s its :class:`CheckedObjective` before its updates, the trainer runs
    :meth:`after_step`.

    A due step whose loss is not finite (discarded by ``optimizer.non_finite: skip``) is not a tree-vs-flat
    question: both sides are NaN. The check moves to the next step with a finite loss. So does a due step
    for which the objective recorded nothing (a multi-turn RL run's warm-up step, SFT on demonstrations):
    the run's first RL step is checked.
    """

    def __init__(self, config: Config, layout: StepLayout, engine, first_step: int, sequence_parallel=None) -> None:
        self.config = config
        self.layout = layout
        self.engine = engine
        """The policy's DeepSpeed engine: the check runs its bare module."""
        self.first_step = first_step
        """This run's first step (``first`` checks it)."""
        self.sequence_parallel = sequence_parallel
        """This rank's sequence-parallel group (:func:`~ds_tree.models.ulysses.enable_sequence_parallel`), or None."""
        self.deferred = False
        """A due step was not checked (module docstring): the next step is."""
        self.inputs: CheckedObjective | None = None
        """What the objective recorded for the step being run."""

    def wanted(self, step: int) -> bool:
        """Whether ``step`` (0-based) is checked: due under ``objective.self_check``, or after a deferred one."""
        return self.deferred or is_due(self.config.objective.self_check, step, self.first_step)

    def settings(self) -> CheckSettings:
        """The run's layout as the check takes it, from the config as it is now."""
        return CheckSettings(
            plan=self.layout.plan_settings(),  # the sample's items: the kinds this run's plan gives them
            dfs=self.layout.dfs_settings(),
            device=self.engine.device,
            sequence_parallel=self.group(),
            head_chunk=self.config.model.head_chunk,
        )

    def group(self) -> SequenceParallel | None:
        """This rank's sequence-parallel group, over which the sample is planned (None without SP)."""
        if self.sequence_parallel is None:
            return None
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        group = self.sequence_parallel
        return SequenceParallel(group.size, group.position, parallel_state_sp.get_sequence_parallel_group())

    def record(self, inputs: CheckedObjective | None) -> None:
        """The objective's inputs for the step being run (None: nothing to check on it)."""
        self.inputs = inputs
        self.release()  # the no-grad forwards that made them (RL's old log-probs) may leave parameters prefetched

    def after_step(self, step: int, loss: float) -> dict[str, float]:
        """The check of ``step`` when it is wanted: its ``selfcheck/`` scalars, or a :class:`SelfCheckError`."""
        inputs, self.inputs = self.inputs, None
        if not self.wanted(step):
            return {}
        self.deferred = not math.isfinite(loss) or inputs is None
        if self.deferred or not inputs.sample:
            return {}
        with zero3_leaf_hooks_suspended(self.engine.optimizer):
            result = check_sample(
                self.engine.module,  # the bare module: the engine's backward hooks stay out of the check
                inputs,
                self.settings(),
                router_aux_loss_coef=self.config.model.router_aux_loss_coef,
            )
        self.release()
        dtype = torch.bfloat16 if self.config.model.dtype == "bfloat16" else torch.float32
        verdict(result, step + 1, dtype)
        return result.scalars()

    def release(self) -> None:
        """After the check's forwards, outside a training step: ZeRO-3 may still hold parameters it
        prefetched for them, in flight. Release them now, or the next gather of a parameter (the vLLM
        weight sync) fails with "Cannot partition a param in flight"."""
        if self.engine.zero_optimization_stage() == 3:
            self.engine.empty_partition_cache()
