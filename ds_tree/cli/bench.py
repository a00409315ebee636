"""Benchmark tree vs flat training steps on one model, one data set, in one run.

--data is a tokens JSONL or a converted dataset directory. Prints (and with --json writes) a JSON
report with top-level speedup, ideal_speedup, efficiency and modes.<mode> with step_time_s and
peak_memory_bytes (bytes autograd saves for backward in the largest micro-batch: the activation
memory, measured identically for both modes). SFT reports also have ideal_cost and
efficiency_cost: the ideal speedup with each step priced as
cost_per_token_s * tokens + cost_per_pair_s * visible pairs, both fitted to the measured rows
(docs/BENCHMARKS.md).

--activation-checkpointing [K] recomputes every K-th decoder layer (default every layer) in both
modes, and with --peak-memory (implied by it) each mode's largest row is run once more after the
timed steps under the torch profiler: modes.<mode>.activation_peak_bytes is the most bytes that
row's forward and backward held at once, recomputation included (what the saved-tensor count
cannot see), and activation_peak_ratio_tree_over_flat their ratio.

Mode dfs (SFT and RL) walks every tree depth-first in chunks of at most --dfs-chunk tokens
(default --budget; --dfs-recompute forwards each chunk twice); its peak_memory_bytes is the most
the walk holds at once, and dfs_time_over_tree / dfs_memory_over_tree compare it with tree mode.
modes.<mode>.calls_per_step counts forward-and-backward model calls (RL: of one update): a
packed mode's rows, the walk's chunks.

A vision-language model (--model a qwen2_5_vl / qwen3_vl config; data with images) also reports
modes.<mode>.images_per_step and patches_per_step (the distinct images of the step's rows, one
pass), tower_calls_per_step, tower_images_per_step and tower_patches_per_step (what its vision
tower encoded, every pass, counted by a hook), and patch_weight (language-model tokens a vision
patch costs: the tower's matrix-multiply weights per patch over the decoder layers' per token),
ideal_speedup_with_patches (flat over tree of packed tokens + patch_weight x patches),
efficiency_with_patches, tower_call_ratio and tower_patch_ratio (flat / tree). SFT reports
also price at this machine's times: tower_s_per_patch (the tower's forward and backward timed
alone on the first measured step's images), lm_s_per_token (both modes' forward-and-backward
time less their patches, per packed token), patch_weight_measured (their ratio),
ideal_speedup_with_patches_measured and efficiency_with_patches_measured.

--objective grpo / ppo times RL steps instead (docs/RL.md; the data needs rewards, or per-token
advantages for the given estimator): the old policy's no-grad forward, then --ppo-epochs
updates. modes.<mode> then also has old_forward_time_s, updates_time_s, old_forward_share and
targets_per_step (tokens the LM head scores), and the report old_forward_speedup,
updates_speedup and target_ratio (flat / tree).

--objective distill --teacher MODEL (a config teacher initialised at seed 1, the student at 0;
--distill-loss, --ppo-epochs) and --objective dpo (--dpo-beta, --dpo-loss; the data's sibling pairs, only
the paired sequences packed and counted) time their trainer steps the same way
(ds_tree/bench/frozen_model_steps.py): the no-grad pass (the teacher's forward over the items; DPO's summed
log-probs under the policy and the reference) is reported as old_forward, the update(s) as updates.

--sequence-parallel S spawns S ranks (one Ulysses group; docs/BENCHMARKS.md). SFT: the tree step at
S = 1 and S, with each rank's activation memory. RL (--objective grpo / ppo): tree against flat,
both planned as the trainer plans them under sequence parallelism (a path over --budget sharded over
the S ranks), each a full RL step (old-policy pass, --ppo-epochs updates, gradients summed over the
group, optimizer step) timed on the slowest rank, with speedup, old_forward_speedup,
updates_speedup and activation_ratio_tree_over_flat (ds_tree/bench/sequence_parallel_rl.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.choices import BENCH_DTYPES, MODES, engines
from ds_tree.cli.common import NON_NEGATIVE_INT, POSITIVE_INT, check_not_input, check_output_path, command_parser
from ds_tree.cli.objective_options import add_objective_arguments, objective_config
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--data", required=True, help="tokens JSONL file or converted dataset directory")
    parser.add_argument("--model", required=True, help="model config JSON or local HF directory")
    parser.add_argument("--modes", default="flat,tree", help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--steps", type=POSITIVE_INT, default=5, help="measured steps per mode")
    parser.add_argument("--warmup", type=NON_NEGATIVE_INT, default=1, help="unmeasured steps per mode first")
    parser.add_argument("--budget", type=POSITIVE_INT, default=4096, help="tokens per packed row")
    parser.add_argument("--groups-per-step", type=POSITIVE_INT, default=None, help="default: every group each step")
    parser.add_argument("--limit", type=POSITIVE_INT, default=None, help="use only the first N trajectories")
    parser.add_argument("--dtype", default="float32", choices=BENCH_DTYPES, help="dtype of the model")
    parser.add_argument(
        "--attention", default="auto", choices=engines(), help="tree attention engine (auto: flex on cuda, else torch)"
    )
    parser.add_argument(
        "--flat-attention",
        default=None,
        choices=engines(),
        help="engine of mode flat (default: varlen, the flash-kernel baseline, with --device cuda; else --attention)",
    )
    parser.add_argument("--threads", type=POSITIVE_INT, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu, or a GPU (cuda): SFT or RL steps of modes flat and tree")
    parser.add_argument(
        "--one-mode-at-a-time",
        action="store_true",
        help="all steps of one mode with only its model built, then the next (on a GPU: each mode's peak memory)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--profile", type=Path, default=None, help="profile one more step per mode, tables here")
    parser.add_argument(
        "--activation-checkpointing",
        type=NON_NEGATIVE_INT,
        nargs="?",
        const=1,
        default=0,
        metavar="K",
        help="recompute every K-th decoder layer in the backward (K default 1); implies --peak-memory",
    )
    parser.add_argument("--peak-memory", action="store_true", help="activation peak of each mode's largest row")
    parser.add_argument(
        "--dfs-chunk", type=NON_NEGATIVE_INT, default=0, help="mode dfs: most tokens per forward (0: --budget)"
    )
    parser.add_argument("--dfs-recompute", action="store_true", help="mode dfs: forward every chunk twice")
    parser.add_argument(
        "--sequence-parallel",
        type=POSITIVE_INT,
        default=1,
        metavar="S",
        help="spawn S ranks with Ulysses; SFT: activation memory and time per rank at S = 1 and S; "
        "RL: tree against flat, both sharded over the S ranks",
    )
    add_objective_arguments(parser, epochs=True)
    return parser


def check_attention_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve ``--attention`` (``auto``: flex on CUDA, else torch) and ``--flat-attention`` (by default the
    flat baseline a user runs on the device: its flat-rows engine, flash kernels on a GPU, else the tree
    engine) for ``--device``, and refuse, from the engines' capabilities, one that cannot run there or
    cannot run the modes, and a tree engine that cannot train there."""
    from ds_tree.attention.engines import cpu_engines
    from ds_tree.attention.registry import attention_engine, flat_engine, resolve_engine, tree_engines

    device = args.device.split(":")[0]
    args.attention = resolve_engine(args.attention, args.device)
    args.flat_attention = resolve_engine(args.flat_attention or flat_engine(args.device) or args.attention, args.device)
    flat, tree = attention_engine(args.flat_attention), attention_engine(args.attention)
    if not flat.runs_on(device):
        parser.error(f"--flat-attention {args.flat_attention} needs a CUDA GPU ({flat.cpu_limit}): use --device cuda")
    if tree.flat_rows_only and ({mode.strip() for mode in args.modes.split(",")} - {"flat", ""}):
        parser.error(
            f"--attention {args.attention} runs flat rows only: use --modes flat "
            f"({', '.join(tree_engines())} for tree rows)"
        )
    if not tree.runs_on(device):
        parser.error(f"--attention {args.attention} needs a CUDA GPU ({tree.cpu_limit}): use --device cuda")
    if not tree.trains_on(device):
        forward = f", or ds-tree bench-attention --engine {args.attention} for its forward"
        parser.error(
            f"--attention {args.attention} times training steps, and it cannot train on the CPU: {tree.cpu_limit}; "
            f"use --device cuda{forward if args.attention in cpu_engines() else ''}"
        )


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for option, output in (("--json", args.json), ("--profile", args.profile)):
        check_not_input(parser, option, output, [args.data, args.model])
        check_output_path(parser, output, option)
    import torch

    check_attention_options(parser, args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():  # after the options' own rules
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    objective = objective_config(parser, args)
    if args.sequence_parallel > 1 and objective is not None and objective.kind in ("distill", "dpo"):
        parser.error(f"--sequence-parallel: --objective {objective.kind} is timed in one process (no S ranks)")
    if args.sequence_parallel > 1:
        measure = sequence_parallel_measure(args, objective)
    else:
        measure = benchmark_measure(parser, args, objective)
    from ds_tree.data import load_trajectories

    try:
        report = measure(load_trajectories(args.data)[: args.limit])
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    invoked = prog or "python tools/bench.py"  # what ran: the ds-tree subcommand or the tools/ shim
    report["command"] = " ".join([invoked, *(argv if argv is not None else sys.argv[1:])])
    report["data"] = str(args.data)
    report["model"] = str(args.model)
    text = json_text(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


def sequence_parallel_measure(args: argparse.Namespace, objective):
    """``--sequence-parallel S``: trajectories -> the spawned group's report, SFT's
    (:func:`~ds_tree.verify.sequence_parallel.sequence_parallel_report`) or the RL objective's
    (:func:`~ds_tree.bench.sequence_parallel_rl.sequence_parallel_rl_bench`)."""
    from ds_tree.verify.sequence_parallel import sequence_parallel_report

    report_of = sequence_parallel_report
    if objective is not None:
        import functools

        from ds_tree.bench.sequence_parallel_rl import sequence_parallel_rl_bench

        report_of = functools.partial(
            sequence_parallel_rl_bench, objective=objective, steps=args.steps, warmup=args.warmup
        )

    def measure(trajectories):
        return report_of(
            trajectories,
            args.model,
            size=args.sequence_parallel,
            dtype=args.dtype,
            budget=args.budget,
            attention=args.attention,
            threads=args.threads or 1,
        )

    return measure


def benchmark_measure(parser: argparse.ArgumentParser, args: argparse.Namespace, objective):
    """One process: trajectories -> :func:`~ds_tree.bench.steps.run_benchmark`'s report over ``--modes``
    (a usage error on bad modes), with a progress bar on stderr."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; this build has {', '.join(MODES)}")
    if not modes:
        parser.error(f"--modes {args.modes!r} names no mode; give some of {', '.join(MODES)}, separated by commas")
    if args.activation_checkpointing < 0:
        parser.error("--activation-checkpointing K needs K >= 1")
    import torch
    from tqdm import tqdm

    from ds_tree.bench.steps import run_benchmark

    if args.threads:
        torch.set_num_threads(args.threads)

    def measure(trajectories):
        total = (args.warmup + args.steps) * (len(modes) if args.one_mode_at_a_time else 1)
        with tqdm(total=total, desc="bench", unit="step", file=sys.stderr) as bar:
            return run_benchmark(
                trajectories,
                args.model,
                modes,
                args.steps,
                budget=args.budget,
                groups_per_step=args.groups_per_step,
                warmup=args.warmup,
                dtype=args.dtype,
                attention=args.attention,
                objective=objective,
                progress=bar,
                profile_path=args.profile,
                checkpoint_every=args.activation_checkpointing,
                peak_memory=args.peak_memory or bool(args.activation_checkpointing),
                dfs_chunk=args.dfs_chunk,
                dfs_recompute=args.dfs_recompute,
                device=args.device,
                flat_attention=args.flat_attention,
                one_mode_at_a_time=args.one_mode_at_a_time,
            )

    return measure
