"""The dfs execution mode: a tree walked depth-first, one root-to-leaf path in memory (docs/DESIGN.md section 5).

A packed row (whole trees, any size) is cut into *chunks* of at most ``chunk`` tokens
(:mod:`ds_tree.packing.dfs_chunks`): whole subtrees packed below one parent token, or pieces of a
node chain whose subtree is larger, below which further chunks hang; every chunk's context is the
path to its parent token, held by its ancestor chunks. The walk, for every chunk in DFS order:

1. forwards the chunk on its ancestors' cached per-layer keys and values (leaf tensors that
   require grad, :mod:`ds_tree.attention.cached`); the chunk's loss is the SFT loss of every target
   token predicted from inside it (a node's last token predicts each child's first token, exactly
   the terms of the packed row, with the same restoration weights);
2. caches the chunk's own keys and values (detached leaves) and walks its children;
3. runs the chunk's backward on ``loss + sum_layers <k, dL/dk> + <v, dL/dv>``, the two gradients
   being what its descendants accumulated on its cached leaves: the gradient of that surrogate is
   exactly the chunk's share of the whole tree's gradient (a vector-Jacobian product), and its
   ancestors' leaves receive in turn the gradient it sends them.

Memory: while a chunk runs, only its ancestors' graphs are alive (they wait for their backward),
pieces of one root-to-leaf path, so the activations follow one path plus one chunk, whatever the
tree's size. With ``recompute`` a
chunk is first forwarded without grad (only its keys and values kept for the children) and
forwarded again with grad right before its backward: one more forward of every token that has a
chunk below it (a chunk without one is forwarded once, with grad), and the activations of a single
chunk plus the path's keys and values.

Every chunk's backward goes through ``backward`` (the engine's): under DeepSpeed one call per
chunk, the gradient-accumulation boundary on the step's last; whatever factor it applies (the
world size, a loss scale) is measured and taken out of the cached gradients. ZeRO stages 0 and 1 reduce
gradients at the boundary only; stage 2 reduces at every backward, so every rank makes the same
number of backward calls (:func:`run_calls` adds zero-loss ones). ZeRO-3 gathers parameters
collectively in every forward and backward, so its ranks must make calls of the same kinds in the
same order, which walks of different trees do not: they follow one schedule over all ranks' calls
(:func:`lockstep`), with zero-loss calls where a rank has none of a slot's kind (docs/DESIGN.md
section 5). A walked tree is one work item of the step plan, run by
:class:`ds_tree.engine.runners.WalkedRunner` for any objective (the chunk's loss comes from it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_tree.attention.cached import IMPLEMENTATION, LayerKV, PathCache, register_cached_attention
from ds_tree.engine.calls import (
    BACKWARD,
    FORWARD,
    NO_GRAD,
    UPDATE,
    DeferredBackward,
    Task,
    in_process_group,
    lockstep,
    run_tasks,
    run_to_end,
)
from ds_tree.losses.sft import weighted_nll
from ds_tree.models.logprobs import hidden_states_at, logprobs_at, predicted_tokens
from ds_tree.models.moe import RouterAuxLoss, captured_router_logits, layout_paths
from ds_tree.models.vision import ImageFeatures, WalkedImages
from ds_tree.packing.dfs_chunks import Chunks, row_chunks
from ds_tree.packing.dfs_images import WalkImages
from ds_tree.packing.rows import PackedRow


@dataclass(frozen=True)
class DfsSettings:
    chunk: int
    """Most tokens forwarded at once (longer nodes are cut into chained chunks)."""
    recompute: bool = False
    """Forward each chunk twice (without, then with grad) to keep one chunk's activations, not a path's."""
    lockstep: bool = False
    """Make every rank's calls in one order of kinds (ZeRO-3, :func:`lockstep`)."""


def settings_of(packing, ds_config: dict | None = None) -> DfsSettings:
    """The walk's settings from the config's ``packing`` section; under ZeRO-3 (``ds_config``) in lockstep."""
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage", 0)
    return DfsSettings(chunk=packing.dfs_chunk or packing.budget, recompute=packing.dfs_recompute, lockstep=stage == 3)


@dataclass
class WalkCache(PathCache):
    """What a walk keeps for the chunks below the current one: the path's keys and values and, in a row
    with images, the features of the images that chunks on the path encoded (each image once per walk, by
    the chunk :class:`~ds_tree.packing.dfs_images.WalkImages` assigns it to)."""

    images: WalkImages | None = None
    """Which chunk encodes each image of the row, and where each chunk reads its features (None: no images)."""
    features: dict[int, ImageFeatures] = field(default_factory=dict)
    """The cached features (leaves, accumulating their readers' gradients) of the chunks on the path that
    encoded images, by chunk."""

    @classmethod
    def of(cls, row: PackedRow, chunks: Chunks) -> WalkCache:
        sharded = hasattr(chunks, "chunk_inputs")  # a sequence-parallel walk: no images (refused with them)
        with_images = not sharded and bool(np.any(row.image_id[: row.n_real] >= 0))
        return cls(images=WalkImages(row, chunks) if with_images else None)


@dataclass
class ChunkInputs:
    """The model inputs of one chunk: its tokens, their depths, the path cache (``PackedRow.tensors``' role),
    and for a packed chunk its own ``kv_end`` (:meth:`Chunks.local_kv_end`; None: causal)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    path_cache: PathCache
    kv_end: np.ndarray | None = None
    row_images: WalkedImages | None = field(default=None, kw_only=True)
    """In a row with images: the images the chunk encodes and the cached features it reads (its ancestors'),
    each image encoded once per walk (:class:`WalkCache`)."""
    rope_positions: np.ndarray | None = field(default=None, kw_only=True)
    """``[4, n]`` depths and multimodal rotary positions, in a row with images (text after an image too)."""

    @classmethod
    def of_chunk(cls, row: PackedRow, chunks: Chunks, index: int, cache: WalkCache) -> ChunkInputs:
        if hasattr(chunks, "chunk_inputs"):  # chunks sharded over a sequence-parallel group (dfs_sequence_parallel)
            return chunks.chunk_inputs(row, index, cache)
        tokens = chunks.tokens(index)
        inputs = cls(row.input_ids[tokens], row.position_ids[tokens], cache, chunks.local_kv_end(row, index))
        if cache.images is not None:
            share = cache.images.chunk(index)
            inputs.rope_positions = row.rope_positions(tokens)
            inputs.row_images = WalkedImages(
                pixel_values=[image.pixel_values for image in share.encodes],
                grids=[image.grid_thw for image in share.encodes],
                cached=[cache.features[source] for source in share.sources],
                feature_index=share.feature_index,
            )
        return inputs

    def encoded_images(self) -> ImageFeatures | None:
        """After the forward: the features of the images the chunk encoded (None: none)."""
        return self.row_images.encoded if self.row_images is not None else None

    def tensors(self, device: torch.device | str = "cpu") -> dict:
        if self.rope_positions is None:
            positions = torch.as_tensor(self.position_ids, device=device)[None]
        else:  # [4, 1, n]: the depth, then the rotary sections (ds_tree.models.vision)
            positions = torch.as_tensor(self.rope_positions, device=device)[:, None]
        inputs = {
            "input_ids": torch.as_tensor(self.input_ids, device=device)[None],
            "position_ids": positions,
            "path_cache": self.path_cache,
        }
        if self.row_images is not None:
            inputs["row_images"] = self.row_images
        if self.kv_end is not None:
            inputs["kv_end"] = torch.as_tensor(self.kv_end, device=device)[None]
        return inputs


@contextlib.contextmanager
def chunk_attention(model):
    """The model (or the DeepSpeed engine around it) attends with :func:`cached_attention` inside."""
    register_cached_attention()
    config = getattr(model, "module", model).config
    if getattr(config, "vision_config", None) is not None:  # the language model's alone: the tower keeps its own
        config = config.get_text_config()
    previous = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = previous


@dataclass
class WalkStats:
    chunks: int = 0
    """Chunks forwarded and backwarded."""
    peak_cache_bytes: int = 0
    """Largest size of the cached ancestor keys and values with their accumulated gradients."""


ChunkLoss = Callable[[int, ChunkInputs], torch.Tensor]
"""``(chunk index, its inputs) -> the 0-dim loss of the targets predicted from inside the chunk``
(a chunk without any still returns a zero loss of a forward through every parameter)."""

_ONE_TARGET = (np.zeros(1, np.int64), np.zeros(1, np.int64))
"""``(predictor, label)`` of a forward whose log-prob is not used: every parameter, the head included, still runs."""


def walk_events(chunks: Chunks, recompute: bool) -> list[str]:
    """The kinds of the calls :func:`walk` makes on ``chunks``, in order."""
    enter, leave = (NO_GRAD, UPDATE) if recompute else (FORWARD, BACKWARD)
    skipped = _childless(chunks) if recompute else np.zeros(len(chunks), dtype=bool)
    return [enter if entering else leave for index, entering in _dfs_order(chunks) if not (entering and skipped[index])]


def _childless(chunks: Chunks) -> np.ndarray:
    """Which chunks have no chunk below them. With recompute such a chunk is forwarded once, with grad,
    right before its backward: no chunk needs its keys and values, so a first no-grad forward would be
    wasted (every packed chunk is one; on a bushy tree most of the tokens are in them)."""
    childless = np.ones(len(chunks), dtype=bool)
    parents = np.asarray(chunks.parent)
    childless[parents[parents >= 0]] = False
    return childless


def _dfs_order(chunks: Chunks) -> Iterator[tuple[int, bool]]:
    """``(chunk, True)`` on entering a chunk, ``(chunk, False)`` on leaving it (after its subtree)."""
    children: list[list[int]] = [[] for _ in range(len(chunks))]
    for index, parent in enumerate(chunks.parent):
        if parent >= 0:
            children[parent].append(index)
    # Iterative (a deep chain of 1-token chunks is deeper than Python's recursion limit).
    pending = [(i, True) for i in reversed(range(len(chunks))) if chunks.parent[i] < 0]
    while pending:
        index, entering = pending.pop()
        yield index, entering
        if entering:
            pending.append((index, False))
            pending.extend((child, True) for child in reversed(children[index]))


class WalkedRouterLoss:
    """An MoE model's router load-balancing loss of a walked row, chunk by chunk.

    :meth:`RouterAuxLoss.row_share` is ``scale * sum_t Q_t . G_t``: linear in each token's router
    probabilities ``Q_t`` (summed over layers), with constant weights ``G_t = sum_{i through t} F_i / |i|``,
    ``F_i`` the top-k assignments of trajectory ``i``'s tokens. A trajectory through a chunk runs
    from the root through the chunk's ancestors and the chunk into its subtree, all forwarded by the
    time the walk leaves the chunk, so its term is added to the chunk's loss then: the forwards record
    each token's assignments (:meth:`record`), the chunk's last forward keeps its ``Q`` for
    :meth:`chunk_share`.

    A walk sharded over a sequence-parallel group (:mod:`ds_tree.engine.dfs_sequence_parallel`: its
    chunks know ``own_tokens`` and ``whole_chunk``) forwards one shard of every chunk on each rank:
    the shard's assignments are summed over the group into the chunk's (no gradient, one all-reduce
    per chunk forward, which every rank of the group makes alike), so every rank knows every ``F_i``,
    and each rank adds its own tokens' ``Q_t . G_t``: the shares of a chunk's shards add up to the chunk's.
    """

    def __init__(self, aux: RouterAuxLoss, row: PackedRow, chunks: Chunks) -> None:
        self.aux, self.row, self.chunks = aux, row, chunks
        self.paths = layout_paths(row)  # a shard's: its whole row's trajectories
        self.through: list[list[int]] = [[] for _ in range(len(chunks))]
        """The trajectories with a token in each chunk (a sharded walk's: in this rank's shard of it)."""
        for i, path in enumerate(self.paths):
            for index in np.unique(chunks.of_tokens(path)):
                if index >= 0:
                    self.through[index].append(i)
        self.counts: torch.Tensor | None = None
        """Top-k assignments per row token, summed over layers (filled as chunks are forwarded)."""
        self.layers = 0
        self.total = 0.0
        """The row's share of the loss so far, before the coefficient (``StepOutput.router_aux``)."""

    def record(self, index: int, router_logits: list[torch.Tensor]) -> torch.Tensor:
        """The chunk's (shard's) ``Q`` from the router logits of its forward; records the chunk's tokens'
        assignments."""
        if not router_logits:
            raise RuntimeError("no router logits were captured in the forward of an MoE model")
        tokens = self.chunks.tokens(index)
        own = self.chunks.own_tokens(index) if hasattr(self.chunks, "own_tokens") else tokens
        dtype = torch.float64 if router_logits[0].dtype == torch.float64 else torch.float32
        probabilities = [
            torch.softmax(logits.reshape(-1, logits.shape[-1]).to(dtype), dim=-1) for logits in router_logits
        ]  # a shard's rows: its real tokens (``own``), then padding
        with torch.no_grad():
            counts = sum(
                F.one_hot(torch.topk(p[: own.size], self.aux.top_k, dim=-1).indices, self.aux.num_experts)
                .sum(-2)
                .to(dtype)
                for p in probabilities
            )
            if hasattr(self.chunks, "whole_chunk"):  # a shard's: summed over its group into the chunk's
                counts = self.chunks.whole_chunk(index, counts)
            if self.counts is None:
                self.counts = counts.new_zeros(self.row.n_tokens, self.aux.num_experts)
            self.counts[torch.as_tensor(tokens, device=counts.device)] = counts
        self.layers = len(router_logits)
        return torch.stack(probabilities).sum(0)

    def chunk_share(self, index: int, probabilities: torch.Tensor) -> torch.Tensor:
        """``scale * sum_{t in chunk} Q_t . G_t`` (differentiable in ``probabilities``, the chunk's ``Q``;
        a sharded walk's: its shard's tokens)."""
        weights = torch.zeros_like(probabilities)
        for i in self.through[index]:
            path = self.paths[i]
            mine = torch.as_tensor(self.chunks.local(path[self.chunks.of_tokens(path) == index]), device=weights.device)
            per_trajectory = self.counts[torch.as_tensor(path, device=weights.device)].sum(0) / len(path)
            weights.index_add_(0, mine, per_trajectory.expand(len(mine), -1))
        aux = self.aux
        scale = aux.num_experts / (self.layers * self.layers * aux.flat_tokens) if aux.flat_tokens else 0.0
        share = scale * (probabilities * weights).sum()
        self.total += float(share.detach())
        return share


def walk(
    model,
    row: PackedRow,
    chunks: Chunks,
    chunk_loss: ChunkLoss,
    settings: DfsSettings,
    backward: Callable[[torch.Tensor], None],
    stats: WalkStats | None = None,
    device: torch.device | str = "cpu",
    router: WalkedRouterLoss | None = None,
) -> Generator[None, None, float]:
    """Forward and backward every chunk of ``row`` (module docstring), one call per step of the
    generator (:func:`walk_events` lists them); returns the sum of the chunk losses, with
    ``router``'s coefficient times its share of the MoE router loss (:class:`WalkedRouterLoss`).
    """
    cache = WalkCache.of(row, chunks)
    stats = stats if stats is not None else WalkStats()
    total = 0.0
    scale = 1.0
    """What ``backward`` multiplies its argument by (the same for every call of one step)."""
    held: dict[int, tuple] = {}

    def forward(index: int, grad: bool = True) -> tuple[tuple | None, LayerKV, ImageFeatures | None]:
        """The chunk's loss and router probabilities (None without ``grad``: only its keys and values
        are needed, and its routing), its keys and values, and the features of the images it encodes."""
        inputs = ChunkInputs.of_chunk(row, chunks, index, cache)
        with chunk_attention(model), torch.set_grad_enabled(grad):
            with captured_router_logits(model, enabled=router is not None) as router_logits:
                loss = chunk_loss(index, inputs) if grad else logprobs_at(model, inputs, *_ONE_TARGET, device)
            probabilities = router.record(index, router_logits) if router is not None else None
        return ((loss, probabilities) if grad else None), cache.take_recorded(), inputs.encoded_images()

    skipped = _childless(chunks) if settings.recompute else np.zeros(len(chunks), dtype=bool)
    for index, entering in _dfs_order(chunks):
        if entering and skipped[index]:  # its one forward is made on leaving it (:func:`_childless`)
            continue
        if entering:
            loss, own, features = forward(index, grad=not settings.recompute)
            leaves = {
                layer: (k.detach().requires_grad_(), v.detach().requires_grad_()) for layer, (k, v) in own.items()
            }
            feature_leaves = features.leaves() if features is not None else None
            held[index] = (loss, own, leaves, features, feature_leaves)
            cache.ancestors.append(leaves)
            if feature_leaves is not None:  # read by the chunks below that show its images (WalkImages)
                cache.features[index] = feature_leaves
            stats.peak_cache_bytes = max(stats.peak_cache_bytes, _cache_bytes(cache))
            yield
            continue
        loss, own, leaves, features, feature_leaves = held.pop(index) if not skipped[index] else (None,) * 5
        if not skipped[index]:
            cache.ancestors.pop()
            cache.features.pop(index, None)
        if settings.recompute:  # its images encoded again, with grad (the first forward had none)
            loss, own, features = forward(index)
        loss, probabilities = loss
        if router is not None:  # every trajectory through the chunk has been forwarded: its routing is known
            loss = loss + router.aux.coefficient * router.chunk_share(index, probabilities).to(loss.dtype)
        # ``backward`` may scale what it is given (DeepSpeed: the world size, a float16 loss scale), so
        # the gradients on the leaves are ``scale`` times dL/dk: unscaled here, or the scale would
        # compound once per level of the path. A zero-valued leaf added to the surrogate measures it.
        probe = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        surrogate = loss + probe
        for layer, layer_leaves in (leaves or {}).items():  # none for a chunk forwarded only here (none below it)
            for tensor, leaf in zip(own[layer], layer_leaves, strict=True):
                if leaf.grad is not None:
                    surrogate = surrogate + (tensor * (leaf.grad / scale)).sum()
        if feature_leaves is not None:  # its images' gradients from the chunks below: one tower backward
            for tensor, leaf in zip(features.tensors(), feature_leaves.tensors(), strict=True):
                grad = leaf.grad / scale if leaf.grad is not None else torch.zeros_like(tensor)  # tower kept in graph
                surrogate = surrogate + (tensor * grad).sum()
        with chunk_attention(model), cache.replaying():  # checkpointed layers recompute in the backward
            backward(surrogate)
        scale = probe.grad.item()
        total += float(loss.detach())
        stats.chunks += 1
        yield
    return total


@torch.no_grad()
def walk_scores(
    model, row: PackedRow, chunks: Chunks, targets: np.ndarray, score: Callable
) -> Generator[None, None, list[tuple[np.ndarray, torch.Tensor]]]:
    """``score(model, inputs, predictors, labels)`` of the row's ``targets`` (row indices) of every chunk,
    one no-grad forward per chunk and step of the generator: ``[(positions in targets, values)]`` per chunk
    that predicts some (the old and reference policies' log-probs of a walked row, a teacher's hidden states);
    the path's keys and values are the only memory kept. A chunk predicting none is forwarded on one dummy
    target, for its keys and values."""
    cache = WalkCache.of(row, chunks)
    found = []
    target_chunk = chunks.of_tokens(row.pred_pos[targets])
    for index, entering in _dfs_order(chunks):
        if not entering:
            cache.ancestors.pop()
            cache.features.pop(index, None)
            continue
        inputs = ChunkInputs.of_chunk(row, chunks, index, cache)
        mine = np.flatnonzero(target_chunk == index)
        predictors = chunks.local(row.pred_pos[targets[mine]]) if mine.size else np.zeros(1, np.int64)
        labels = row.input_ids[targets[mine]] if mine.size else inputs.input_ids[:1]
        with torch.no_grad(), chunk_attention(model):
            values = score(model, inputs, predictors, labels)
        if mine.size:
            found.append((mine, values))
        cache.ancestors.append(cache.take_recorded())
        if inputs.encoded_images() is not None:
            cache.features[index] = inputs.encoded_images()
        yield
    return found


def walk_logprobs(
    model, row: PackedRow, chunks: Chunks, targets: np.ndarray, *, device="cpu", head_chunk: int = 0, head=None
) -> Generator[None, None, np.ndarray]:
    """``log p`` of the row's ``targets`` (row indices) by :func:`walk_scores` (the old and reference
    policies' log-probs of a walked row). ``head``: what a forward gives per target instead of the log-probs
    (:attr:`~ds_tree.engine.runners.RunContext.head`: a value model's values). Call inside :func:`chunk_attention`."""

    def score(model, inputs, predictors, labels) -> torch.Tensor:
        if head is not None:
            return head(model, inputs, predictors, labels, device, entropy=None, head_chunk=head_chunk)[0]
        return logprobs_at(model, inputs, predictors, labels, device, head_chunk=head_chunk)

    out = np.zeros(targets.size)
    for mine, values in (yield from walk_scores(model, row, chunks, targets, score)):
        out[mine] = values.double().cpu().numpy()
    return out


def walk_hidden_states(
    model, row: PackedRow, chunks: Chunks, targets: np.ndarray, *, device="cpu"
) -> Generator[None, None, torch.Tensor]:
    """``[len(targets), hidden]``: the final hidden states predicting the row's ``targets`` by
    :func:`walk_scores` (on-policy distillation's teacher, :func:`~ds_tree.models.logprobs.hidden_states_at`);
    an empty tensor without targets."""

    def score(model, inputs, predictors, labels) -> torch.Tensor:
        return hidden_states_at(model, inputs, predictors, device)

    found = yield from walk_scores(model, row, chunks, targets, score)
    if not found:
        return torch.zeros(0, device=device)
    order = np.concatenate([mine for mine, _ in found])
    values = torch.cat([value for _, value in found])
    return values[torch.as_tensor(np.argsort(order), device=values.device)]


def trajectory_logprobs(
    model, rows: Sequence[PackedRow], chunk: int, *, device="cpu", head_chunk: int = 0
) -> dict[int, np.ndarray]:
    """``id(trajectory) -> log p`` of its tokens 1.. for every trajectory of ``rows``, each walked
    without grad (:func:`walk_logprobs`; what :func:`run_rows` gives with ``collect_logprobs``)."""
    out = {}
    for row in rows:
        targets = predicted_tokens(row)
        walked = walk_logprobs(model, row, row_chunks(row, chunk), targets, device=device, head_chunk=head_chunk)
        by_token = np.full(row.n_tokens, np.nan)
        by_token[targets] = run_to_end(walked)
        for part, trajectory_id, path in row.trajectory_paths():
            out[id(part.tree.trajectories[trajectory_id])] = by_token[path[1:]]
    return out


def dummy_call(model, backward: Callable[[torch.Tensor], None] | None, device="cpu") -> Callable[[str], None]:
    """``dummy(kind)``: a call of ``kind`` on one token with a zero loss, which gathers and reduces
    like any other. A dummy :data:`FORWARD` holds its graph for a later dummy :data:`BACKWARD`."""
    held: list[torch.Tensor] = []

    def dummy(kind: str) -> None:
        if kind == BACKWARD:
            with chunk_attention(model):
                backward(held.pop())
            return
        inputs = ChunkInputs(np.zeros(1, np.int64), np.zeros(1, np.int64), PathCache())
        with torch.set_grad_enabled(kind != NO_GRAD), chunk_attention(model):
            loss = weighted_nll(logprobs_at(model, inputs, *_ONE_TARGET, device), np.zeros(1))
            if kind == UPDATE:
                backward(loss)
        if kind == FORWARD:
            held.append(loss)

    return dummy


def run_calls(
    model,
    tasks: Sequence[Task],
    settings: DfsSettings,
    backward: DeferredBackward,
    backward_for: Callable[[int], Callable[[torch.Tensor], None]],
    device="cpu",
) -> None:
    """Run ``tasks`` (built with ``backward``) as one accumulation: every rank makes as many backward
    calls as the busiest (the others add zero-loss calls; ZeRO-2 reduces gradients collectively at
    every backward), and with ``settings.lockstep`` (ZeRO-3) calls of the same kinds in the same
    order (:func:`lockstep`)."""
    events = [kind for task in tasks for kind in task.events]
    schedule = lockstep(events) if settings.lockstep and in_process_group() else None
    calls = sum(kind in (BACKWARD, UPDATE) for kind in (schedule if schedule is not None else events))
    most = calls
    if schedule is None and in_process_group():
        count = torch.tensor([calls])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        most = int(count.item())
    backward.function = backward_for(most)
    dummy = dummy_call(model, backward, device)
    run_tasks(tasks, schedule, dummy)
    for _ in range(most - calls):
        dummy(UPDATE)


def _cache_bytes(cache: WalkCache) -> int:
    """The path's keys and values and cached image features, with their accumulated gradients."""
    features = [t for entry in cache.features.values() for t in entry.tensors()]
    cached = [t for entry in cache.ancestors for pair in entry.values() for t in pair] + features
    return cache.nbytes() + sum(t.nbytes for t in features) + sum(t.grad.nbytes for t in cached if t.grad is not None)
