"""Tree-shaped sampling of a group of completions (TreePO-style) on a Hugging Face causal LM.

A group is sampled as a tree instead of ``width`` independent completions: branches decode
fixed-length segments, fork at segment boundaries, and every shared prefix is encoded once. The
prompt is encoded once; a child continues from its parent's keys and values (shared tensors,
never re-encoded). Live branches whose paths are equally long (all of them, unless a re-branch
started one later) decode as one batch: their keys/values are stacked into one
:class:`transformers.DynamicCache` per segment, one model call per token step. docs/ROLLOUTS.md
describes the parameters; the rules in short:

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
  boundary (a new sibling of its last segment, from its keys/values cropped to that point). Every leaf
  is then sampled: a tree has exactly ``width`` leaves. Without ``refill`` freed leaves are lost.
- ``independent``: the baseline, ``width`` completions forked at the prompt (a depth-1 tree).

Log-probs are the model's own (``log_softmax`` of the unscaled logits, in float64, before
temperature and top-p), as a generation server's default "raw" log-probs: with unchanged weights
they equal the trainer's recomputed ones, so ``objective.old_logprobs: data`` gives ratio 1.
Randomness comes only from the given :class:`torch.Generator`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from ds_tree.models.families import family_of
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.sampling.state_cache import (
    has_recurrent_layers,
    layer_row,
    stacked_cache,
)
from ds_tree.trees.images import (
    PlaceholderCountError,
    TrajectoryImage,
    check_image_layout,
    image_runs,
    placeholder_index,
)
from ds_tree.trees.trajectory import Trajectory

FINISH_REASONS = ("eos", "repetition", "logprob_floor", "length")

GENERATION_ATTENTION = "sdpa"
"""Attention used while sampling: a plain causal kernel with a KV cache (the tree kernels take packed rows)."""


KeyValues = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, the keys and values ``[1, kv_heads, tokens, head_dim]`` of every token fed on a branch's path
(a hybrid's recurrent layer: its conv and recurrent state after that path,
:mod:`ds_tree.sampling.state_cache`)."""


@dataclass
class PromptImages:
    """The images of a vision-language model's prompt: the placeholders' pixels and every token's
    multimodal rotary positions (:func:`prompt_images`)."""

    images: tuple[TrajectoryImage, ...]
    image_index: np.ndarray
    """Per prompt token: the image it is a placeholder of, -1 for text."""
    rope: np.ndarray
    """``[3, prompt tokens]`` positions by the model's own rule (``get_rope_index``)."""

    def positions(self, start: int, length: int) -> np.ndarray:
        """``[3, length]`` positions of the path's tokens ``start ..``: the prompt's, then text after it
        (each one past the prompt's last position, the rule for text after the last image)."""
        prompt = self.rope.shape[1]
        index = np.arange(start, start + length)
        inside = np.minimum(index, prompt - 1)
        return self.rope[:, inside] + np.maximum(index - (prompt - 1), 0)[None]

    def fed_images(self, start: int, end: int) -> list[TrajectoryImage]:
        """The images whose placeholders are the prompt tokens ``start..end - 1`` (whole images only)."""
        fed = []
        for image, first, last in image_runs(self.image_index):
            if first >= start and last <= end:
                fed.append(self.images[image])
            elif first < end and last > start:
                raise ValueError(
                    f"image {image} (tokens {first}..{last - 1}) is cut by the fed tokens {start}..{end - 1}"
                )
        return fed


def placeholder_ids(config) -> list[int]:
    """A vision-language model's image and video placeholder ids (never sampled: a placeholder means
    an image's features), or none."""
    from ds_tree.models.vision import is_vision_language

    if not is_vision_language(config):
        return []
    tokens = (config.image_token_id, getattr(config, "video_token_id", None))
    return [int(token) for token in tokens if token is not None]


def prompt_images(config, prompt_ids: Sequence[int], images: Sequence[TrajectoryImage]) -> PromptImages | None:
    """The :class:`PromptImages` of a prompt with ``images`` (in order; each one run of its merged patches
    of ``<|image_pad|>``) for the model of ``config``; None for a model without a vision tower."""
    from ds_tree.models.vision import is_vision_language, rope_positions

    ids = np.asarray(prompt_ids, dtype=np.int64)
    if not is_vision_language(config):
        if images:
            raise ValueError(f"the prompt has images and the model ({config.model_type}) has no vision tower")
        return None
    try:
        index = placeholder_index(ids, config.image_token_id, images)
    except PlaceholderCountError as error:
        raise ValueError(
            f"the prompt has {error.found} image placeholder tokens; its {len(images)} image(s) need {error.needed}"
        ) from None
    check_image_layout("the prompt", index, tuple(images))
    grids = [image.grid_thw for image in images]
    return PromptImages(tuple(images), index, rope_positions(config, ids, index if images else None, grids))


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
    forward_passes: int = 0
    """Model calls: live branches with equally long paths decode as one batch."""
    leaf_key_values: dict[int, KeyValues] = field(default_factory=dict, repr=False)
    """With ``sample_tree(..., keep_key_values=True)``: per leaf node, the keys/values of the prompt and
    its completion but the last token (what was fed), so a caller can continue that path later."""

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
    """A live branch: its keys/values (everything but the last sampled token), next-token logits and completion.

    Children share their parent's key/value tensors: nothing writes to them in place (a forward
    copies them into a fresh batched cache, and cropping slices them).
    """

    key_values: KeyValues
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
    # per sub-config (a vision-language model's tower keeps its own attention): restored as they were
    restore = {"": implementation} | {
        name: getattr(model.config, name)._attn_implementation
        for name in getattr(model.config, "sub_configs", {})
        if getattr(model.config, name, None) is not None
    }
    changed = set(restore.values()) != {GENERATION_ATTENTION}
    training = model.training
    if changed:
        model.set_attn_implementation(GENERATION_ATTENTION)
    model.eval()
    try:
        yield model
    finally:
        if changed:
            model.set_attn_implementation(restore if len(restore) > 1 else implementation)
        model.train(training)


def check_cache_layers(model: PreTrainedModel) -> None:
    """Refuse models whose cache is neither a plain growing KV cache nor a recurrent state per layer
    (a sliding window cannot be cropped back to a branch point; recurrent states are forked whole:
    :mod:`ds_tree.sampling.state_cache`)."""
    kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    plain = kinds == {DynamicLayer.__name__}  # a dense model's (cropped to re-branch); a hybrid's is re-encoded
    recurrent = family_of(model.config).recurrent
    forked = set(recurrent.cache_layers) if recurrent is not None else set()  # the family's cache layers
    if not plain and not (kinds <= forked and has_recurrent_layers(model.config)):
        raise ValueError(
            f"sample_tree needs a full KV cache or a recurrent state on every layer; {model.config.model_type} "
            f"uses {sorted(kinds)} (a sliding window cannot be cropped back to a branch point)"
        )


def cache_keyword(model: PreTrainedModel) -> str:
    """The forward argument that takes a :class:`DynamicCache`: ``cache`` in current transformers
    (5.24 here, where ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values``
    in a release whose forward has no ``cache``."""
    forward = type(model).forward  # the class's: a vision-language policy's instance forward is a wrapper
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def fed_tokens(key_values: KeyValues) -> int:
    """How many tokens an attention model's ``key_values`` hold."""
    return next(keys.shape[2] for keys, _ in key_values if keys is not None)


def cache_row(cache: DynamicCache, row: int) -> KeyValues:
    """Row ``row`` of a batched cache, as views."""
    return [layer_row(layer, row) for layer in cache.layers]


class _TreeSampler:
    def __init__(
        self,
        model,
        settings: SamplerSettings,
        generator: torch.Generator,
        eos_token_ids: Sequence[int],
        keep_key_values: bool = False,
        vision: PromptImages | None = None,
    ):
        self.model = model
        self.vision = vision
        self.never = placeholder_ids(model.config)
        """Ids never sampled: a vision-language model's placeholders (an image's features, not a word)."""
        self.keep_key_values = keep_key_values
        self.leaf_key_values: dict[int, KeyValues] = {}
        self.settings = settings
        self.generator = generator
        self.eos = {int(token) for token in eos_token_ids}
        self.cache_keyword = cache_keyword(model)
        self.recurrent = has_recurrent_layers(model.config)
        self.device = next(model.parameters()).device
        self.nodes: list[SampledNode] = []
        self.forward_tokens = 0
        self.forward_passes = 0

    def forward(self, token_ids: list[list[int]], key_values: list[KeyValues]) -> tuple[torch.Tensor, DynamicCache]:
        """Feed one row of ``token_ids`` after each branch's ``key_values`` (all as long): last logits, the cache."""
        cache = stacked_cache(self.model.config, key_values)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        extra = {}
        if self.recurrent:  # some hybrids (Bamba) number positions from 0 unless told: the attention keys' count
            fed = next(DynamicLayer.get_seq_length(layer) for layer in cache.layers if isinstance(layer, DynamicLayer))
            extra["position_ids"] = torch.arange(fed, fed + input_ids.shape[1], device=self.device).expand_as(input_ids)
        if self.vision is not None:  # every row stands at the same path length
            extra = self.vision_inputs(cache.get_seq_length(), input_ids.shape)
        output = self.model(input_ids=input_ids, **{self.cache_keyword: cache}, use_cache=True, **extra)
        self.forward_tokens += input_ids.numel()
        self.forward_passes += 1
        return output.logits[:, -1], cache

    def vision_inputs(self, start: int, shape) -> dict:
        """A vision-language model's inputs for the path tokens ``start ..`` fed in rows of ``shape``:
        their multimodal rotary positions, and the pixels of the prompt's images among them."""
        rows, length = shape
        positions = torch.as_tensor(self.vision.positions(start, length), device=self.device)
        extra = {"position_ids": positions[:, None, :].expand(3, rows, length)}
        images = self.vision.fed_images(start, start + length)
        if images:
            dtype = next(self.model.parameters()).dtype
            pixels = torch.cat([torch.as_tensor(image.pixel_values) for image in images]).to(self.device, dtype)
            extra["pixel_values"] = pixels
            extra["image_grid_thw"] = torch.as_tensor([image.grid_thw for image in images], device=self.device)
        return extra

    def sample(self, logits: torch.Tensor) -> tuple[int, float]:
        """A token from ``logits`` (temperature, top-p) and the model's log-prob of it (the raw model's,
        before the placeholders are taken out of the choice)."""
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        if self.never:
            logits = logits.clone()
            logits[self.never] = -torch.inf
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

    def stop_reason(self, branch: _Branch, segment_end: int) -> str | None:
        """Why ``branch`` stops after its newest token, or None."""
        settings = self.settings
        node = self.nodes[branch.node]
        if branch.completion[-1] in self.eos:
            return "eos"
        if repeats_ngram(branch.completion, settings.repetition_ngram):
            return "repetition"
        if len(branch.completion) == segment_end:
            if settings.logprob_floor and np.mean(node.logprobs) < settings.logprob_floor:
                return "logprob_floor"
            if segment_end == settings.max_new_tokens:
                return "length"
        return None

    def decode_segment(self, group: list[_Branch]) -> tuple[list[_Branch], list[_Branch]]:
        """Decode one segment of branches with equally long paths as one batch; (stopped, at the next boundary)."""
        settings = self.settings
        segment_end = min(settings.segment_length * (group[0].boundary + 1), settings.max_new_tokens)
        rows, stopped = list(group), []
        logits = torch.stack([branch.logits for branch in group])
        cache = None
        while rows:
            going, tokens = [], []
            for row, branch in enumerate(rows):
                token, logprob = self.sample(logits[row])
                node = self.nodes[branch.node]
                node.token_ids.append(token)
                node.logprobs.append(logprob)
                branch.completion.append(token)
                node.finish_reason = self.stop_reason(branch, segment_end)
                if node.finish_reason is None:
                    going.append(row)
                    tokens.append([token])
                    continue
                if cache is not None:
                    branch.key_values = cache_row(cache, row)
                stopped.append(branch)
            rows = [rows[row] for row in going]
            if not rows:
                break
            past = [cache_row(cache, row) for row in going] if cache is not None else [b.key_values for b in rows]
            logits, cache = self.forward(tokens, past)
            if len(rows[0].completion) == segment_end:
                for row, branch in enumerate(rows):
                    branch.key_values = cache_row(cache, row)
                    branch.logits = logits[row]
                    branch.boundary += 1
                break
        return stopped, rows

    def rebranch(self, stopped: _Branch, quota: int) -> _Branch:
        """A new sibling of ``stopped``'s last segment, from its keys/values cropped back to that segment's start."""
        start = self.settings.segment_length * stopped.boundary  # completion tokens before the segment
        kept = len(self.prompt_ids) + start - 1  # keep all but the token before the boundary, then re-feed it
        if self.recurrent:  # a recurrent state holds only the path's end: encode the path up to the boundary
            logits, key_values = self.encode_prompt((self.prompt_ids + stopped.completion)[: kept + 1])
            parent = self.nodes[stopped.node].parent
            return _Branch(key_values, logits, stopped.completion[:start], parent, stopped.boundary, quota)
        cropped = [(keys[:, :, :kept], values[:, :, :kept]) for keys, values in stopped.key_values]
        last = (self.prompt_ids + stopped.completion)[kept]
        logits, cache = self.forward([[last]], [cropped])
        parent = self.nodes[stopped.node].parent
        return _Branch(cache_row(cache, 0), logits[0], stopped.completion[:start], parent, stopped.boundary, quota)

    def fork(self, branch: _Branch) -> list[_Branch]:
        """The children of ``branch`` at its boundary (itself continuing as the first), each in a new node."""
        last_level = branch.boundary == self.settings.branch_levels - 1
        can_fork = branch.boundary < self.settings.branch_levels
        count = (branch.quota if last_level else min(branch.quota, self.settings.branching)) if can_fork else 1
        shares = [branch.quota // count + (i < branch.quota % count) for i in range(count)]
        parent, completion = branch.node, branch.completion
        children = [branch] + [copy.copy(branch) for _ in range(count - 1)]
        for child, share in zip(children, shares, strict=True):
            child.completion = list(completion)
            child.quota = share
            child.node = self.new_node(parent)
        return children

    def run(self, prompt_ids: list[int], prefix_key_values: KeyValues | None = None) -> SampledTree:
        self.prompt_ids = prompt_ids
        logits, key_values = self.encode_prompt(prompt_ids, prefix_key_values)
        live = self.fork(_Branch(key_values, logits, [], -1, 0, self.settings.width))
        while live:
            groups: dict[int, list[_Branch]] = {}
            for branch in live:
                groups.setdefault(len(branch.completion), []).append(branch)
            stopped, survivors = [], []
            for group in groups.values():
                done, going = self.decode_segment(group)
                stopped += done
                survivors += going
            if self.keep_key_values:
                self.leaf_key_values.update((branch.node, branch.key_values) for branch in stopped)
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
        return SampledTree(list(prompt_ids), self.nodes, self.forward_tokens, self.forward_passes, self.leaf_key_values)

    def encode_prompt(
        self, prompt_ids: list[int], prefix_key_values: KeyValues | None = None
    ) -> tuple[torch.Tensor, KeyValues]:
        if prefix_key_values is not None:  # the first tokens' keys/values are given: feed the rest after them
            fed = fed_tokens(prefix_key_values)
            logits, cache = self.forward([prompt_ids[fed:]], [prefix_key_values])
            return logits[0], cache_row(cache, 0)
        cache = DynamicCache(config=self.model.config)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        extra = self.vision_inputs(0, input_ids.shape) if self.vision is not None else {}
        logits = self.model(input_ids=input_ids, **{self.cache_keyword: cache}, use_cache=True, **extra).logits[0, -1]
        self.forward_tokens += len(prompt_ids)
        self.forward_passes += 1
        return logits, cache_row(cache, 0)


@torch.no_grad()
def sample_tree(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    settings: SamplerSettings,
    *,
    generator: torch.Generator,
    eos_token_ids: Sequence[int],
    prefix_key_values: KeyValues | None = None,
    keep_key_values: bool = False,
    images: Sequence[TrajectoryImage] = (),
) -> SampledTree:
    """Sample one prompt's group as a tree (module docstring); ``model`` is left as it was given.

    ``prefix_key_values``: the keys/values of the prompt's first tokens (fewer than all of them),
    from an earlier call's ``leaf_key_values`` (``keep_key_values``): only the rest of the prompt is
    fed (a multi-turn episode's next turn, :class:`~ds_tree.sampling.hf_engine.HFTurnSampler`). Refused
    for models with recurrent layers (continuing their state by a multi-token forward is not checked).

    ``images`` (a vision-language model): the prompt's images in order, each one run of its merged
    patches of ``<|image_pad|>`` in ``prompt_ids``. The tower encodes those among the fed tokens, every
    token gets its multimodal rotary positions (the model's own rule, :class:`PromptImages`), and the
    placeholder ids are never sampled (their log-probs are still the raw model's).
    """
    prompt_ids = [int(token) for token in prompt_ids]
    if not prompt_ids:
        raise ValueError("sample_tree needs a non-empty prompt (the first token is never sampled)")
    check_cache_layers(model)
    if prefix_key_values is not None:
        if has_recurrent_layers(model.config):
            raise ValueError("sample_tree: prefix_key_values is for attention-only models (a recurrent state here)")
        fed = fed_tokens(prefix_key_values)
        if not 0 < fed < len(prompt_ids):
            raise ValueError(f"prefix_key_values hold {fed} tokens: give fewer than the prompt's {len(prompt_ids)}")
    vision = prompt_images(model.config, prompt_ids, images)
    with generation_mode(model):
        return _TreeSampler(model, settings, generator, eos_token_ids, keep_key_values, vision).run(
            prompt_ids, prefix_key_values
        )
