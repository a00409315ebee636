"""Tree mode against the flat baseline, from the same weights on the same data.

The flat baseline is every trajectory as its own sequence; tree mode packs each group's trie
(split under the budget when needed). Both use the same model, kernels and loss code; the only
difference is the layout. Loss, every trajectory's log-probabilities and every parameter's
gradient must agree to round-off of the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.attention.registry import has_backward
from ds_tree.comparison import TOLERANCES, gradient_errors, metric_errors, relative_error
from ds_tree.engine.dfs import DfsSettings, trajectory_logprobs
from ds_tree.losses.sft import Normalisers, check_objective
from ds_tree.models.loading import DTYPES, load_model, parse_dtype
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.models.vision import attach_rope_positions
from ds_tree.objectives.sft import run_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory, check_vocab

VERIFY_DTYPES = tuple(name for name, dtype in DTYPES.items() if dtype in TOLERANCES)
"""Names of the dtypes verification runs in."""
NO_BACKWARD = (
    "attention {attention!r} has no backward on the CPU (torch's FlexAttention): loss and log-probs were "
    "checked, gradients were NOT; check them on a GPU"
)


@dataclass
class ModeResult:
    loss: float
    gradients: dict[str, torch.Tensor]
    logprobs: dict[int, np.ndarray]
    packed_tokens: int
    rows: int
    router_aux: float | None = None
    """The router load-balancing loss (MoE models), before its coefficient."""


def run_mode(
    model,
    trajectories,
    mode,
    budget,
    block,
    normalisation,
    policy,
    head_chunk: int = 0,
    router_aux=None,
    dfs: DfsSettings | None = None,
    forward_only: bool = False,
) -> ModeResult:
    """One SFT pass of ``trajectories`` in ``mode`` (``dfs``: every tree walked with ``dfs``;
    ``forward_only``: no gradients, for an engine without a backward here)."""
    rows = pack_trajectories(trajectories, mode, budget, block)
    normalisers = Normalisers.from_rows(rows)
    model.zero_grad(set_to_none=True)
    run = torch.no_grad()(run_rows) if forward_only else run_rows
    output = run(
        model,
        rows,
        normalisers,
        normalisation,
        policy,
        backward_for=None if forward_only else lambda _: torch.Tensor.backward,
        dfs=dfs if mode == "dfs" else None,
        collect_logprobs=mode != "dfs",  # a walked row's log-probs: a no-grad walk, below
        head_chunk=head_chunk,
        router_aux=router_aux,
    )
    if mode == "dfs":
        output.trajectory_logprobs = trajectory_logprobs(model, rows, dfs.chunk, head_chunk=head_chunk)
    gradients = {
        name: parameter.grad.detach().clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }
    return ModeResult(
        loss=output.loss,
        gradients=gradients,
        logprobs=output.trajectory_logprobs,
        packed_tokens=sum(row.n_tokens for row in rows),
        rows=len(rows),
        router_aux=output.router_aux,
    )


def load_checked_model(
    source: str, *, attention: str, dtype: torch.dtype, seed: int, lora=None, checkpoint_every: int = 0
) -> torch.nn.Module:
    """The model of a verification run; with ``lora`` (:class:`ds_tree.config.LoraSettings`) wrapped
    with adapters whose A and B are both random (seeded), so that every adapter weight has a gradient
    (PEFT's B = 0 start leaves A's exactly 0)."""
    model = load_model(source, attention=attention, dtype=dtype, seed=seed, checkpoint_every=checkpoint_every)
    if lora is None:
        return model
    from ds_tree.models.lora import apply_lora

    torch.manual_seed(seed + 1)
    return apply_lora(model, lora, init_lora_weights=False)


def vocab_size(model) -> int:
    """The language model's vocabulary (a vision-language config keeps it in its ``text_config``)."""
    return model.config.get_text_config().vocab_size


def check_images(model, trajectories: list[Trajectory]) -> None:
    """Trajectories with images need a vision-language model and their rope positions by the model's
    rule (set here, :func:`~ds_tree.models.vision.attach_rope_positions`)."""
    attach_rope_positions(model.config, trajectories)


def verification_dtype(trajectories: list[Trajectory], dtype: str) -> torch.dtype:
    """The torch dtype of a verification run (float64 or float32), with something to verify."""
    if not trajectories:
        raise ValueError("no trajectories to verify")
    torch_dtype = parse_dtype(dtype)
    if torch_dtype not in TOLERANCES:
        raise ValueError(f"verification runs in float64 or float32, not {dtype}")
    return torch_dtype


def compare(
    trajectories: list[Trajectory],
    model_source: str,
    *,
    dtype: str = "float64",
    seed: int = 0,
    budget: int = 4096,
    block: int = 1,
    attention: str = "torch",
    normalisation: str = "token_mean",
    policy: str = "exact",
    router_aux_loss_coef: float | None = None,
    dfs: DfsSettings | None = None,
    lora=None,
) -> dict:
    """Run flat and tree mode and return the verification report (see ``ds_tree.cli.verify``).

    An MoE model's objective includes its router load-balancing loss (:mod:`ds_tree.models.moe`),
    weighted by ``router_aux_loss_coef`` (None: the model config's ``router_aux_loss_coef``).
    With ``dfs``, every tree is also walked in dfs mode and compared with flat (``dfs_*`` fields).
    ``lora``: LoRA adapters on the model (:func:`load_checked_model`); the gradients are the adapters'.
    """
    check_objective(normalisation, policy)
    torch_dtype = verification_dtype(trajectories, dtype)
    model = load_checked_model(model_source, attention=attention, dtype=torch_dtype, seed=seed, lora=lora)
    check_vocab(trajectories, vocab_size(model))
    check_images(model, trajectories)
    router_aux = RouterAuxLoss.of_model(model, router_aux_loss_coef, sum(len(t) for t in trajectories))
    gradients_checked = has_backward(attention)
    if not gradients_checked and dfs is not None:
        raise ValueError(f"attention {attention!r} has no backward on the CPU: dfs mode cannot be checked with it")
    modes = dict(router_aux=router_aux, forward_only=not gradients_checked)
    flat = run_mode(model, trajectories, "flat", budget, block, normalisation, policy, **modes)
    tree = run_mode(model, trajectories, "tree", budget, block, normalisation, policy, **modes)
    walked = {}
    if dfs is not None:
        result = run_mode(
            model, trajectories, "dfs", budget, block, normalisation, policy, router_aux=router_aux, dfs=dfs
        )
        walked = dfs_errors(flat, result, dfs)

    grad_errors = gradient_errors(flat.gradients, tree.gradients)
    if set(tree.logprobs) != set(flat.logprobs):
        raise AssertionError("tree and flat mode disagree on which trajectories they computed")
    logprob_errors = [np.abs(tree.logprobs[key] - flat.logprobs[key]).max(initial=0.0) for key in flat.logprobs]

    counts = token_counts(trajectories)
    tolerance = TOLERANCES[torch_dtype]
    max_rel_grad_err = max(grad_errors.values(), default=0.0) if gradients_checked else None
    max_abs_logprob_err = float(max(logprob_errors, default=0.0))
    loss_rel_err = relative_error(tree.loss, flat.loss)
    router_aux_rel_err = relative_error(tree.router_aux, flat.router_aux) if router_aux else 0.0
    return {
        "n_trajectories": len(trajectories),
        "n_groups": len({t.group_id for t in trajectories}),
        "flat_tokens": counts.flat_tokens,
        "tree_tokens": counts.tree_tokens,
        "ideal_speedup": counts.ideal_speedup,
        "packed_tokens_flat": flat.packed_tokens,
        "packed_tokens_tree": tree.packed_tokens,
        "rows_flat": flat.rows,
        "rows_tree": tree.rows,
        "dtype": dtype,
        "attention": attention,
        "lora_rank": lora.rank if lora is not None else 0,
        "normalisation": normalisation,
        "policy": policy,
        "loss_flat": flat.loss,
        "loss_tree": tree.loss,
        "loss_rel_err": loss_rel_err,
        "router_aux_loss_coef": router_aux.coefficient if router_aux else None,
        "router_aux_flat": flat.router_aux,
        "router_aux_tree": tree.router_aux,
        "router_aux_rel_err": router_aux_rel_err,
        "gradients_checked": gradients_checked,
        "gradients_not_checked_because": None if gradients_checked else NO_BACKWARD.format(attention=attention),
        "max_rel_grad_err": max_rel_grad_err,
        "worst_parameter": max(grad_errors, key=grad_errors.get) if grad_errors else None,
        "max_abs_logprob_err": max_abs_logprob_err,
        "tolerance": tolerance,
        "passed": bool(
            policy == "exact"
            and (not gradients_checked or max_rel_grad_err <= tolerance)
            and max_abs_logprob_err <= tolerance
            and loss_rel_err <= tolerance
            and router_aux_rel_err <= tolerance
            and all(walked[name] <= tolerance for name in DFS_ERRORS if name in walked)
        ),
        **walked,
    }


DFS_ERRORS = (
    "dfs_loss_rel_err",
    "dfs_max_rel_grad_err",
    "dfs_max_abs_logprob_err",
    "dfs_max_rel_metric_err",
    "dfs_router_aux_rel_err",
)
"""The ``dfs_*`` report fields that must stay within the tolerance."""


def dfs_errors(flat, walked, dfs: DfsSettings, flat_logprobs=None, walked_logprobs=None) -> dict:
    """The ``dfs_*`` report fields: the walked pass (SFT :class:`ModeResult`, RL :class:`RLModeResult`) against flat."""
    errors = gradient_errors(flat.gradients, walked.gradients)
    flat_logprobs = flat_logprobs if flat_logprobs is not None else flat.logprobs
    walked_logprobs = walked_logprobs if walked_logprobs is not None else walked.logprobs
    if set(flat_logprobs) != set(walked_logprobs):
        raise AssertionError("dfs and flat mode disagree on which trajectories they computed")
    report = {
        "dfs_chunk": dfs.chunk,
        "dfs_recompute": dfs.recompute,
        "loss_dfs": walked.loss,
        "dfs_loss_rel_err": relative_error(walked.loss, flat.loss),
        "dfs_max_rel_grad_err": max(errors.values(), default=0.0),
        "dfs_max_abs_logprob_err": float(
            max((np.abs(walked_logprobs[k] - flat_logprobs[k]).max(initial=0.0) for k in flat_logprobs), default=0.0)
        ),
    }
    if walked.router_aux is not None:
        report["dfs_router_aux_rel_err"] = relative_error(walked.router_aux, flat.router_aux)
    if isinstance(walked, RLModeResult):
        report["dfs_max_rel_metric_err"] = max(metric_errors(flat.metrics, walked.metrics).values(), default=0.0)
    return report


# ------------------------------------------------------------------------------------------ RL
def perturb_parameters(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Move every parameter by ``scale`` times its own spread (seeded), so that token ratios
    ``pi / pi_old`` leave the clip range on both sides."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in (p for p in model.parameters() if p.requires_grad):  # LoRA: the adapters only
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64).to(parameter.dtype)
            spread = parameter.detach().double().std().item() if parameter.numel() > 1 else 1.0
            parameter.add_(noise * (scale * (spread if spread > 0 else 1.0)))


def rl_policies(
    model_source: str,
    attention: str,
    dtype: torch.dtype,
    seed: int,
    perturbation: float,
    *,
    lora=None,
    checkpoint_every: int = 0,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The RL checks' two policies: the old one (the model at ``seed``, no gradients) and the trained one
    (the same weights moved by ``perturbation`` times each parameter's spread; ``checkpoint_every`` as
    :func:`~ds_tree.models.loading.load_model`). ``lora``: both carry the same random adapters, the trained
    one's alone perturbed (:func:`load_checked_model`)."""
    old = load_checked_model(model_source, attention=attention, dtype=dtype, seed=seed, lora=lora)
    old.requires_grad_(False)
    model = load_checked_model(
        model_source, attention=attention, dtype=dtype, seed=seed, lora=lora, checkpoint_every=checkpoint_every
    )
    perturb_parameters(model, perturbation, seed + 1)
    return old, model


def checked_advantages(
    trajectories: list[Trajectory], estimator: str, normalise: bool = False, tempo_coef: float = 1.0, values=None
):
    """The estimator's advantages (:func:`~ds_tree.losses.advantages.estimate`; ``values``: ``gae``'s), statistics
    that overflow float64 (rewards) refused as a data error."""
    from ds_tree.losses.advantages import check_finite_statistics, estimate

    computed = estimate(trajectories, estimator, normalise, tempo_coef=tempo_coef, values=values)
    check_finite_statistics(trajectories, computed.values)
    return computed


@dataclass
class RLModeResult:
    loss: float
    gradients: dict[str, torch.Tensor]
    metrics: dict[str, float]
    packed_tokens: int
    rows: int
    router_aux: float | None = None
    """The router load-balancing loss (MoE models), before its coefficient."""


def run_rl_mode(
    model,
    old_model,
    reference,
    trajectories,
    mode,
    budget,
    block,
    advantages,
    settings,
    head_chunk: int = 0,
    dfs: DfsSettings | None = None,
    router_aux: RouterAuxLoss | None = None,
) -> RLModeResult:
    """One RL pass (old log-probs from ``old_model``, loss and gradients of ``model``) in ``mode``
    (``dfs``: every tree walked with ``dfs``, the old and reference log-probs too; ``router_aux``: the
    MoE router loss added, on ``model``'s routing)."""
    from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows

    rows = pack_trajectories(trajectories, mode, budget, block)
    normalisers = StepNormalisers.of(trajectories)
    prepared = prepare_rl_rows(
        old_model, rows, advantages, settings, normalisers, reference=reference, head_chunk=head_chunk, dfs=dfs
    )
    model.zero_grad(set_to_none=True)
    backward_for = lambda _: torch.Tensor.backward  # noqa: E731
    walk = dfs if mode == "dfs" else None
    output = run_rl_rows(
        model, prepared, settings, backward_for=backward_for, dfs=walk, head_chunk=head_chunk, router_aux=router_aux
    )
    gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return RLModeResult(
        output.loss, gradients, output.metrics or {}, sum(r.n_tokens for r in rows), len(rows), output.router_aux
    )


def compare_rl(
    trajectories: list[Trajectory],
    model_source: str,
    *,
    estimator: str = "grpo",
    normalise_advantages: bool = False,
    tempo_coef: float = 1.0,
    settings=None,
    dtype: str = "float64",
    seed: int = 0,
    budget: int = 4096,
    block: int = 1,
    attention: str = "torch",
    perturbation: float = 0.5,
    head_chunk: int = 0,
    checkpoint_every: int = 0,
    dfs: DfsSettings | None = None,
    lora=None,
    router_aux_loss_coef: float | None = None,
    critic=None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> dict:
    """RL objective, tree vs flat: old log-probs, loss, metrics and every gradient (``ds-tree verify --objective``).

    The old policy is the model at ``seed``; the trained policy is that model with every parameter
    moved by ``perturbation`` times its spread, so ratios leave the clip range on both sides (the
    report counts the clipped tokens of each side). The reference policy (KL) is the old policy.
    ``head_chunk`` and ``checkpoint_every`` (of the trained policy) are the memory modes of
    :func:`ds_tree.models.logprobs.logprobs_at` and :func:`ds_tree.models.loading.load_model`.
    With ``dfs``, every tree is also walked in dfs mode and compared with flat (``dfs_*`` fields).
    ``lora``: both policies carry the same random adapters (:func:`load_checked_model`), the trained
    one's adapters alone are perturbed, and the KL reference is the trained policy with its adapters
    disabled (the base model, as in training).
    An MoE model's objective includes its router load-balancing loss on the trained policy's routing
    (docs/RL.md), weighted by ``router_aux_loss_coef`` (None: the model config's), its value compared too.
    ``estimator: gae``: ``critic`` (:class:`ds_tree.config.CriticSettings`) is PPO's learned critic, with ``gamma``
    and ``lam``: each layout scores the old critic's values on its own items for its GAE advantages, and the trained
    critic's values, value loss and every gradient are compared as well (``critic_*`` fields,
    :mod:`ds_tree.verify.critic`).
    """
    from ds_tree.losses.rl import RLSettings

    settings = settings or RLSettings()
    torch_dtype = verification_dtype(trajectories, dtype)
    old_model, model = rl_policies(
        model_source, attention, torch_dtype, seed, perturbation, lora=lora, checkpoint_every=checkpoint_every
    )
    check_vocab(trajectories, vocab_size(old_model))
    check_images(old_model, trajectories)
    reference = old_model if settings.kl_coef else None
    if lora is not None and settings.kl_coef:
        from ds_tree.models.lora import AdaptersDisabled

        reference = AdaptersDisabled(model)
    check = None
    if estimator == "gae":
        from ds_tree.verify.critic import CriticCheck, policy_advantages

        options = dict(attention=attention, dtype=torch_dtype, seed=seed, perturbation=perturbation)
        check = CriticCheck.of(
            critic.source,
            old_policy=old_model,
            policy=model,
            value_clip=critic.value_clip,
            gamma=gamma,
            lam=lam,
            perturb=perturb_parameters,
            **options,
        )
        advantages, singletons = None, 0
    else:
        computed = checked_advantages(trajectories, estimator, normalise_advantages, tempo_coef)
        advantages, singletons = computed.by_trajectory(), computed.singletons
    router_aux = RouterAuxLoss.of_model(model, router_aux_loss_coef, sum(len(t) for t in trajectories))
    critics = {}

    def layout_advantages(mode: str, walk: DfsSettings | None = None) -> dict[int, np.ndarray]:
        """The advantages layout ``mode`` trains with: the estimator's, or GAE from its own critic values."""
        if check is None:
            return advantages
        rows = pack_trajectories(trajectories, mode, budget, block)
        values = check.values(trajectories, rows, walk)
        computed = check.advantages(trajectories, values)
        critics[mode] = check.result(trajectories, rows, values, computed, settings, walk)
        return policy_advantages(trajectories, computed, normalise_advantages)

    with torch.no_grad():  # old log-probs per trajectory, tree forward against flat forward
        old = {
            mode: run_rows(
                old_model,
                pack_trajectories(trajectories, mode, budget, block),
                Normalisers(1.0, 1.0, 1.0),
                collect_logprobs=True,
                head_chunk=head_chunk,
            ).trajectory_logprobs
            for mode in ("flat", "tree")
        }
    logprob_err = max((np.abs(old["tree"][k] - old["flat"][k]).max(initial=0.0) for k in old["flat"]), default=0.0)
    flat, tree = (
        run_rl_mode(
            model,
            old_model,
            reference,
            trajectories,
            mode,
            budget,
            block,
            layout_advantages(mode),
            settings,
            head_chunk,
            router_aux=router_aux,
        )
        for mode in ("flat", "tree")
    )
    walked = {}
    if dfs is not None:
        result = run_rl_mode(
            model,
            old_model,
            reference,
            trajectories,
            "dfs",
            budget,
            block,
            layout_advantages("dfs", dfs),
            settings,
            head_chunk,
            dfs,
            router_aux=router_aux,
        )
        rows = pack_trajectories(trajectories, "dfs", budget, block)
        old_walked = trajectory_logprobs(old_model, rows, dfs.chunk, head_chunk=head_chunk)
        walked = dfs_errors(flat, result, dfs, old["flat"], old_walked)
    critic_report = {}
    if check is not None:
        from ds_tree.verify.critic import critic_errors

        critic_report = critic_errors(critics["flat"], critics["tree"])
        if "dfs" in critics:
            critic_report |= critic_errors(critics["flat"], critics["dfs"], "dfs_")

    grad_errors = gradient_errors(flat.gradients, tree.gradients)
    errors_of_metrics = metric_errors(flat.metrics, tree.metrics)
    counts = token_counts(trajectories)
    tolerance = TOLERANCES[torch_dtype]
    loss_rel_err = relative_error(tree.loss, flat.loss)
    max_rel_grad_err = max(grad_errors.values(), default=0.0)
    max_metric_err = max(errors_of_metrics.values(), default=0.0)
    router_aux_rel_err = relative_error(tree.router_aux, flat.router_aux) if router_aux else 0.0
    return {
        "n_trajectories": len(trajectories),
        "flat_tokens": counts.flat_tokens,
        "tree_tokens": counts.tree_tokens,
        "ideal_speedup": counts.ideal_speedup,
        "rows_flat": flat.rows,
        "rows_tree": tree.rows,
        "dtype": dtype,
        "lora_rank": lora.rank if lora is not None else 0,
        "estimator": estimator,
        **({"tempo_coef": tempo_coef} if estimator == "tempo" else {}),
        **({"critic": critic.source, "gamma": gamma, "lam": lam, "value_clip": critic.value_clip} if check else {}),
        "aggregation": settings.aggregation,
        "singleton_trajectories": singletons,
        "loss_flat": flat.loss,
        "loss_tree": tree.loss,
        "loss_rel_err": loss_rel_err,
        "max_rel_grad_err": max_rel_grad_err,
        "worst_parameter": max(grad_errors, key=grad_errors.get) if grad_errors else None,
        "max_abs_old_logprob_err": float(logprob_err),
        "max_rel_metric_err": max_metric_err,
        "metrics_flat": flat.metrics,
        "metrics_tree": tree.metrics,
        "router_aux_loss_coef": router_aux.coefficient if router_aux else None,
        "router_aux_flat": flat.router_aux,
        "router_aux_tree": tree.router_aux,
        "router_aux_rel_err": router_aux_rel_err,
        "tolerance": tolerance,
        "passed": bool(
            max_rel_grad_err <= tolerance
            and loss_rel_err <= tolerance
            and logprob_err <= tolerance
            and max_metric_err <= tolerance
            and router_aux_rel_err <= tolerance
            and all(walked[name] <= tolerance for name in DFS_ERRORS if name in walked)
            and all(value <= tolerance for name, value in critic_report.items() if name.endswith("_err"))
        ),
        **walked,
        **critic_report,
    }
