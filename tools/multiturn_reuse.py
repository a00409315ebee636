"""Tokens the multi-turn sampler draws and runs through the model for episode trees against independent
episodes of the same width, and for trees whose every turn prefills its whole path again (keys/values
not carried across turns) (docs/ENVIRONMENTS.md, *Measured*). Every mode samples the same tasks with
the same settings and seeds; prints a Markdown table.

python tools/multiturn_reuse.py --model runs/multiturn/rl/hf --tokenizer runs/multiturn/tokenizer \
    --tasks configs/multiturn_tasks.jsonl --config configs/multiturn_cpu.yaml [--count 16]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from ds_tree.config import load_config
    from ds_tree.data.convert import load_tokenizer
    from ds_tree.rollout.env import EnvironmentCalls, load_environment_class
    from ds_tree.rollout.multiturn import EpisodeRunner, HFTurnSampler, read_tasks
    from ds_tree.rollout.online import slot_generator
    from ds_tree.rollout.prompts import stop_token_ids
    from ds_tree.rollout.render import Renderer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("--model", "--tokenizer", "--tasks", "--config"):
        parser.add_argument(name, required=True)
    parser.add_argument("--count", type=int, default=16, help="tasks")
    args = parser.parse_args(argv)
    overrides = [f"model.source={args.model}", f"model.tokenizer={args.tokenizer}", f"rollout.prompts={args.tasks}"]
    config = load_config(args.config, overrides)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    tokenizer = load_tokenizer(args.tokenizer)
    stops = stop_token_ids(tokenizer, model.config)
    env = config.rollout.env
    tasks = read_tasks(args.tasks)[: args.count]
    print("| sampling | leaves | reward | sampled tokens | forward tokens | tree tokens | flat tokens |")
    print("|---|---|---|---|---|---|---|")
    modes = {"tree": (False, True), "tree, every turn prefilled": (False, False), "independent": (True, True)}
    for name, (independent, carry) in modes.items():
        settings = dataclasses.replace(config.rollout.sampler_settings(), independent=independent)
        runner = EpisodeRunner(
            load_environment_class(env.path),
            Renderer(tokenizer, stops, env.max_observation_tokens),
            HFTurnSampler(model, settings, stops, carry=carry),
            settings,
            env,
            env.max_context_tokens or config.packing.budget,
            EnvironmentCalls(env.workers),
        )
        leaves = rewards = sampled = forward = tree_tokens = flat = 0
        for slot, task in enumerate(tasks):
            with torch.no_grad():
                tree = runner.run(task.task, task.label, slot, 0, slot_generator(0, 0, slot))
            tree.build_leaves(task.label, task.source)
            leaves += len(tree.leaves)
            rewards += sum(leaf.trajectory.reward for leaf in tree.leaves)
            sampled += tree.sampled_tokens
            forward += tree.forward_tokens
            tree_tokens += sum(len(node.token_ids) for node in tree.nodes)
            flat += sum(len(leaf.trajectory) for leaf in tree.leaves)
        mean = rewards / max(leaves, 1)
        print(f"| {name} | {leaves} | {mean:.3f} | {sampled} | {forward} | {tree_tokens} | {flat} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
