"""Check tree mode against the flat baseline: same weights, same data, one JSON report.

--data is a tokens JSONL file (one trajectory a line) or a dataset directory written by
ds-tree convert. --objective sft (the default) compares the weighted next-token loss, every
trajectory's log-probs and every gradient. grpo / ppo compare the RL objective (docs/RL.md): the
old policy's log-probs, then loss, clip/KL/entropy metrics and every gradient of a policy moved
off the old one by --perturbation times each parameter's spread (so that ratios are clipped on
both sides; the report's metrics count the clipped tokens).

--sequence-parallel S spawns S processes with Ulysses around the tree attention: trees with
a path over --budget go to rows of up to S x budget sharded over them; loss and gradients are
compared with the single-process flat result. SFT: the report adds each rank's activation memory
and step time at S = 1 and S. RL (--objective grpo / ppo): the old (and reference) policy's
log-probs are computed on the shards too, and the report compares them and the metrics as well.

--dfs-chunk C also walks every tree in dfs mode (docs/DESIGN.md section 5) in chunks of at most C
tokens (--dfs-recompute: each forwarded twice) and compares it with flat as well: the dfs_*
fields (loss, gradients, log-probs: for RL the old policy's, computed by a no-grad walk, and the
metrics). With --sequence-parallel S, the S processes walk every tree together, each forwarding
one shard of every chunk (docs/DESIGN.md section 5), and the report compares that walk alone with
flat: SFT adds each rank's walk memory at S = 1 and S; RL (--objective grpo / ppo) walks the old
(and reference) policy without gradients and the trained one with them, all sharded.

--attention flex (PyTorch's FlexAttention, forward only on the CPU) compares loss and log-probs
and reports "gradients_checked": false with the reason; "passed" then covers loss and log-probs
only, and the exit code follows it. RL objectives, --dfs-chunk and --sequence-parallel need
gradients and are refused with it.

--router-aux-loss-coef W (MoE models; default: the model config's router_aux_loss_coef) weights the
router load-balancing loss in the compared objective, SFT or RL (docs/MODELS.md, docs/RL.md), in every
layout above; the report compares its value too (router_aux_*).

--objective distill --teacher MODEL compares on-policy distillation (docs/RL.md, "On-policy
distillation"; --distill-loss reverse_kl_sampled, kl, jsd with --distill-beta, or reverse_kl) and
--objective dpo compares DPO pair by pair (docs/RL.md, "DPO"; --dpo-beta, --dpo-loss sigmoid or ipo,
--dpo-label-smoothing; the pairs: --dpo-pairs siblings, every fork's sibling branches with different
rewards, a converted preference record's pair), each against a flat oracle that writes its loss out on
every trajectory's whole logits (ds_tree/verify/distill.py, dpo.py): loss, every gradient, and the
teacher's log-prob of every trained token (distill) or every pair's margin (dpo), in every layout above
(--dfs-chunk, --sequence-parallel S, --lora R). The teacher is initialised at --seed + 1.

--lora R puts LoRA adapters of rank R on every linear layer of the decoder (PEFT, as
model.lora; docs/LORA.md), with random A and B, and compares the adapters' gradients (RL: the
trained policy's adapters perturbed, the KL reference the model with its adapters disabled).

--estimator gae --critic SOURCE (--gamma, --lam, --value-clip) checks PPO with a learned critic
(docs/RL.md): each layout scores the old critic's values on its own items for its GAE advantages, and
the report compares the values, the policy's loss and gradients and the trained critic's value loss and
every gradient (critic_* fields; dfs_critic_* with --dfs-chunk; under --sequence-parallel S the sums
over the group). SOURCE `policy` is a value head on the policy's trunk (its head alone has gradients).

Only the JSON report goes to stdout (pipe it to jq); logs and library warnings, the spawned
ranks' included, go to stderr. Exits 1 when the errors exceed the dtype's tolerance, 2 on bad
input (e.g. a reward missing for the estimator).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

from ds_tree.cli.choices import NORMALISATIONS, POLICIES, VERIFY_DTYPES, engines
from ds_tree.cli.common import NON_NEGATIVE_INT, POSITIVE_INT, command_parser, finite_float
from ds_tree.cli.objective_options import add_objective_arguments, objective_config
from ds_tree.config import ObjectiveConfig
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError

DEFAULT_PERTURBATION = 0.5


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout meanwhile to stderr: this process's prints and loggers
    (sys.stdout), and file descriptor 1 itself, which the sequence-parallel ranks inherit when
    they are started, and which C code and library handlers holding the original stream write to."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for stream in {sys.stdout, sys.__stdout__} - {None}:
            stream.flush()  # what went to the original stream object meanwhile belongs to stderr too
        os.dup2(saved, 1)
        os.close(saved)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--data", required=True, help="tokens JSONL file or converted dataset directory")
    parser.add_argument("--model", required=True, help="model config JSON (random init) or local HF directory")
    parser.add_argument("--dtype", default="float64", choices=VERIFY_DTYPES, help="dtype of the model and the check")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init")
    parser.add_argument("--budget", type=POSITIVE_INT, default=4096, help="token budget of one packed row")
    parser.add_argument("--block", type=POSITIVE_INT, default=1, help="pad rows to a multiple of this")
    parser.add_argument(
        "--attention", default="auto", choices=engines(), help="tree attention engine (auto: torch, on the CPU)"
    )
    parser.add_argument("--limit", type=POSITIVE_INT, default=None, help="use only the first N trajectories")
    parser.add_argument("--normalisation", choices=NORMALISATIONS, help="SFT only (default token_mean)")
    parser.add_argument("--policy", choices=POLICIES, help="SFT only (default exact)")
    parser.add_argument(
        "--router-aux-loss-coef",
        type=finite_float,
        help="MoE models: weight of the router load-balancing loss, SFT or RL (default: the model config's)",
    )
    rl_group = add_objective_arguments(parser)
    rl_group.add_argument(
        "--perturbation",
        type=finite_float,
        help=f"move the trained policy off the old one by this times each parameter's spread "
        f"(default {DEFAULT_PERTURBATION})",
    )
    parser.add_argument(
        "--sequence-parallel", type=POSITIVE_INT, default=1, metavar="S", help="ranks per sequence-parallel row"
    )
    parser.add_argument(
        "--dfs-chunk",
        type=POSITIVE_INT,
        default=None,
        metavar="C",
        help="also compare dfs mode, in chunks of at most C tokens",
    )
    parser.add_argument("--dfs-recompute", action="store_true", help="dfs mode: forward every chunk twice")
    parser.add_argument(
        "--lora",
        type=NON_NEGATIVE_INT,
        default=0,
        metavar="R",
        help="LoRA adapters of rank R on every linear layer (0: none)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.dfs_recompute and args.dfs_chunk is None:
        parser.error("--dfs-recompute: only with --dfs-chunk C (it forwards each dfs chunk twice)")
    from ds_tree.attention.registry import attention_engine, resolve_engine

    args.attention = resolve_engine(args.attention, "cpu")  # verify runs on the CPU: auto is torch
    engine = attention_engine(args.attention)
    if engine.flat_rows_only or not engine.runs_on("cpu"):
        rows, where = (
            "flat rows" if engine.flat_rows_only else "tree rows",
            "" if engine.runs_on("cpu") else " on a CUDA GPU",
        )
        parser.error(f"--attention {args.attention} runs {rows}{where} only: verify compares tree rows on the CPU")
    if not engine.trains_on("cpu") and (args.objective not in (None, "sft") or args.sequence_parallel > 1):
        parser.error(
            f"--attention {args.attention} has no backward on the CPU: it checks the sft objective in one process only"
        )
    if args.lora and args.sequence_parallel > 1:
        parser.error("--lora checks single-process modes (not --sequence-parallel)")
    objective = objective_config(parser, args, rl_only=("perturbation",), sft_only=("normalisation", "policy"))
    with stdout_to_stderr():
        code, report = run(args, objective)
    if report is not None:
        if report.get("gradients_checked") is False:
            print(f"warning: {report['gradients_not_checked_because']}", file=sys.stderr)
        print(json_text(report, indent=2))
    return code


FROZEN_MODEL_KINDS = ("distill", "dpo")
"""The objectives with a frozen second model, checked against their flat oracles (ds_tree.verify.distill, dpo)."""


def frozen_model_report(args, objective: ObjectiveConfig, trajectories, dfs, lora, common: dict) -> dict:
    """``--objective distill`` or ``dpo``: one process (tree, and walked with ``dfs``), or ``--sequence-parallel
    S`` spawned ranks, against the flat oracle."""
    from ds_tree.verify.distill import compare_distill, distill_sequence_parallel_report
    from ds_tree.verify.dpo import compare_dpo, dpo_sequence_parallel_report

    options = dict(common, perturbation=DEFAULT_PERTURBATION if args.perturbation is None else args.perturbation)
    size = args.sequence_parallel
    if objective.kind == "distill":
        from ds_tree.objectives.distill import DistillSettings

        options["settings"] = DistillSettings.of(objective)
        if size > 1:
            return distill_sequence_parallel_report(
                trajectories, args.model, objective.teacher, size=size, dfs=dfs, **options
            )
        return compare_distill(trajectories, args.model, objective.teacher, dfs=dfs, lora=lora, **options)
    from ds_tree.losses.dpo import DPOLoss

    settings = objective.dpo
    options["loss"] = DPOLoss(settings.beta, settings.loss, settings.label_smoothing)
    if size > 1:
        return dpo_sequence_parallel_report(trajectories, args.model, size=size, dfs=dfs, **options)
    return compare_dpo(trajectories, args.model, dfs=dfs, lora=lora, **options)


def run(args: argparse.Namespace, objective: ObjectiveConfig | None) -> tuple[int, dict | None]:
    """The exit code and the report (``None`` after bad input, reported on stderr)."""
    from ds_tree.data import load_trajectories
    from ds_tree.engine.dfs import DfsSettings
    from ds_tree.verify.sequence_parallel import sequence_parallel_report
    from ds_tree.verify.sequence_parallel_rl import sequence_parallel_rl_report
    from ds_tree.verify.tree_vs_flat import compare, compare_rl

    dfs = DfsSettings(args.dfs_chunk, args.dfs_recompute) if args.dfs_chunk is not None else None
    lora = None
    if args.lora:
        from ds_tree.config import LoraSettings

        lora = LoraSettings(rank=args.lora)
    try:
        trajectories = load_trajectories(args.data)
        if args.limit is not None:
            trajectories = trajectories[: args.limit]
        common = dict(dtype=args.dtype, seed=args.seed, budget=args.budget, block=args.block, attention=args.attention)
        if objective is None and args.sequence_parallel > 1 and dfs is not None:
            from ds_tree.verify.dfs_sequence_parallel import dfs_sequence_parallel_report

            report = dfs_sequence_parallel_report(
                trajectories,
                args.model,
                dfs,
                size=args.sequence_parallel,
                dtype=args.dtype,
                seed=args.seed,
                attention=args.attention,
                normalisation=args.normalisation or "token_mean",
                policy=args.policy or "exact",
                router_aux_loss_coef=args.router_aux_loss_coef,
            )
        elif objective is None and args.sequence_parallel > 1:
            report = sequence_parallel_report(
                trajectories,
                args.model,
                size=args.sequence_parallel,
                normalisation=args.normalisation or "token_mean",
                policy=args.policy or "exact",
                router_aux_loss_coef=args.router_aux_loss_coef,
                **common,
            )
        elif objective is None:
            report = compare(
                trajectories,
                args.model,
                normalisation=args.normalisation or "token_mean",
                policy=args.policy or "exact",
                router_aux_loss_coef=args.router_aux_loss_coef,
                dfs=dfs,
                lora=lora,
                **common,
            )
        elif objective.kind in FROZEN_MODEL_KINDS:
            report = frozen_model_report(args, objective, trajectories, dfs, lora, common)
        else:
            rl = dict(
                estimator=objective.estimator,
                normalise_advantages=objective.normalise_advantages,
                tempo_coef=objective.tempo_coef,
                settings=objective.rl_settings(),
                critic=objective.critic,
                gamma=objective.gamma,
                lam=objective.lam,
                perturbation=DEFAULT_PERTURBATION if args.perturbation is None else args.perturbation,
                router_aux_loss_coef=args.router_aux_loss_coef,
                **common,
            )
            report = {"objective": objective.kind}
            if args.sequence_parallel > 1:
                report |= sequence_parallel_rl_report(
                    trajectories, args.model, size=args.sequence_parallel, dfs=dfs, **rl
                )
            else:
                report |= compare_rl(trajectories, args.model, dfs=dfs, lora=lora, **rl)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2, None
    return (0 if report["passed"] else 1), report
