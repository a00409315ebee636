"""Sample each prompt's group as a tree with a Hugging Face model, score it, write rollouts JSONL.

    ds-tree sample --model CONFIG_OR_DIR --tokenizer DIR --prompts FILE --output FILE
        [--format tree|tokens] [--reward game24|exact_match|none] [--seed N] [--dtype float32]
        [--segment-length 16] [--branching 2] [--max-depth 3] [--width 8] [--max-new-tokens 64]
        [--temperature 1.0] [--top-p 1.0] [--repetition-ngram 0] [--logprob-floor X]
        [--no-refill] [--independent] [--eos-token TOKEN ...]

A prompts line is ``{"group_id": str?, "prompt": str | "messages": [chat] | "prompt_ids": [int],
"metadata": {...}?}``: text is encoded without special tokens, messages through the tokenizer's
chat template with the generation prompt, ids as given; ``metadata`` goes to the reward
(docs/ROLLOUTS.md). ``--format tree`` writes one explicit tree a line (train it after
``ds-tree convert --format tree``), ``tokens`` one trajectory a line (trains as ``data.path``);
both carry the sampler's ``logprobs`` and the ``reward``. The model stops at the tokenizer's and
the model config's EOS ids, the chat turn's end (``<|im_end|>``) when the tokenizer has
one, and at each ``--eos-token``. Prints one JSON summary; a failing reward
is reported on stderr and leaves that trajectory without a reward. Exits 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from ds_tree.data.convert import load_tokenizer
from ds_tree.data.jsonl import json_text, write_jsonl
from ds_tree.errors import DataError
from ds_tree.models.loading import DTYPES, load_model
from ds_tree.rollout.prompts import read_prompts, stop_token_ids
from ds_tree.rollout.rewards import REWARDS, RewardRequest, score
from ds_tree.rollout.sampler import SampledTree, SamplerSettings, sample_tree


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
    defaults = SamplerSettings()
    group = parser.add_argument_group("sampler (docs/ROLLOUTS.md)")
    for field in fields(SamplerSettings):
        if field.type in ("bool", bool):
            continue
        kind = float if field.name in ("temperature", "top_p", "logprob_floor") else int
        group.add_argument(
            f"--{field.name.replace('_', '-')}", type=kind, default=getattr(defaults, field.name), dest=field.name
        )
    group.add_argument("--no-refill", dest="refill", action="store_false", help="lose the leaves of early stops")
    group.add_argument("--independent", action="store_true", help="width independent completions (the baseline)")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="model config JSON (random init) or local HF directory")
    parser.add_argument("--tokenizer", required=True, help="local tokenizer directory")
    parser.add_argument("--prompts", required=True, type=Path, help="prompts JSONL (module docstring)")
    parser.add_argument("--output", required=True, type=Path, help="rollouts JSONL to write (.gz compresses)")
    parser.add_argument("--format", choices=("tree", "tokens"), default="tree")
    parser.add_argument("--reward", choices=(*REWARDS, "none"), default="none")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (and of a random init)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--eos-token", action="append", default=[], help="another token that ends a branch")
    add_sampler_arguments(parser)
    args = parser.parse_args(argv)
    settings_fields = {field.name: getattr(args, field.name) for field in fields(SamplerSettings)}
    try:
        settings = SamplerSettings(**settings_fields)
    except ValueError as error:
        parser.error(str(error))
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        model = load_model(args.model, dtype=args.dtype, seed=args.seed)
        prompts = read_prompts(args.prompts, tokenizer, model.config.vocab_size)
        eos = stop_token_ids(tokenizer, model.config, args.eos_token)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"ds-tree sample: error: {error}", file=sys.stderr)
        return 2

    generator = torch.Generator().manual_seed(args.seed)
    records, failures, summary = [], [], {"groups": 0, "trajectories": 0, "sampled_tokens": 0, "forward_tokens": 0}
    flat_tokens = 0
    for prompt in prompts:
        tree = sample_tree(model, prompt.ids, settings, generator=generator, eos_token_ids=eos)
        rewards: list[float | None] = [None] * tree.leaves
        if args.reward != "none":
            requests = [
                RewardRequest(prompt.text, tokenizer.decode(tree.completion(leaf)[0]), prompt.metadata)
                for leaf in tree.leaf_nodes()
            ]
            rewards, failed = score(REWARDS[args.reward], requests)
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
