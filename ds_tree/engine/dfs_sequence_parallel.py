"""The dfs walk with Ulysses sequence parallelism: each chunk sharded over the group (docs/DESIGN.md section 5).

A sequence-parallel group of ``S`` ranks walks one tree together (:mod:`ds_tree.packing.dfs_shards`):
the same chunks in the same order, each rank forwarding one contiguous shard of every chunk, the chunk
padded at its end to ``S x L`` tokens. In every attention layer (:meth:`ChunkShards.attention`,
reached from :func:`~ds_tree.attention.cached.cached_attention` through the ``chunk_shards`` model
kwarg) an all-to-all turns the shards' queries, keys and values ``[H, L]`` into the whole padded
chunk for ``H / S`` heads ``[H / S, S x L]``; the cached attention then attends that head subset on
the ancestors' cached keys and values of the same heads, and a second all-to-all returns the output
to shards. What the walk caches for the chunk's children is therefore this rank's ``H / S`` key/value
heads over the chunk's real tokens (padding dropped): the path's cache is ``1 / S`` per rank, and the
activations a walk holds (its ancestors' graphs, or with recompute one chunk's) are shards.

Padding: the chunk's last ``S x L - n`` tokens only see themselves and the context (a packed chunk's
``kv_end`` gives them ``k + 1``; a chain chunk is causal and they come last), carry no loss and are
not cached, so no real token sees them. Their depths continue the chunk's (sliding windows check them).

Exactness: each rank's surrogate (:func:`~ds_tree.engine.dfs.walk`) holds the loss terms predicted
from its shard and ``<k, dL/dk> + <v, dL/dv>`` of its heads' cached keys and values; the all-to-alls'
backward carries every term's gradient to the rank that holds its inputs, so the sum over the group of
its backwards is the chunk's share of the tree's gradient, as without sharding. The ranks of a group
make the same calls (the same chunks), so the ZeRO-3 lockstep schedule of all ranks
(:func:`~ds_tree.engine.calls.lockstep`) pairs them, and the dummy calls a rank adds run without the
all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.attention.cached import PathCache
from ds_tree.engine.dfs import ChunkInputs
from ds_tree.engine.runners import RunContext, WalkedRunner
from ds_tree.models.head_parallel import exchange, sequence_parallel_group
from ds_tree.packing.dfs_chunks import Chunks, row_chunks
from ds_tree.packing.dfs_shards import DfsRowShard, shard_length
from ds_tree.packing.rows import PackedRow


@dataclass
class ChunkShards:
    """One chunk as this rank's group shards it: what its attention layers need besides the shard."""

    group: object
    size: int
    n_real: int
    """Real tokens of the chunk (the padded chunk is ``size x`` the shard)."""
    position_ids: torch.Tensor
    """``[1, padded]``: the whole padded chunk's depths."""
    kv_end: torch.Tensor | None
    """``[1, padded]``: the whole padded chunk's own ``kv_end`` (None: causal, a chain chunk)."""

    def to_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[B, H, L, D]`` (all heads, this rank's shard) -> ``[B, H / S, S x L, D]`` (its heads, the chunk)."""
        batch, heads, length, dim = tensor.shape
        if heads % self.size:  # fewer key/value heads than ranks: each rank takes a copy of its query heads' one
            tensor = tensor.repeat_interleave(self.size // heads, dim=1)
            heads = self.size
        split = tensor.reshape(batch, self.size, heads // self.size, length, dim).transpose(0, 1)
        gathered = exchange(split, self.group)  # [S (shard), B, H / S, L, D]
        return gathered.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * length, dim)

    def to_shards(self, output: torch.Tensor) -> torch.Tensor:
        """``[B, S x L, H / S, D]`` (the attention's output for this rank's heads) -> ``[B, L, H, D]``."""
        batch, padded, heads, dim = output.shape
        length = padded // self.size
        split = output.reshape(batch, self.size, length, heads, dim).transpose(0, 1)
        gathered = exchange(split, self.group)  # [S (head group), B, L, H / S, D]
        return gathered.permute(1, 2, 0, 3, 4).reshape(batch, length, self.size * heads, dim)

    def attention(self, core: Callable, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """``core`` (the cached attention) on this rank's heads of the whole chunk (module docstring)."""
        cache = kwargs["path_cache"]
        kv_end = None if self.kv_end is None else self.kv_end.to(query.device)
        kwargs.update(position_ids=self.position_ids.to(query.device), kv_end=kv_end)
        output, weights = core(
            module,
            self.to_heads(query),
            self.to_heads(key),
            self.to_heads(value),
            attention_mask,
            scaling,
            dropout,
            **kwargs,
        )
        if cache.recording:  # the children's context: real tokens only
            layer = module.layer_idx
            own_key, own_value = cache.recorded[layer]
            cache.recorded[layer] = (own_key[:, :, : self.n_real], own_value[:, :, : self.n_real])
        return self.to_shards(output), weights


@dataclass
class ShardInputs(ChunkInputs):
    """A chunk's inputs on one rank: its shard's tokens and depths, and the :class:`ChunkShards`."""

    shards: ChunkShards | None = None

    def tensors(self, device: torch.device | str = "cpu") -> dict:
        inputs = super().tensors(device)
        inputs["chunk_shards"] = self.shards
        return inputs


class ShardedChunks:
    """A row's :class:`~ds_tree.packing.dfs_chunks.Chunks` as rank ``position`` of a group of ``size``
    walks them: the same chunks and order, but each chunk's inputs are this rank's shard
    (:meth:`chunk_inputs`, used by :meth:`~ds_tree.engine.dfs.ChunkInputs.of_chunk`), and a target
    predicted from another rank's shard is in no chunk here (:meth:`of_tokens` gives -1)."""

    def __init__(self, chunks: Chunks, size: int, position: int, group) -> None:
        self.chunks, self.size, self.position, self.group = chunks, size, position, group
        self.parent = chunks.parent
        self.length = shard_length(chunks.end - chunks.start, size)
        """Tokens of each chunk's shards."""

    def __len__(self) -> int:
        return len(self.chunks)

    def tokens(self, index: int) -> np.ndarray:
        return self.chunks.tokens(index)

    def _within(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = self.chunks.position[tokens]
        chunk = self.chunks.chunk_of[positions]
        return chunk, positions - self.chunks.start[chunk] - self.position * self.length[chunk]

    def of_tokens(self, tokens: np.ndarray) -> np.ndarray:
        chunk, local = self._within(tokens)
        return np.where((local >= 0) & (local < self.length[chunk]), chunk, -1)

    def local(self, tokens: np.ndarray) -> np.ndarray:
        """Each of ``tokens``' index inside this rank's shard of its chunk (only for tokens of the shard)."""
        return self._within(tokens)[1]

    def own_tokens(self, index: int) -> np.ndarray:
        """Row indices of the real tokens of this rank's shard of chunk ``index`` (the shard's first rows)."""
        length = int(self.length[index])
        return self.chunks.tokens(index)[self.position * length : (self.position + 1) * length]

    def whole_chunk(self, index: int, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` of :meth:`own_tokens` summed over the group into the whole chunk's
        (``[chunk tokens, ...]``, every rank alike; one all-reduce, no gradient): the MoE router's
        assignments (:class:`~ds_tree.engine.dfs.WalkedRouterLoss`)."""
        start = self.position * int(self.length[index])
        whole = values.new_zeros(self.chunks.size(index), *values.shape[1:])
        whole[start : start + values.shape[0]] = values
        dist.all_reduce(whole, group=self.group)
        return whole

    def chunk_inputs(self, row: PackedRow, index: int, cache: PathCache) -> ShardInputs:
        tokens = self.chunks.tokens(index)
        n, length = tokens.size, int(self.length[index])
        padded = self.size * length
        depths = row.position_ids[tokens]
        depths = np.concatenate([depths, depths.max() + 1 + np.arange(padded - n, dtype=depths.dtype)])
        ids = np.concatenate([row.input_ids[tokens], np.full(padded - n, row.input_ids[tokens[0]])])
        kv_end = self.chunks.local_kv_end(row, index)
        if kv_end is not None:
            kv_end = np.concatenate([kv_end, np.arange(n + 1, padded + 1)])
        shards = ChunkShards(
            self.group,
            self.size,
            n,
            torch.as_tensor(depths)[None],
            None if kv_end is None else torch.as_tensor(kv_end)[None],
        )
        mine = slice(self.position * length, (self.position + 1) * length)
        return ShardInputs(ids[mine], depths[mine], cache, None, shards)


class WalkedShardRunner(WalkedRunner):
    """A tree its sequence-parallel group walks together (:class:`~ds_tree.packing.dfs_shards.DfsRowShard`):
    the walk with gradients, and the no-grad walk of the RL objective's old and reference policies
    (:meth:`WalkedRunner.logprobs`), each rank scoring the targets predicted from its shards (a shard's
    ``owned`` holds only those, so they are the ones :func:`~ds_tree.objectives.rl_rows.prepare_rl_rows`
    asks for). Every rank of the group makes the same forwards, so the all-to-alls pair up."""

    @staticmethod
    def chunks(row: DfsRowShard, run: RunContext) -> ShardedChunks:
        if run.dfs is None:
            raise ValueError("a walked (dfs) item needs the dfs settings")
        if run.dfs.chunk != row.chunk:
            raise ValueError(
                f"a walked shard was planned for chunks of {row.chunk} tokens, the walk uses {run.dfs.chunk}"
            )
        group = sequence_parallel_group()
        if dist.get_world_size(group) != row.size:
            raise ValueError(
                f"a walked shard of a group of {row.size} ranks, the sequence-parallel group has "
                f"{dist.get_world_size(group)}"
            )
        return ShardedChunks(row_chunks(row, row.chunk), row.size, row.position, group)


WALKED_SHARD = WalkedShardRunner()
"""The runner of ``walked_shard`` items (:data:`ds_tree.registries.RUNNERS`)."""
