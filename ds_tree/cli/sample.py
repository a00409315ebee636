"""Sample each prompt's group as a tree with a Hugging Face model, score it, write rollouts JSONL.

A prompts line is {"group_id": str?, "prompt": str | "messages": [chat] | "prompt_ids": [int],
"metadata": {...}?}: text is encoded without special tokens, messages through the tokenizer's
chat template with the generation prompt, ids as given; metadata goes to the reward
(docs/ROLLOUTS.md). --format tree writes one explicit tree a line (train it after
ds-tree convert --format tree), tokens one trajectory a line (trains as data.path); both carry
the sampler's logprobs and the reward. The model stops at the tokenizer's and the model config's
EOS ids, the chat turn's end (<|im_end|>) when the tokenizer has one, and at each --eos-token.
An existing --output is replaced only with --overwrite, and never an input (--prompts, --model).
Prints one JSON summary; a failing reward is reported on stderr and leaves that trajectory
without a reward. Exits 2 on bad input, before sampling. --engine vllm samples on a vLLM server:
--vllm-url's (it must serve --model's weights; checked with a probe), or one started from --model
(from vLLM's own venv, docs/ROLLOUTS.md) and stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ds_tree.cli.choices import MODEL_DTYPES, sampling_engines
from ds_tree.cli.common import check_output_file, command_parser
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError
from ds_tree.registries import REWARDS, SAMPLING_ENGINES

if TYPE_CHECKING:
    from ds_tree.sampling.hf import SampledTree

SAMPLER_OPTIONS = {
    "segment_length": (int, 16, "tokens decoded per segment before a branch decision"),
    "branching": (int, 2, "children per branch point"),
    "max_depth": (int, 3, "branch levels: at most branching**max_depth leaves"),
    "width": (int, 8, "leaves per prompt (the group size)"),
    "max_new_tokens": (int, 64, "longest completion, in tokens"),
    "temperature": (float, 1.0, "sampling temperature; 0 = greedy"),
    "top_p": (float, 1.0, "nucleus sampling: sample among the most likely tokens whose probabilities sum to top_p"),
    "repetition_ngram": (int, 0, "n > 0 stops a branch whose last n tokens already occur earlier in it; 0 = off"),
    "logprob_floor": (float, 0.0, "stop a branch whose mean log-prob over a segment falls below this (< 0; 0: off)"),
}
"""The SamplerSettings fields set by --x-y options: (type, default, help); tests/test_cli.py checks them
against ds_tree.sampling.settings.SamplerSettings."""


def token_records(tree: SampledTree, group: str, rewards: list[float | None]) -> list[dict]:
    """The tokens-JSONL lines of a sampled tree (one per leaf; ``null`` log-prob on the prompt)."""
    records = []
    for trajectory, reward in zip(tree.trajectories(group), rewards, strict=True):
        logprobs = [None if np.isnan(v) else float(v) for v in trajectory.logprobs]
        record = {
            "group_id": group,
            "trial": trajectory.trial,
            "input_ids": trajectory.input_ids.tolist(),
            "loss_mask": trajectory.loss_mask.astype(int).tolist(),
            "logprobs": logprobs,
        }
        if reward is not None:
            record["reward"] = reward
        records.append(record)
    return records


def add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampler (docs/ROLLOUTS.md)")
    for name, (kind, default, text) in SAMPLER_OPTIONS.items():
        shown = "off" if default is None else "%(default)s"
        group.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, dest=name, help=f"{text} (default {shown})"
        )
    group.add_argument("--no-refill", dest="refill", action="store_false", help="lose the leaves of early stops")
    group.add_argument("--independent", action="store_true", help="width independent completions (the baseline)")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--model", required=True, help="model config JSON (random init), local HF directory or hub id (org/name)"
    )
    parser.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="local tokenizer directory or hub id (org/name)"
    )
    parser.add_argument("--prompts", required=True, type=Path, metavar="FILE", help="prompts JSONL (see above)")
    parser.add_argument(
        "--output", required=True, type=Path, metavar="FILE", help="rollouts JSONL to write (.gz compresses)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output (never an input)")
    parser.add_argument(
        "--format", choices=("tree", "tokens"), default="tree", help="one explicit tree or one trajectory a line"
    )
    rewards = (*REWARDS.names(), "none")
    parser.add_argument("--reward", choices=rewards, default="none", help="reward function of the leaves")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (and of a random init)")
    parser.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="float32", help="the model's dtype")
    parser.add_argument(
        "--eos-token", action="append", default=[], metavar="TOKEN", help="another token that ends a branch"
    )
    parser.add_argument("--engine", choices=sampling_engines(), default="hf", help="where to sample (default hf)")
    parser.add_argument("--vllm-url", default="", metavar="URL", help="an existing vLLM server (--engine vllm)")
    add_sampler_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_output_file(parser, args.output, inputs=(args.prompts, args.model), overwrite=args.overwrite)
    import torch

    from ds_tree.data.convert import load_tokenizer
    from ds_tree.models.loading import load_model
    from ds_tree.models.vision import is_vision_language
    from ds_tree.sampling.interface import EngineError
    from ds_tree.sampling.prompts import read_prompts, stop_token_ids
    from ds_tree.sampling.settings import SamplerSettings

    settings_fields = {field.name: getattr(args, field.name) for field in fields(SamplerSettings)}
    try:
        settings = SamplerSettings(**settings_fields)
    except ValueError as error:
        parser.error(str(error))
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        model = load_model(args.model, dtype=args.dtype, seed=args.seed)
        prompts = read_prompts(args.prompts, tokenizer, model.config.get_text_config().vocab_size)
        eos = stop_token_ids(tokenizer, model.config, args.eos_token)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"ds-tree sample: error: {error}", file=sys.stderr)
        return 2
    engine_class = SAMPLING_ENGINES.get(args.engine)
    if is_vision_language(model.config) and not engine_class.images:
        able = [name for name, other in SAMPLING_ENGINES.items() if other.images]
        print(
            f"ds-tree sample: error: --engine {args.engine}: {model.config.model_type} is a vision-language model: "
            f"{engine_class.why_not['images']}; use --engine {' or '.join(able)}",
            file=sys.stderr,
        )
        return 2

    generator = torch.Generator().manual_seed(args.seed)
    directory = args.output.parent / f"{args.output.name}.vllm"  # a managed server's model and log
    try:
        engine = engine_class.for_model(model, tokenizer, url=args.vllm_url, directory=directory)
    except EngineError as error:
        print(f"ds-tree sample: error: {error}", file=sys.stderr)
        return 1
    try:
        return sample_all(args, tokenizer, prompts, settings, generator, eos, engine)
    finally:
        engine.close()


def sample_all(args, tokenizer, prompts, settings, generator, eos, engine) -> int:
    from ds_tree.data.jsonl import write_jsonl
    from ds_tree.rollout.rewards import RewardRequest, score

    records, failures, summary = [], [], {"groups": 0, "trajectories": 0, "sampled_tokens": 0, "forward_tokens": 0}
    flat_tokens = 0
    for prompt in prompts:
        tree = engine.sample_tree(prompt.ids.tolist(), settings, generator=generator, eos_token_ids=eos)
        rewards: list[float | None] = [None] * tree.leaves
        if args.reward != "none":
            requests = [
                RewardRequest(prompt.text, tokenizer.decode(tree.completion(leaf)[0]), prompt.metadata)
                for leaf in tree.leaf_nodes()
            ]
            rewards, failed = score(REWARDS.get(args.reward), requests)
            failures += [f"{prompt.source}: {message}" for message in failed]
        if args.format == "tree":
            records.append(tree.explicit_record(prompt.label, rewards))
        else:
            records += token_records(tree, prompt.label, rewards)
        summary["groups"] += 1
        summary["trajectories"] += tree.leaves
        summary["sampled_tokens"] += tree.sampled_tokens
        summary["forward_tokens"] += tree.forward_tokens
        flat_tokens += sum(len(tree.completion(leaf)[0]) for leaf in tree.leaf_nodes())
    write_jsonl(args.output, records)
    for message in failures:
        print(f"ds-tree sample: {message}", file=sys.stderr)
    summary["flat_sampled_tokens"] = flat_tokens
    summary["reward_failures"] = len(failures)
    summary["output"] = str(args.output)
    print(json_text(summary))
    return 0
