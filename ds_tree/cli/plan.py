"""Predicted peak memory per rank of a training config, and the largest row that fits.

Reads the training YAML (key=value overrides as the trainer takes them), its model config and its
DeepSpeed JSON (ZeRO stage, offload_optimizer / offload_param), and prints per rank: parameters,
gradients and optimizer states, activations of one packed row of packing.budget tokens with and
without activation checkpointing, the LM head's share (model.head_chunk), and the largest
packing.budget whose predicted peak fits --memory-gib of accelerator memory. The row is planned
as if every token were a target (the head's worst case).

A config that walks trees (packing.mode: dfs, or over_budget: dfs) also gets the dfs walk's peak
on a root-to-leaf path of --path-tokens tokens (default: 4 x packing.budget) in chunks of
packing.dfs_chunk, with and without packing.dfs_recompute, and the longest path each trains
within the memory; with parallel.sequence_parallel_size S > 1 (packing.mode: dfs) one rank's share
of the walk its group of S ranks makes, every chunk sharded. The arithmetic and its measured error
are in docs/MEMORY.md.

--explain [STEP] also prints the step plan of step STEP (default 0) of data.path: every rank's work
items, each with its execution kind (packed row, walked tree, sequence-parallel shard), tokens,
trees, trajectories, predicted cost and why it got its kind.

--host [STEP] simulates the host work of step STEP (default 0) of data.path on each of --world-size ranks,
one rank at a time (the scale simulator, ds_tree/bench/host_plan.py): each rank summarises its share of the
step's groups, the summaries are exchanged, each rank balances them and builds its own items. It prints
the slowest rank's seconds beside today's whole-step plan on one rank (global_seconds), the bytes a rank
receives, and the balance (max / mean predicted cost over ranks) of both plans.
"""

from __future__ import annotations

import argparse
import math
import sys

from ds_tree.cli.common import command_parser
from ds_tree.config import ConfigError, load_config
from ds_tree.data.jsonl import json_text
from ds_tree.engine.memory import plan_of
from ds_tree.memory.predict import GIB


def make_plan(config_path: str, overrides: list[str], world_size: int, memory_gib: float, path_tokens: int = 0) -> dict:
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.models.ulysses import check_sequence_parallel

    config = load_config(config_path, overrides)
    model_config = load_model_config(config.model.source)
    check_sequence_parallel(config, world_size, model_config)  # the dry run's check
    return plan_of(config, config_path, model_config, world_size, memory_gib, path_tokens)


def format_plan(plan: dict) -> str:
    offload = [name for name in ("optimizer", "param") if plan[f"offload_{name}"]]
    states, activations = plan["states"], plan["activations"]
    rows = [
        ("parameters", states["parameters"]),
        ("gradients", states["gradients"]),
        ("optimizer states (fp32 master, AdamW moments)", states["optimizer"]),
        ("ZeRO-3 gathered module", states["gathered"]),
        ("KL reference model (frozen)", states.get("reference", 0)),
        ("model states", states["total"]),
        ("in CPU memory (offload)", states["cpu"]),
    ]
    packed_parts = (
        ("layers", "kept by the layers"),
        ("head", "head at its backward"),
        ("recompute", "at a layer's recompute"),
        ("peak", "activation peak"),
    )
    for name, label in (
        ("without_checkpointing", "no checkpointing"),
        ("with_checkpointing", f"checkpointing every {plan['checkpoint_every']}"),
    ):
        rows += [(f"{label}: {text}", activations[name][key]) for key, text in packed_parts]
    dfs = plan["dfs"]
    if dfs is not None:
        walk_parts = (
            ("held", "ancestors' held graphs"),
            ("cache", "cached keys, values, gradients"),
            ("chunk", "deepest chunk at its backward"),
            ("peak", "activation peak"),
        )
        for name, label in (("without_recompute", "dfs walk"), ("with_recompute", "dfs walk, recompute")):
            rows += [(f"{label}: {text}", dfs[name][key]) for key, text in walk_parts]
    chosen = plan["config_uses"].replace("_", " ") + (", dfs walk" if dfs is not None else "")
    rows.append((f"predicted peak per rank ({chosen}, as configured)", plan["peak_bytes"]))
    budgets = plan["largest_budget"]
    frozen = plan["trained_parameters"] != plan["parameters"]
    trained = f"; {plan['trained_parameters'] / 1e6:.3f} M trained: LoRA adapters" if frozen else ""
    header = (
        f"{plan['config']}: {plan['parameters'] / 1e9:.3f} B parameters ({plan['model']}{trained}), {plan['dtype']}, "
        f"ZeRO-{plan['zero_stage']} over {plan['world_size']} rank(s), offload: {', '.join(offload) or 'none'}\n"
        f"activations: one row of {plan['budget']} tokens, every token a target, head_chunk {plan['head_chunk']}\n"
    )
    table = [f"{'per rank':<56}{'GiB':>10}"] + [f"{label:<56}{value / GIB:>10.2f}" for label, value in rows]
    footer = (
        f"largest packing.budget within {plan['memory_gib']:g} GiB: {budgets['without_checkpointing']} tokens "
        f"without checkpointing, {budgets['with_checkpointing']} with"
    )
    if dfs is not None:
        sharded = dfs["sequence_parallel_size"]
        header += (
            f"dfs walk: a root-to-leaf path of {dfs['path_tokens']} tokens in chunks of {dfs['chunk']}, "
            f"packing.dfs_recompute {str(dfs['recompute']).lower()}"
            + (f", each chunk sharded over {sharded} ranks (one rank's share)" if sharded > 1 else "")
            + "\n"
        )
        footer += (
            f"\nlongest root-to-leaf path the dfs walk trains within {plan['memory_gib']:g} GiB: "
            f"{dfs['without_recompute']['largest_path']} tokens without recompute, "
            f"{dfs['with_recompute']['largest_path']} with"
        )
    return "\n".join([header, *table, footer])


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("config", help="training YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, as the trainer takes them")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--memory-gib", type=float, default=80.0, help="accelerator memory per rank (default 80)")
    parser.add_argument(
        "--path-tokens",
        type=int,
        default=0,
        help="dfs configs: plan the walk of a root-to-leaf path of this many tokens (default 4 x packing.budget)",
    )
    parser.add_argument(
        "--explain",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="STEP",
        help="also print every rank's work items of step STEP (default 0) of data.path, with kinds and costs",
    )
    parser.add_argument(
        "--host",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="STEP",
        help="also simulate the host work of step STEP (default 0) of data.path on each of --world-size ranks",
    )
    parser.add_argument(
        "--repeat", type=int, default=2, help="--host: simulate this many times, each figure its fastest (default 2)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_intermixed_args(argv)
    if args.world_size < 1 or not (math.isfinite(args.memory_gib) and args.memory_gib > 0) or args.path_tokens < 0:
        parser.error("--world-size must be >= 1, --memory-gib a finite number > 0 and --path-tokens >= 0")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    try:
        plan = make_plan(args.config, args.overrides, args.world_size, args.memory_gib, args.path_tokens)
        steps = None if args.explain is None else step_plan(args.config, args.overrides, args.world_size, args.explain)
        host = None
        if args.host is not None:
            host = host_work(args.config, args.overrides, args.world_size, args.host, args.repeat)
    except (ConfigError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        extra = ({} if steps is None else {"step_plan": steps.as_dict()}) | ({} if host is None else {"host": host})
        print(json_text(plan | extra, indent=2))
    else:
        text = format_plan(plan) + ("" if steps is None else "\n\n" + steps.explain())
        print(text + ("" if host is None else "\n\n" + format_host(host)))
    return 0


def format_host(host: dict) -> str:
    """The ``host`` figures as a few lines of text."""
    names = ("bytes_per_rank_max", "exchange_bytes", "global_dataset_bytes_per_rank")
    names += ("rollout_bytes_per_rank_max", "rollout_all_gather_bytes_per_rank")
    mib = {name: host[name] / 2**20 for name in names}
    return (
        f"host work of step {host['step']} over {host['world_size']} simulated ranks ({host['groups']} groups, "
        f"{host['flat_tokens']} flat tokens, {host['parts']} parts; CPU seconds, fastest of {host['repeat']} runs):\n"
        f"  slowest rank {host['per_rank_seconds_max']:.3f} s (mean {host['per_rank_seconds_mean']:.3f} s), "
        f"whole-step plan on one rank {host['global_seconds']:.3f} s: {host['speedup']:.1f}x\n"
        f"  balance (max / mean predicted cost) {host['balance']:.4f}, whole-step plan {host['global_balance']:.4f}\n"
        f"  received per rank: {mib['bytes_per_rank_max']:.2f} MiB at most ({mib['exchange_bytes']:.2f} MiB of "
        f"summaries, {host['dataset_bytes_per_rank'] / 2**20:.2f} MiB of data; the whole step's data: "
        f"{mib['global_dataset_bytes_per_rank']:.2f} MiB)\n"
        f"  online rollouts (each group on the rank that sampled it): {mib['rollout_bytes_per_rank_max']:.2f} MiB "
        f"at most per rank, against {mib['rollout_all_gather_bytes_per_rank']:.2f} MiB by an all-gather of the step"
    )


def host_work(config_path: str, overrides: list[str], world_size: int, step: int, repeat: int) -> dict:
    """The scale simulator's figures (:func:`~ds_tree.bench.host_plan.simulate_host`) for ``step`` of the
    config's data."""
    from ds_tree.bench.host_plan import simulate_host, step_units
    from ds_tree.errors import DataError
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.packing.plan import PlanSettings

    config = load_config(config_path, overrides)
    if step < 0:
        raise ConfigError(f"--host: the step must be >= 0, got {step}")
    if not config.data.path:
        raise ConfigError("--host needs data.path (an online RL config samples its steps' data)")
    settings = PlanSettings.of_config(config, load_model_config(config.model.source).pad_token_id or 0)
    try:
        units = step_units(config.data.path, config.data.groups_per_step, config.data.seed, step)
        return {"step": step} | simulate_host(units, settings, world_size, repeat)
    except DataError as error:
        raise ConfigError(f"data.path: {error}") from None


def step_plan(config_path: str, overrides: list[str], world_size: int, step: int):
    """The step plan (:mod:`ds_tree.packing.plan`) of ``step`` of the config's data, as the trainer makes it."""
    from ds_tree.data import load_trajectories
    from ds_tree.data.sampler import StepSampler
    from ds_tree.errors import DataError
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.packing.plan import PlanSettings, plan_step
    from ds_tree.trees.trajectory import group_trajectories

    config = load_config(config_path, overrides)
    if step < 0:
        raise ConfigError(f"--explain: the step must be >= 0, got {step}")
    if not config.data.path:
        raise ConfigError("--explain needs data.path (an online RL config samples its steps' data)")
    try:
        groups = group_trajectories(load_trajectories(config.data.path))
    except DataError as error:
        raise ConfigError(f"data.path: {error}") from None
    sampler = StepSampler(len(groups), config.data.groups_per_step, config.data.seed)
    pad_id = load_model_config(config.model.source).get_text_config().pad_token_id or 0  # a VL config's is inside
    settings = PlanSettings.of_config(config, pad_id)
    return plan_step(sampler.trajectories_for_step(groups, step), settings, world_size)
