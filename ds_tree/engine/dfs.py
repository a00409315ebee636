"""The dfs execution mode: a tree walked depth-first, one root-to-leaf path in memory (docs/DESIGN.md section 5).

A packed row (whole trees, any size) is cut into *chunks*: runs of at most ``chunk`` consecutive
tokens of one node chain (a node and its only child are one chain), each chunk's parent the chunk
before it on its path. The walk, for every chunk in DFS order:

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
so the activations follow one root-to-leaf path, whatever the tree's size. With ``recompute`` a
chunk is first forwarded without grad (only its keys and values kept for the children) and
forwarded again with grad right before its backward: one more forward of every token, and the
activations of a single chunk plus the path's keys and values.

Every chunk's backward goes through ``backward`` (the engine's): under DeepSpeed one call per
chunk, the gradient-accumulation boundary on the step's last; whatever factor it applies (the
world size, a loss scale) is measured and taken out of the cached gradients. ZeRO stages 0 and 1 reduce
gradients at the boundary only; stage 2 reduces at every backward, so every rank makes the same
number of calls (:func:`run_step` pads with empty-row steps). ZeRO-3 is refused: its forwards and
backwards gather parameters collectively, so every rank would have to interleave forwards and
backwards identically, which trees of different shapes do not (docs/DESIGN.md section 5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.attention.cached import IMPLEMENTATION, LayerKV, PathCache, register_cached_attention
from ds_tree.config import ConfigError
from ds_tree.engine.step import StepOutput, run_rows
from ds_tree.losses.sft import Normalisers, restoration_weights, weighted_nll
from ds_tree.models.logprobs import logprobs_at
from ds_tree.packing.dfs_rows import DfsRow
from ds_tree.packing.rows import PackedRow, assemble_row


@dataclass(frozen=True)
class DfsSettings:
    chunk: int
    """Most tokens forwarded at once (longer nodes are cut into chained chunks)."""
    recompute: bool = False
    """Forward each chunk twice (without, then with grad) to keep one chunk's activations, not a path's."""


def uses_dfs(packing) -> bool:
    """Whether ``packing`` (the config section) walks any tree: ``mode: dfs`` or ``over_budget: dfs``."""
    return packing.mode == "dfs" or (packing.mode == "tree" and packing.over_budget == "dfs")


def settings_of(packing) -> DfsSettings:
    return DfsSettings(chunk=packing.dfs_chunk or packing.budget, recompute=packing.dfs_recompute)


def check_zero_stage(packing, ds_config: dict, where: str) -> None:
    """Refuse ZeRO-3 where trees are walked (module docstring); ``where`` names the DeepSpeed JSON."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if uses_dfs(packing) and stage == 3:
        field = "packing.mode=dfs" if packing.mode == "dfs" else "packing.over_budget=dfs"
        raise ConfigError(
            f"{field} needs ZeRO stage 0, 1 or 2 ({where} has stage 3): ZeRO-3 gathers parameters collectively in "
            "every forward and backward, and the walks of different trees interleave them differently on each rank"
        )


@dataclass
class Chunks:
    """A row's chunks in DFS order: token ranges ``[start, end)`` and the parent chunk (``-1``: a root)."""

    start: np.ndarray
    end: np.ndarray
    parent: np.ndarray

    def __len__(self) -> int:
        return int(self.start.size)

    def of_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """The chunk holding each of ``tokens``."""
        return np.searchsorted(self.start, tokens, side="right") - 1


def row_chunks(row: PackedRow, chunk: int) -> Chunks:
    """The chunks of the real tokens of ``row``: node chains cut every ``chunk`` tokens.

    A token continues the chain of the token before it when that token predicts it and both have the
    same subtree end (same node, or a node's only child); else it starts a chain (a root, or one of
    several children) whose first chunk's parent is the chunk of the token that predicts it.
    """
    if chunk < 1:
        raise ValueError(f"the dfs chunk size must be >= 1, got {chunk}")
    n = row.n_real
    if n == 0:
        return Chunks(*(np.zeros(0, dtype=np.int64) for _ in range(3)))
    tokens = np.arange(n)
    continues = (row.pred_pos[:n] == tokens - 1) & (row.kv_end[:n] == np.roll(row.kv_end[:n], 1))
    chain_start = np.flatnonzero(~continues | (tokens == 0))
    chain_end = np.append(chain_start[1:], n)
    starts = np.concatenate([np.arange(s, e, chunk) for s, e in zip(chain_start, chain_end, strict=True)])
    chunks = Chunks(starts, np.append(starts[1:], n), np.empty(starts.size, dtype=np.int64))
    predictor = row.pred_pos[starts]
    chunks.parent = np.where(predictor >= 0, chunks.of_tokens(np.maximum(predictor, 0)), -1)
    return chunks


@dataclass
class ChunkInputs:
    """The model inputs of one chunk: its tokens, their depths, the path cache (``PackedRow.tensors``' role)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    path_cache: PathCache

    def tensors(self, device: torch.device | str = "cpu") -> dict:
        return {
            "input_ids": torch.as_tensor(self.input_ids, device=device)[None],
            "position_ids": torch.as_tensor(self.position_ids, device=device)[None],
            "path_cache": self.path_cache,
        }


@contextlib.contextmanager
def chunk_attention(model):
    """The model (or the DeepSpeed engine around it) attends with :func:`cached_attention` inside."""
    register_cached_attention()
    config = getattr(model, "module", model).config
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


def walk_row(
    model,
    row: PackedRow,
    weights: np.ndarray,
    settings: DfsSettings,
    backward: Callable[[torch.Tensor], None],
    *,
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
    stats: WalkStats | None = None,
) -> float:
    """Forward and backward every chunk of ``row`` (module docstring); returns the row's loss.

    ``weights``: every token's loss weight (:func:`restoration_weights`). Call inside :func:`chunk_attention`.
    """
    chunks = row_chunks(row, settings.chunk)
    targets = np.flatnonzero(weights)
    target_chunk = chunks.of_tokens(row.pred_pos[targets])
    cache = PathCache()
    stats = stats if stats is not None else WalkStats()
    total = 0.0
    scale = 1.0
    """What ``backward`` multiplies its argument by (the same for every call of one step)."""

    def forward(index: int) -> tuple[torch.Tensor, LayerKV]:
        start, end = int(chunks.start[index]), int(chunks.end[index])
        mine = targets[target_chunk == index]
        inputs = ChunkInputs(row.input_ids[start:end], row.position_ids[start:end], cache)
        if mine.size == 0:  # still a forward and a backward through every parameter, with a zero loss
            logprobs = logprobs_at(model, inputs, np.zeros(1, np.int64), row.input_ids[start : start + 1], device)
            loss = weighted_nll(logprobs, np.zeros(1))
        else:
            logprobs = logprobs_at(
                model, inputs, row.pred_pos[mine] - start, row.input_ids[mine], device, head_chunk=head_chunk
            )
            loss = weighted_nll(logprobs, weights[mine])
        return loss, cache.take_recorded()

    children: list[list[int]] = [[] for _ in range(len(chunks))]
    for index, parent in enumerate(chunks.parent):
        if parent >= 0:
            children[parent].append(index)
    # Iterative DFS (a deep chain of 1-token chunks is deeper than Python's recursion limit):
    # ``(chunk, None)`` enters a chunk, ``(chunk, state)`` leaves it.
    pending: list[tuple[int, tuple | None]] = [(i, None) for i in reversed(range(len(chunks))) if chunks.parent[i] < 0]
    while pending:
        index, state = pending.pop()
        if state is None:
            if settings.recompute:
                with torch.no_grad():
                    _, own = forward(index)
                loss = None
            else:
                loss, own = forward(index)
            leaves = {
                layer: (k.detach().requires_grad_(), v.detach().requires_grad_()) for layer, (k, v) in own.items()
            }
            pending.append((index, (loss, own, leaves)))
            pending.extend((child, None) for child in reversed(children[index]))
            cache.ancestors.append(leaves)
            stats.peak_cache_bytes = max(stats.peak_cache_bytes, _cache_bytes(cache))
            continue
        loss, own, leaves = state
        cache.ancestors.pop()
        if settings.recompute:
            loss, own = forward(index)
        # ``backward`` may scale what it is given (DeepSpeed: the world size, a float16 loss scale), so
        # the gradients on the leaves are ``scale`` times dL/dk: unscaled here, or the scale would
        # compound once per level of the path. A zero-valued leaf added to the surrogate measures it.
        probe = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        surrogate = loss + probe
        for layer, (key, value) in own.items():
            for tensor, leaf in zip((key, value), leaves[layer], strict=True):
                if leaf.grad is not None:
                    surrogate = surrogate + (tensor * (leaf.grad / scale)).sum()
        backward(surrogate)
        scale = probe.grad.item()
        total += float(loss.detach())
        stats.chunks += 1
    return total


def _cache_bytes(cache: PathCache) -> int:
    grads = sum(
        t.grad.nbytes for entry in cache.ancestors for pair in entry.values() for t in pair if t.grad is not None
    )
    return cache.nbytes() + grads


def run_step(
    model,
    rows: Sequence[PackedRow],
    normalisers: Normalisers,
    normalisation: str,
    policy: str,
    settings: DfsSettings,
    *,
    backward_for: Callable[[int], Callable[[torch.Tensor], None]],
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
    stats: WalkStats | None = None,
    router_aux=None,
) -> StepOutput:
    """One accumulation of packed rows (:func:`run_rows`) and :class:`DfsRow` rows (walked).

    ``router_aux`` (an MoE model's load-balancing loss, :mod:`ds_tree.models.moe`) is refused: the
    walk does not implement it.

    ``backward_for(n)`` gives the ``backward`` of ``n`` calls (one per packed row and per chunk).
    In a process group every rank makes as many calls as the busiest one: the others add
    zero-loss steps of an empty row (ZeRO-2 reduces gradients collectively at every backward).
    """
    if router_aux is not None:
        raise ConfigError(
            "packing.mode=dfs and packing.over_budget=dfs do not implement the MoE router load-balancing loss; "
            "set model.router_aux_loss_coef: 0"
        )
    walked = [row for row in rows if isinstance(row, DfsRow)]
    packed = [row for row in rows if not isinstance(row, DfsRow)]
    calls = len(packed) + sum(len(row_chunks(row, settings.chunk)) for row in walked)
    most = calls
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        count = torch.tensor([calls])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        most = int(count.item())
    backward = backward_for(most)
    padding = [assemble_row([]) for _ in range(most - calls)]
    output = run_rows(
        model,
        packed + padding,
        normalisers,
        normalisation,
        policy,
        backward=backward,
        device=device,
        head_chunk=head_chunk,
    )
    with chunk_attention(model):
        for row in walked:
            weights = restoration_weights(row, normalisers, normalisation, policy)
            output.loss += walk_row(
                model, row, weights, settings, backward, device=device, head_chunk=head_chunk, stats=stats
            )
    return output
