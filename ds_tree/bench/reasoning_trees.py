"""Reasoning turns as trees: tokens a multi-turn episode costs to train when the chat template strips
earlier turns' reasoning (docs/ENVIRONMENTS.md, *Reasoning turns as trees*).

With such a template (QwQ / DeepSeek-R1 style, and Qwen3 after a new user message) turn k's context
is the template's rendering of the history, without the reasoning sampled in turns before k: not
"turn k-1's sampled tokens + observation". The rollout then continues each turn in a new branch
whose root is that rendering, so an episode is a tree whose paths are each turn's exact context. A
flat trainer either trains every turn as its own sample (the whole history again each turn) or
re-renders the final conversation as one sequence (training earlier turns without the reasoning
that produced them: tokens the model never saw in that context).

Measured on the CPU multi-turn example's task (:class:`~ds_tree.envs.secret_tool.LoudSecretToolEnv`,
``rollout.env.turn_branching: [1, 16]``: one call turn, 16 answers after its observation) with a
scripted policy that thinks ``reasoning_tokens`` tokens before each turn (no model here writes
reasoning; the counts depend on the turns' lengths only, which the script fixes). Per episode:

- ``tree``: distinct tokens of the episode's trie (every turn's context and turn, shared prefixes once);
- ``turn samples``: the same trajectories laid out flat (each turn's own context as its own sequence,
  the shared call turn once): what ``verify``'s flat mode computes;
- ``independent``: a flat trainer's episodes: each leaf's every turn its own sample (the call turn
  and its context once per leaf);
- ``re-rendered``: each leaf's final conversation rendered by the template as one sequence.
"""

from __future__ import annotations

import random
import sys

import torch
from tqdm import tqdm

from ds_tree.envs.secret_tool import LoudSecretToolEnv, tasks
from ds_tree.rollout.env import EnvironmentCalls
from ds_tree.rollout.episodes.runner import EpisodeRunner
from ds_tree.rollout.episodes.tree import TRAINED_STOPS, EpisodeTree
from ds_tree.rollout.render import Renderer
from ds_tree.sampling.interface import SampledTurn, TurnSampler
from ds_tree.sampling.settings import EnvSettings, SamplerSettings
from ds_tree.trees.stats import token_counts
from ds_tree.turn_formats import resolve_format, turn_stop_tokens
from ds_tree.vocab.chat_templates import chat_template
from ds_tree.vocab.tokenizer import build_tokenizer

COLUMNS = ("template", "episodes", "leaves", "rewritten", "tree", "turn_samples", "independent", "re_rendered")
WORDS = "first the tool then read its answer so the secret is the digit it states and I answer that".split()
CALL = '<tool_call>\n{"name": "get_secret", "arguments": {}}\n</tool_call>'


class ThinkingPolicy(TurnSampler):
    """Turn 0 thinks and calls ``get_secret``; turn 1 thinks and answers the secret. ``reasoning_tokens``
    of thinking (words drawn per sibling); the generation prompt may already open ``<think>``."""

    def __init__(self, tokenizer, reasoning_tokens: int, seed: int = 0) -> None:
        self.tokenizer, self.reasoning_tokens = tokenizer, reasoning_tokens
        self.rng = random.Random(seed)
        self.stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.forward_tokens = 0

    def thought(self) -> str:
        words = [self.rng.choice(WORDS) for _ in range(self.reasoning_tokens)]
        ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False)[: self.reasoning_tokens]
        return self.tokenizer.decode(ids).strip()

    def sample(self, prefix_ids, n, max_new_tokens, generator) -> list[SampledTurn]:
        prefix = self.tokenizer.decode(list(prefix_ids), skip_special_tokens=False)
        opened = prefix.endswith("<think>\n")
        secret = prefix.rsplit("<tool_response>\n", 1)[-1][:1] if "<tool_response>" in prefix else None
        turns = []
        for _ in range(n):
            body = CALL if secret is None else secret
            text = ("" if opened else "<think>\n") + f"{self.thought()}\n</think>\n\n{body}"
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.stop]
            turns.append(SampledTurn(ids, [-1.0] * len(ids), "eos"))
        return turns


class RecordingRunner(EpisodeRunner):
    """Keeps each finished leaf's conversation (what a re-rendering flat trainer would train)."""

    finished: list[list[dict]]

    def end(self, tree, leaf, node, reason, error="") -> None:
        self.finished.append(list(leaf.messages))
        super().end(tree, leaf, node, reason, error)


def reasoning_episode(template: str, task: dict, reasoning_tokens: int = 64, width: int = 16, tokenizer=None):
    """One episode tree of the secret-tool task with template ``template``'s tokenizer: (the tree,
    the renderer, the finished leaves' conversations)."""
    tokenizer = tokenizer or build_tokenizer(chat_format=template)
    turn_format = resolve_format("auto", tokenizer)
    stops = [tokenizer.convert_tokens_to_ids(token) for token in turn_stop_tokens(turn_format, tokenizer)]
    renderer = Renderer(tokenizer, stops + [tokenizer.eos_token_id], 0, turn_format)
    settings = SamplerSettings(width=width, branching=width, max_depth=2, max_new_tokens=4 * reasoning_tokens + 64)
    env = EnvSettings(turn_branching=[1, width], max_turns=2)
    policy = ThinkingPolicy(tokenizer, reasoning_tokens)
    runner = RecordingRunner(LoudSecretToolEnv, renderer, policy, settings, env, 8192, EnvironmentCalls(1))
    runner.finished = []
    tree = runner.run(task, str(task["id"]), 0, 1, torch.Generator().manual_seed(0))
    tree.build_leaves(f"{task['id']}/step1/slot0", "reasoning_trees")
    return tree, renderer, runner.finished


def independent_tokens(tree: EpisodeTree) -> int:
    """Tokens of every finished leaf's turns each as its own sample (its context and the turn, the
    observation after it left out), the leaf's whole history once per leaf."""
    total = 0
    for index, node in enumerate(tree.nodes):
        if node.stop_reason not in TRAINED_STOPS:
            continue
        walk = index
        while walk >= 0:
            path = tree.path(walk)
            for depth, turn in enumerate(path):
                if depth:
                    observation = len(tree.nodes[turn].token_ids) - sum(tree.nodes[turn].trainable)
                    total += sum(len(tree.nodes[n].token_ids) for n in path[: depth + 1]) - observation
            walk = tree.nodes[path[0]].continues
    return total


def measure(template: str, episodes: int = 16, reasoning_tokens: int = 64, width: int = 16) -> dict:
    """Per-episode token counts (mean over ``episodes`` tasks) for template ``template``."""
    tokenizer = build_tokenizer(chat_format=template)
    sums = dict.fromkeys(COLUMNS[2:], 0)
    # a progress line on stderr once it takes over 2 s (a wide episode takes seconds: --width 100000, 12 s each)
    for task in tqdm(tasks(episodes, 0), desc=f"{template} episodes", unit=" episode", file=sys.stderr, delay=2.0):
        tree, renderer, finished = reasoning_episode(template, task, reasoning_tokens, width, tokenizer)
        counts = token_counts([leaf.trajectory for leaf in tree.leaves])
        sums["leaves"] += sum(leaf.stop_reason == "done" for leaf in tree.leaves)
        sums["rewritten"] += tree.counts["rewritten"]
        sums["tree"] += counts.tree_tokens
        sums["turn_samples"] += counts.flat_tokens
        sums["independent"] += independent_tokens(tree)
        sums["re_rendered"] += sum(len(renderer.encode(renderer.render(m, None, False))) for m in finished)
    return {"template": template, "episodes": episodes, **{key: value / episodes for key, value in sums.items()}}


def measure_templates(
    templates: tuple[str, ...] = ("qwq", "qwen3"), episodes: int = 16, reasoning_tokens: int = 64, width: int = 16
) -> list[dict]:
    for template in templates:
        if chat_template(template).turn_format != "qwen3":
            raise ValueError(f"template {template!r} has no <think> reasoning; use qwq or qwen3")
    return [measure(template, episodes, reasoning_tokens, width) for template in templates]
