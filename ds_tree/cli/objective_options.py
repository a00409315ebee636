"""The ``--objective`` options ``verify`` and ``bench`` share: SFT, or the RL objective (docs/RL.md).

The RL options map one to one onto :class:`ds_tree.config.ObjectiveConfig` fields, so the command
line gets the config's defaults and checks (``--dual-clip 0`` is off, as ``dual_clip: 0`` is in a
config). An RL option given with ``--objective sft``, or an SFT option with an RL objective, is a
usage error rather than silently ignored.
"""

from __future__ import annotations

import argparse

from ds_tree.cli.choices import KL_ESTIMATORS, aggregations, estimators, objectives  # registries: --help stays fast
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
    if epochs:
        group.add_argument(
            "--ppo-epochs", type=POSITIVE_INT, help="update passes over each step's rollouts (default 1)"
        )
    return group


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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
    if critic:
        try:
            chosen["critic"] = CriticSettings(**critic)
        except ConfigError as error:
            parser.error(str(error))
    if args.objective == "sft":  # the config's rule (objective_strays) on the options given, plus the command's own
        stray = [_flag(name) for name in (*objective_strays("sft", chosen), *rl_only) if options.get(name) is not None]
        stray += [_flag(name) for name in CRITIC_OPTIONS if options.get(name) is not None and _flag(name) not in stray]
        if stray:
            parser.error(f"{', '.join(stray)}: only with --objective grpo or ppo")
        return None
    stray = [_flag(name) for name in sft_only if options.get(name) is not None]
    if stray:
        parser.error(f"{', '.join(stray)}: only with --objective sft")
    try:
        return ObjectiveConfig(kind=args.objective, **chosen)
    except ConfigError as error:
        parser.error(str(error))
