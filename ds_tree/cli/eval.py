"""Evaluate a model on a training config's eval section (docs/EVAL.md): the held-out loss of eval.data, and
the held-out prompts or environment tasks of eval.prompts, sampled on rollout.engine and scored by
rollout.reward or rollout.env.path, as a run evaluates itself.

The model: --checkpoint DIR (a run's checkpoint, checkpoints/step_N, or its checkpoints folder for the
latest one: every file checked against its record, the ZeRO shards consolidated), --model PATH_OR_HUB_ID
(an exported Hugging Face directory such as a run's hf folder, a hub id, or a model config JSON, random
init from model.seed), or neither: the config's model.source, as a run starts from it. Samples come from
generators seeded from (eval.seed, --step, task), so two models compared with the same --step (default 0)
get the same tasks and seeds. Prints one JSON object: the eval metrics, what was evaluated, and the
samples file --output was given (JSONL, one sample a line). Bad input exits 2 with one error line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

from ds_tree.cli.common import NON_NEGATIVE_INT, check_output_file, command_parser
from ds_tree.data.jsonl import json_text


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("config", type=Path, help="the training config (YAML) whose eval section runs")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the config (eval.samples=16)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--checkpoint", type=Path, metavar="DIR", help="a run's checkpoint directory (or its checkpoints folder)"
    )
    model.add_argument(
        "--model", metavar="PATH_OR_HUB_ID", help="a Hugging Face directory, hub id or model config JSON"
    )
    parser.add_argument("--output", type=Path, metavar="FILE", help="write every sample here (JSONL)")
    parser.add_argument(
        "--step", type=NON_NEGATIVE_INT, default=0, help="the step the sampling seeds are drawn for (default 0)"
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    prog = prog or "ds-tree eval"
    parser = build_parser(prog)
    args = parser.parse_intermixed_args(argv)
    if args.output is not None:
        check_output_file(parser, args.output, inputs=(args.config, args.checkpoint, args.model))
    from ds_tree.errors import ConfigError, DataError
    from ds_tree.run.checkpoint import CheckpointError
    from ds_tree.sampling.interface import EngineError

    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed and transformers print: stdout is the JSON's
            summary = evaluate(args)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except EngineError as error:
        print(f"{prog}: error: the sampling engine failed: {error}", file=sys.stderr)
        return 1
    print(json_text(summary))
    return 0


def evaluate(args: argparse.Namespace) -> dict:
    """The eval section of ``args.config`` on the model ``args`` names, in a one-rank process group."""
    import torch.distributed as dist

    from ds_tree.config import ConfigError, load_config

    config = load_config(args.config, args.overrides)
    if not config.eval.enabled:
        raise ConfigError(f"{args.config}: no eval section to run (set eval.data or eval.prompts)")
    config.eval = dataclasses.replace(config.eval, save_samples=False)  # --output instead of output_dir/eval
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return evaluate_in_group(config, args)
    finally:
        if started:
            dist.destroy_process_group()


def evaluate_in_group(config, args: argparse.Namespace) -> dict:
    import torch

    from ds_tree.engine.layout import StepLayout
    from ds_tree.engine.runners import RunContext
    from ds_tree.evaluation.evaluator import EvalContext, Evaluator, write_samples
    from ds_tree.evaluation.heldout import LossRun

    model, described = evaluated_model(config, args)
    rollouts = None
    if config.eval.prompts:
        rollouts = run_rollouts(config, model.config)
    try:
        evaluator = Evaluator(config)
        evaluator.prepare(model.config, rollouts)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)
        layout = StepLayout(config, {}, model.config.get_text_config().pad_token_id or 0, 1)
        run = RunContext(device, config.model.head_chunk, layout.dfs_settings())
        loss_run = LossRun(model, lambda trajectories: layout.plan(trajectories, 0), run)
        evaluator.connect(EvalContext(model, loss_run, 0, 1, rollouts))
        scalars = evaluator.evaluate(args.step)
        samples = None
        if args.output is not None and evaluator.outcomes:
            samples = str(write_samples(args.output, evaluator.outcomes))
    finally:
        if rollouts is not None:
            rollouts.close()
    return {**described, "step": args.step, **scalars, "samples": samples}


def run_rollouts(config, model_config):
    """The config's rollouts (prompts, tokenizer, reward or environment) with their sampling engine built."""
    from ds_tree.rollout.multiturn import MultiTurnRollouts
    from ds_tree.rollout.online import OnlineRollouts

    kind = MultiTurnRollouts if config.rollout.env.path else OnlineRollouts
    rollouts = kind(config, model_config)
    rollouts.build_model()
    return rollouts


def evaluated_model(config, args: argparse.Namespace):
    """The model to evaluate (tree attention, eval mode) and what it is, for the summary."""
    from ds_tree.attention.registry import resolve_engine
    from ds_tree.engine.build import model_dtype
    from ds_tree.errors import ConfigError, HubError
    from ds_tree.models.loading import load_model

    source = args.model or config.model.source
    try:
        model = load_model(
            source,
            attention=resolve_engine(config.model.attention),
            dtype=model_dtype(config),
            seed=config.model.seed,
            recurrent_kernels=config.model.recurrent_kernels,
        )
    except HubError as error:
        raise ConfigError(f"{'--model' if args.model else 'model.source'}: {error}") from None
    if args.checkpoint is None:
        return model.eval(), {"model": str(source)}
    from ds_tree.evaluation.checkpoints import load_checkpoint_weights

    model, step = load_checkpoint_weights(model, args.checkpoint, config)
    return model.eval(), {"checkpoint": str(args.checkpoint), "checkpoint_step": step}
