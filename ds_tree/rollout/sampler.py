"""Tree-shaped sampling of a group of completions (TreePO-style) on a Hugging Face causal LM.

A group is sampled as a tree instead of ``width`` independent completions: branches decode
fixed-length segments, fork at segment boundaries, and every shared prefix is encoded once. The
prompt is encoded once; a child continues from a copy of its parent's KV cache
(:class:`transformers.DynamicCache`), never by re-encoding the prefix. docs/ROLLOUTS.md describes
the parameters; the rules in short:

- quota: the prompt owns ``width`` leaves. At segment boundary ``k`` (``k = 0`` is the end of the
  prompt) with ``k < max_depth``, a live branch owning ``q > 1`` leaves forks into
  ``min(q, branching)`` children (``q`` children at the last boundary ``max_depth - 1``) and splits
  its quota among them as evenly as possible. So ``width = branching**max_depth`` gives the full
  ``branching``-ary tree, a smaller width a trimmed one.
- stops, checked per sampled token (the token is kept): ``eos`` (one of ``eos_token_ids``),
  ``repetition`` (the last ``repetition_ngram`` completion tokens already occur as an n-gram
  earlier in the completion), ``length`` (``max_new_tokens`` reached); at the end of each segment
  ``logprob_floor`` (the segment's mean sampler log-prob is below the floor).
- refill: a branch that stops while it still owns ``q > 1`` leaves frees ``q - 1``. With
  ``refill``, live branches standing at a fork boundary take the freed leaves (the one owning
  fewest first), so they fork more; when none is, the stopped branch re-branches from its own last
  boundary (a new sibling of its last segment, from its cache cropped to that point). Every leaf
  is then sampled: a tree has exactly ``width`` leaves. Without ``refill`` freed leaves are lost.
- ``independent``: the baseline, ``width`` completions forked at the prompt (a depth-1 tree).

Log-probs are the model's own (``log_softmax`` of the unscaled logits, in float64, before
temperature and top-p), as a generation server's default "raw" log-probs: with unchanged weights
they equal the trainer's recomputed ones, so ``objective.old_logprobs: data`` gives ratio 1.
Randomness comes only from the given :class:`torch.Generator`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from ds_tree.trees.trajectory import Trajectory

FINISH_REASONS = ("eos", "repetition", "logprob_floor", "length")

GENERATION_ATTENTION = "sdpa"
"""Attention used while sampling: a plain causal kernel with a KV cache (the tree kernels take packed rows)."""


@dataclass(frozen=True)
class SamplerSettings:
    """How one prompt's group is sampled (docs/ROLLOUTS.md)."""

    segment_length: int = 16
    """Tokens decoded per segment before a branch decision."""
    branching: int = 2
    """Children per branch point."""
    max_depth: int = 3
    """Branch levels (segment boundaries 0 .. max_depth-1 may fork): at most branching**max_depth leaves."""
    width: int = 8
    """Leaves per prompt (the group size)."""
    max_new_tokens: int = 64
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities sum to >= top_p."""
    repetition_ngram: int = 0
    """0 = off; n > 0 stops a branch when its last n completion tokens already occur earlier in its completion."""
    logprob_floor: float | None = None
    """Stop a branch whose mean sampler log-prob over a segment falls below this value."""
    refill: bool = True
    """Re-branch from live or stopped paths so a tree keeps ``width`` leaves when branches stop early."""
    independent: bool = False
    """Baseline: ``width`` independent completions (a depth-1 tree), same output type."""

    def __post_init__(self) -> None:
        for name in ("segment_length", "branching", "max_depth", "width", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"sampler {name} must be >= 1, got {getattr(self, name)}")
        if not self.independent and self.width > self.branching**self.max_depth:
            raise ValueError(
                f"sampler width {self.width} exceeds branching**max_depth = {self.branching}**{self.max_depth}; "
                "raise branching or max_depth, or lower width"
            )
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"sampler temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampler top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_ngram < 0:
            raise ValueError(f"sampler repetition_ngram must be >= 0 (0 = off), got {self.repetition_ngram}")
        if self.logprob_floor is not None and not (self.logprob_floor <= 0 and math.isfinite(self.logprob_floor)):
            raise ValueError(f"sampler logprob_floor must be a finite value <= 0, got {self.logprob_floor}")

    @property
    def branch_levels(self) -> int:
        """Segment boundaries that may fork (1 for the independent baseline)."""
        return 1 if self.independent else self.max_depth


@dataclass
class SampledNode:
    """One segment of one branch: a run of sampled tokens hanging below ``parent`` (-1: the prompt)."""

    parent: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-prob of each token (float64 values)."""
    finish_reason: str | None = None
    """On a leaf, why its branch stopped (one of :data:`FINISH_REASONS`); None on inner nodes."""


@dataclass
class SampledTree:
    """A sampled group: the prompt and its completion nodes, parents listed before children."""

    prompt_ids: list[int]
    nodes: list[SampledNode]
    forward_tokens: int
    """Tokens the sampler ran through the model: the prompt once, one per decode step, one per re-branch."""

    def children(self) -> list[list[int]]:
        """Child node indices per node."""
        children: list[list[int]] = [[] for _ in self.nodes]
        for index, node in enumerate(self.nodes):
            if node.parent >= 0:
                children[node.parent].append(index)
        return children

    def leaf_nodes(self) -> list[int]:
        """Indices of the nodes without children, in creation order."""
        return [index for index, kids in enumerate(self.children()) if not kids]

    def path(self, node: int) -> list[int]:
        """Node indices from the prompt's first child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.nodes[node].parent
        return path[::-1]

    @property
    def leaves(self) -> int:
        return len(self.leaf_nodes())

    @property
    def depth(self) -> int:
        """Most branch points (nodes or the prompt with >= 2 children) on one root-to-leaf path."""
        children = self.children()
        root_forks = int(sum(node.parent < 0 for node in self.nodes) >= 2)
        deepest = 0
        for leaf in self.leaf_nodes():
            forks = sum(len(children[n]) >= 2 for n in self.path(leaf)[:-1])
            deepest = max(deepest, forks)
        return root_forks + deepest

    @property
    def sampled_tokens(self) -> int:
        """Tokens sampled, every shared prefix counted once."""
        return sum(len(node.token_ids) for node in self.nodes)

    def completion(self, leaf: int) -> tuple[list[int], list[float]]:
        """Token ids and sampler log-probs from the prompt's end to ``leaf``."""
        tokens: list[int] = []
        logprobs: list[float] = []
        for index in self.path(leaf):
            tokens += self.nodes[index].token_ids
            logprobs += self.nodes[index].logprobs
        return tokens, logprobs

    def explicit_record(self, group_id: str, rewards: Sequence[float | None] | None = None) -> dict:
        """The tree as an explicit-tree JSONL record (:mod:`ds_tree.data.explicit`).

        Node ``"prompt"`` (loss_mask 0, no logprobs) roots nodes ``0, 1, ...`` (this tree's nodes,
        with ``logprobs``); each leaf carries its ``finish_reason`` and, when given,
        ``rewards[i]`` for the i-th leaf (:meth:`leaf_nodes` order, as :meth:`trajectories`).
        """
        leaves = self.leaf_nodes()
        if rewards is not None and len(rewards) != len(leaves):
            raise ValueError(f"{len(rewards)} rewards for a tree with {len(leaves)} leaves")
        reward_of = dict(zip(leaves, rewards, strict=True)) if rewards is not None else {}
        nodes = [
            {"id": "prompt", "parent": None, "input_ids": self.prompt_ids, "loss_mask": [0] * len(self.prompt_ids)}
        ]
        for index, node in enumerate(self.nodes):
            entry = {
                "id": index,
                "parent": "prompt" if node.parent < 0 else node.parent,
                "input_ids": node.token_ids,
                "logprobs": node.logprobs,
            }
            if node.finish_reason is not None:
                entry["finish_reason"] = node.finish_reason
            if reward_of.get(index) is not None:
                entry["reward"] = reward_of[index]
            nodes.append(entry)
        return {"group_id": group_id, "nodes": nodes}

    def trajectories(self, group_id: str) -> list[Trajectory]:
        """One trajectory per leaf: prompt + completion, trained on the sampled tokens only.

        ``loss_mask`` is 0 on the prompt and 1 on sampled tokens; ``logprobs`` NaN on the prompt
        and the sampler's on sampled tokens; ``reward`` None (score them with :mod:`ds_tree.rollout.rewards`).
        """
        trajectories = []
        prompt = len(self.prompt_ids)
        for trial, leaf in enumerate(self.leaf_nodes()):
            tokens, logprobs = self.completion(leaf)
            trajectories.append(
                Trajectory(
                    input_ids=np.asarray(self.prompt_ids + tokens, dtype=np.int64),
                    loss_mask=np.concatenate([np.zeros(prompt), np.ones(len(tokens))]),
                    group_id=group_id,
                    trial=trial,
                    source=f"sampled group {group_id!r} leaf {trial}",
                    logprobs=np.concatenate([np.full(prompt, np.nan), np.asarray(logprobs, dtype=np.float64)]),
                )
            )
        return trajectories


@dataclass
class _Branch:
    """A live branch: its cache (everything but the last sampled token), next-token logits and completion."""

    cache: DynamicCache
    logits: torch.Tensor
    completion: list[int]
    node: int
    boundary: int
    """Segments completed (the boundary it stands at, or started its current segment from)."""
    quota: int
    """Leaves this branch still owns."""


def repeats_ngram(completion: Sequence[int], n: int) -> bool:
    """Whether the last ``n`` tokens of ``completion`` also occur earlier in it (overlaps count); n = 0: never."""
    if n == 0 or len(completion) <= n:
        return False
    last = list(completion[-n:])
    return any(list(completion[start : start + n]) == last for start in range(len(completion) - n))


@contextmanager
def generation_mode(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """``model`` in eval mode with a cached causal attention; its attention and mode restored afterwards."""
    implementation = model.config._attn_implementation
    training = model.training
    if implementation != GENERATION_ATTENTION:
        model.set_attn_implementation(GENERATION_ATTENTION)
    model.eval()
    try:
        yield model
    finally:
        if implementation != GENERATION_ATTENTION:
            model.set_attn_implementation(implementation)
        model.train(training)


class _TreeSampler:
    def __init__(self, model, settings: SamplerSettings, generator: torch.Generator, eos_token_ids: Sequence[int]):
        self.model = model
        self.settings = settings
        self.generator = generator
        self.eos = {int(token) for token in eos_token_ids}
        self.device = next(model.parameters()).device
        self.nodes: list[SampledNode] = []
        self.forward_tokens = 0

    def forward(self, token_ids: Sequence[int], cache: DynamicCache) -> torch.Tensor:
        """Feed ``token_ids`` after ``cache`` (updated in place); the logits after the last one."""
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        output = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        self.forward_tokens += len(token_ids)
        return output.logits[0, -1]

    def sample(self, logits: torch.Tensor) -> tuple[int, float]:
        """A token from ``logits`` (temperature, top-p) and the model's log-prob of it."""
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        settings = self.settings
        if settings.temperature == 0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits.double() / settings.temperature, dim=-1)
            if settings.top_p < 1:
                sorted_probs, order = torch.sort(probs, descending=True)
                before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
                # the smallest set reaching top_p; the most likely token is always kept
                sorted_probs[before >= settings.top_p] = 0
                probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs.to(self.generator.device)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        return token, float(logprobs[token])

    def new_node(self, parent: int) -> int:
        self.nodes.append(SampledNode(parent))
        return len(self.nodes) - 1

    def decode_segment(self, branch: _Branch) -> str | None:
        """Sample one segment into ``branch.node``; the finish reason if the branch stopped."""
        settings = self.settings
        node = self.nodes[branch.node]
        segment_end = min(settings.segment_length * (branch.boundary + 1), settings.max_new_tokens)
        while True:
            token, logprob = self.sample(branch.logits)
            node.token_ids.append(token)
            node.logprobs.append(logprob)
            branch.completion.append(token)
            reason = None
            if token in self.eos:
                reason = "eos"
            elif repeats_ngram(branch.completion, settings.repetition_ngram):
                reason = "repetition"
            elif len(branch.completion) == segment_end:
                if settings.logprob_floor is not None and np.mean(node.logprobs) < settings.logprob_floor:
                    reason = "logprob_floor"
                elif segment_end == settings.max_new_tokens:
                    reason = "length"
            if reason is not None:
                node.finish_reason = reason
                return reason
            if len(branch.completion) == segment_end:
                branch.boundary += 1
                branch.logits = self.forward([token], branch.cache)
                return None
            branch.logits = self.forward([token], branch.cache)

    def rebranch(self, stopped: _Branch, quota: int) -> _Branch:
        """A new sibling of ``stopped``'s last segment, from its cache cropped back to that segment's start."""
        start = self.settings.segment_length * stopped.boundary  # completion tokens before the segment
        fed = stopped.cache.get_seq_length()
        kept = len(self.prompt_ids) + start - 1  # keep all but the token before the boundary, then re-feed it
        stopped.cache.crop(kept - fed)
        last = (self.prompt_ids + stopped.completion)[kept]
        logits = self.forward([last], stopped.cache)
        parent = self.nodes[stopped.node].parent
        return _Branch(stopped.cache, logits, stopped.completion[:start], parent, stopped.boundary, quota)

    def fork(self, branch: _Branch) -> list[_Branch]:
        """The children of ``branch`` at its boundary (itself continuing as the first), each in a new node."""
        last_level = branch.boundary == self.settings.branch_levels - 1
        can_fork = branch.boundary < self.settings.branch_levels
        count = (branch.quota if last_level else min(branch.quota, self.settings.branching)) if can_fork else 1
        shares = [branch.quota // count + (i < branch.quota % count) for i in range(count)]
        children = []
        for i, share in enumerate(shares):
            child = branch if i == 0 else copy.copy(branch)
            if i > 0:
                child.cache = copy.deepcopy(branch.cache)
                child.completion = list(branch.completion)
            child.quota = share
            children.append(child)
        parent = branch.node
        for child in children:
            child.node = self.new_node(parent)
        return children

    def run(self, prompt_ids: list[int]) -> SampledTree:
        self.prompt_ids = prompt_ids
        cache = DynamicCache(config=self.model.config)
        logits = self.forward(prompt_ids, cache)
        live = self.fork(_Branch(cache, logits, [], -1, 0, self.settings.width))
        while live:
            stopped = []
            survivors = []
            for branch in live:
                (stopped if self.decode_segment(branch) else survivors).append(branch)
            at_fork = [b for b in survivors if b.boundary < self.settings.branch_levels]
            respawned = []
            for branch in stopped:
                freed = branch.quota - 1
                if freed == 0 or not self.settings.refill:
                    continue
                if at_fork:
                    for _ in range(freed):
                        min(at_fork, key=lambda b: b.quota).quota += 1
                else:
                    respawned.append(self.rebranch(branch, freed))
            live = [child for branch in survivors + respawned for child in self.fork(branch)]
        return SampledTree(list(prompt_ids), self.nodes, self.forward_tokens)


@torch.no_grad()
def sample_tree(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    settings: SamplerSettings,
    *,
    generator: torch.Generator,
    eos_token_ids: Sequence[int],
) -> SampledTree:
    """Sample one prompt's group as a tree (module docstring); ``model`` is left as it was given."""
    prompt_ids = [int(token) for token in prompt_ids]
    if not prompt_ids:
        raise ValueError("sample_tree needs a non-empty prompt (the first token is never sampled)")
    with generation_mode(model):
        return _TreeSampler(model, settings, generator, eos_token_ids).run(prompt_ids)
