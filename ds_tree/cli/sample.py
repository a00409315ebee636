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
the model config's EOS ids and at each ``--eos-token``. Prints one JSON summary; a failing reward
is reported on stderr and leaves that trajectory without a reward. Exits 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from ds_tree.data.convert import load_tokenizer
from ds_tree.data.jsonl import read_jsonl, write_jsonl
from ds_tree.errors import DataError
from ds_tree.models.loading import DTYPES, load_model
from ds_tree.rollout.rewards import REWARDS, RewardRequest, score
from ds_tree.rollout.sampler import SampledTree, SamplerSettings, sample_tree


def prompt_ids(where: str, record: dict, tokenizer) -> list[int]:
    """The token ids of a prompts line (module docstring)."""
    given = [key for key in ("prompt", "messages", "prompt_ids") if key in record]
    if len(given) != 1:
        raise DataError(f"{where}: a prompt line needs exactly one of 'prompt', 'messages', 'prompt_ids'")
    if "prompt_ids" in record:
        ids = record["prompt_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise DataError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        return ids
    if "messages" in record:
        text = tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True)
    else:
        text = record["prompt"]
    if not isinstance(text, str) or not text:
        raise DataError(f"{where}: the prompt must be a non-empty string")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_ids(tokenizer, model, extra: list[str]) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = model.config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    for token in extra:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise DataError(f"--eos-token {token!r} is not a token of the tokenizer")
        ids.add(token_id)
    return sorted(i for i in ids if i is not None)


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
        prompts = []
        for where, record in read_jsonl(args.prompts):
            if isinstance(record, DataError):
                raise record
            prompts.append((where, record, prompt_ids(where, record, tokenizer)))
        model = load_model(args.model, dtype=args.dtype, seed=args.seed)
        eos = eos_ids(tokenizer, model, args.eos_token)
    except (DataError, FileNotFoundError, ValueError) as error:
        print(f"ds-tree sample: error: {error}", file=sys.stderr)
        return 2

    generator = torch.Generator().manual_seed(args.seed)
    records, failures, summary = [], [], {"groups": 0, "trajectories": 0, "sampled_tokens": 0, "forward_tokens": 0}
    flat_tokens = 0
    for index, (where, record, ids) in enumerate(prompts):
        group = str(record.get("group_id", f"prompt-{index}"))
        tree = sample_tree(model, ids, settings, generator=generator, eos_token_ids=eos)
        rewards: list[float | None] = [None] * tree.leaves
        if args.reward != "none":
            prompt_text = tokenizer.decode(ids)
            requests = [
                RewardRequest(prompt_text, tokenizer.decode(tree.completion(leaf)[0]), record.get("metadata") or {})
                for leaf in tree.leaf_nodes()
            ]
            rewards, failed = score(REWARDS[args.reward], requests)
            failures += [f"{where}: {message}" for message in failed]
        if args.format == "tree":
            records.append(tree.explicit_record(group, rewards))
        else:
            records += token_records(tree, group, rewards)
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
    print(json.dumps(summary))
    return 0
