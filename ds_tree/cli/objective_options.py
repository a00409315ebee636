"""The ``--objective`` options ``verify`` and ``bench`` share: SFT, the RL objective, distillation or DPO
(docs/RL.md).

The RL options map one to one onto :class:`ds_tree.config.ObjectiveConfig` fields, so the command
line gets the config's defaults and checks (``--dual-clip 0`` is off, as ``dual_clip: 0`` is in a
config); ``--teacher`` sets ``objective.teacher``, ``--distill-X``, ``--dpo-X`` and ``--cppo-X`` the fields
``X`` of the ``objective.distill``, ``objective.dpo`` and ``objective.cppo`` sections (``--cppo`` sets
``cppo.enabled``). An RL option given with ``--objective sft``, an SFT option with an RL objective, or an option
of another objective is a usage error rather than silently ignored.
"""

from __future__ import annotations

import argparse

from ds_tree.cli.choices import (  # registries: --help stays fast
    DISTILL_LOSSES,
    DPO_LOSSES,
    DPO_PAIRINGS,
    KL_ESTIMATORS,
    aggregations,
    estimators,
    objectives,
)
from ds_tree.cli.common import POSITIVE_INT, finite_float
from ds_tree.config import ConfigError, CriticSettings, ObjectiveConfig, objective_strays


def add_objective_arguments(parser: argparse.ArgumentParser, *, epochs: bool = False) -> argparse._ArgumentGroup:
    """``--objective`` and the RL options (all ``None`` unless given); returns the RL group for more."""
    parser.add_argument(
        "--objective",
        default="sft",
        choices=objectives(),
        help="sft: weighted next-token loss; grpo / ppo: the clipped policy-gradient objective (docs/RL.md)",
    )
    group = parser.add_argument_group("RL objective (only with --objective grpo or ppo)")
    group.add_argument(
        "--estimator", choices=estimators(), help="advantage estimator (default: grpo for grpo, given for ppo)"
    )
    group.add_argument(
        "--normalise-advantages", action="store_true", default=None, help="divide advantages by the reward std"
    )
    group.add_argument(
        "--tempo-coef", type=finite_float, help="tempo: coefficient of the branch-gated TD term (default 1; 0 is grpo)"
    )
    group.add_argument("--aggregation", choices=aggregations(), help="loss aggregation (default token_mean)")
    group.add_argument("--aggregation-constant", type=finite_float, help="the constant of token_sum_norm")
    group.add_argument("--eps-low", type=finite_float, help="ratio clipped at 1 - eps_low (default 0.2)")
    group.add_argument("--eps-high", type=finite_float, help="ratio clipped at 1 + eps_high (default 0.2)")
    group.add_argument("--dual-clip", type=finite_float, help="dual clip constant > 1 (default 0: off)")
    group.add_argument("--kl-coef", type=finite_float, help="KL penalty to the reference policy (default 0)")
    group.add_argument("--kl-estimator", choices=KL_ESTIMATORS, help="per-token KL estimator (default k3)")
    group.add_argument("--entropy-coef", type=finite_float, help="entropy bonus (default 0)")
    group.add_argument(
        "--critic",
        metavar="SOURCE",
        help="gae: PPO's learned critic, a model config JSON, a model directory or `policy` (a value head on the "
        "policy's trunk)",
    )
    group.add_argument("--gamma", type=finite_float, help="gae: discount per trained token (default 1)")
    group.add_argument("--lam", type=finite_float, help="gae: GAE's lambda (default 0.95)")
    group.add_argument("--value-clip", type=finite_float, help="gae: the value loss's clip range (default 0.2; 0: off)")
    group.add_argument(
        "--cppo",
        dest="cppo_enabled",
        action="store_true",
        default=None,
        help="CPPO's prefix-budget mask instead of the ratio clip (objective.cppo; docs/RL.md)",
    )
    group.add_argument("--cppo-delta", type=finite_float, help="cppo: the token threshold (default 0.15)")
    group.add_argument("--cppo-w-min", type=finite_float, help="cppo: the last token's position weight (default 0.8)")
    group.add_argument("--cppo-budget", type=finite_float, help="cppo: the prefix budget delta_b (default 0.02)")
    group.add_argument("--cppo-divergence", choices=("tv", "kl"), help="cppo: tv or the binary kl (default tv)")
    if epochs:
        group.add_argument(
            "--ppo-epochs", type=POSITIVE_INT, help="update passes over each step's rollouts (default 1)"
        )
    add_distill_dpo_arguments(parser)
    return group


def add_distill_dpo_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--objective distill`` and ``dpo`` (``objective.teacher``, ``objective.distill.*``,
    ``objective.dpo.*``; all ``None`` unless given)."""
    distill = parser.add_argument_group("distillation (only with --objective distill; docs/RL.md)")
    distill.add_argument("--teacher", metavar="MODEL", help="the teacher: a model config JSON or HF directory")
    distill.add_argument("--distill-loss", choices=DISTILL_LOSSES, help="default reverse_kl_sampled")
    distill.add_argument("--distill-beta", type=finite_float, help="jsd's mixture weight in (0, 1) (default 0.5)")
    dpo = parser.add_argument_group("DPO (only with --objective dpo; docs/RL.md)")
    dpo.add_argument("--dpo-beta", type=finite_float, help="inverse temperature of the margin (default 0.1)")
    dpo.add_argument("--dpo-loss", choices=DPO_LOSSES, help="sigmoid (DPO) or ipo (default sigmoid)")
    dpo.add_argument("--dpo-label-smoothing", type=finite_float, help="sigmoid: share of flipped labels (default 0)")
    dpo.add_argument(
        "--dpo-pairs", choices=DPO_PAIRINGS, help="where pairs come from: siblings, a tree's forks (the default)"
    )


RL_FIELDS = (
    "estimator",
    "normalise_advantages",
    "tempo_coef",
    "aggregation",
    "aggregation_constant",
    "eps_low",
    "eps_high",
    "dual_clip",
    "kl_coef",
    "kl_estimator",
    "entropy_coef",
    "ppo_epochs",
    "gamma",
    "lam",
)
"""ObjectiveConfig fields that the RL options set (argument ``--x-y`` sets field ``x_y``); all of them are
in :data:`ds_tree.config.RL_ONLY_FIELDS`."""
CRITIC_OPTIONS = {"critic": "source", "value_clip": "value_clip"}
"""The options that set ``objective.critic``'s fields (:class:`ds_tree.config.CriticSettings`)."""


SECTION_OPTIONS = {
    "distill": ("loss", "beta"),
    "dpo": ("beta", "loss", "label_smoothing", "pairs"),
    "cppo": ("enabled", "delta", "w_min", "budget", "divergence"),
}
"""The nested sections' fields the options set (argument ``--distill-loss`` sets ``distill.loss``)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _sections(options: dict) -> dict:
    """``teacher`` and the ``distill`` / ``dpo`` sections the options give (only those given)."""
    from ds_tree.config import CPPOConfig, DistillSettings, DPOSettings

    chosen = {"teacher": options["teacher"]} if options.get("teacher") is not None else {}
    for section, kind in (("distill", DistillSettings), ("dpo", DPOSettings), ("cppo", CPPOConfig)):
        values = {name: options.get(f"{section}_{name}") for name in SECTION_OPTIONS[section]}
        values = {name: value for name, value in values.items() if value is not None}
        if values:
            chosen[section] = kind(**values)
    return chosen


def objective_config(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    rl_only: tuple[str, ...] = (),
    sft_only: tuple[str, ...] = (),
) -> ObjectiveConfig | None:
    """The RL objective the options describe, or ``None`` for SFT; a usage error (exit 2) on a
    contradiction. ``rl_only`` / ``sft_only`` name more of the command's options (``None`` unless given)."""
    options = vars(args)
    chosen = {name: options[name] for name in RL_FIELDS if options.get(name) is not None}
    critic = {field: options[name] for name, field in CRITIC_OPTIONS.items() if options.get(name) is not None}
    try:
        chosen |= _sections(options)
        if critic:
            chosen["critic"] = CriticSettings(**critic)
    except ConfigError as error:
        parser.error(str(error))
    if args.objective == "sft":  # the config's rule (objective_strays) on the options given, plus the command's own
        given = [name for name in rl_only if options.get(name) is not None]
        stray = [
            _flag(name) + ("-*" if name in SECTION_OPTIONS else "")
            for name in (*objective_strays("sft", chosen), *given)
        ]
        stray += [_flag(name) for name in CRITIC_OPTIONS if options.get(name) is not None and _flag(name) not in stray]
        if stray:
            parser.error(f"{', '.join(stray)}: only with --objective grpo or ppo (or distill, dpo)")
        return None
    stray = [_flag(name) for name in sft_only if options.get(name) is not None]
    if stray:
        parser.error(f"{', '.join(stray)}: only with --objective sft")
    try:
        return ObjectiveConfig(kind=args.objective, **chosen)
    except ConfigError as error:
        parser.error(str(error))
