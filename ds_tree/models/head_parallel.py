"""Head-parallel recurrent mixers under Ulysses sequence parallelism (docs/MODELS.md, "Hybrid models").

A sequence-parallel rank holds one contiguous shard of a row (:class:`~ds_tree.packing.sequence_parallel.RowShard`)
or of a dfs chunk (:mod:`ds_tree.engine.dfs_sequence_parallel`).
A recurrent layer's state at a shard's first token is the previous shard's final state, but the heads of
a Gated DeltaNet or Mamba2 layer are independent of each other and its causal convolution is per
channel. So, as Ulysses does for attention, an all-to-all turns the shard's projected, per-channel
inputs into **the whole row for this rank's heads** (and the conv channels they read), the unchanged
tree scan (:mod:`ds_tree.models.hybrid`) runs over every node of the row for those heads, and a second
all-to-all returns the scan's output to shards, where the gated norm and ``out_proj`` (which mix heads)
run on the shard::

    rank r (shard r of the row, every channel)    in_proj on the shard (each rank projects its own tokens)
      -> to_heads:  [n, C] -> [S n, c]            the row's tokens, the channels of heads block r
      -> conv along root paths, tree scan         (the conv weight sliced to those channels)
      -> to_shards: [S n, h_r d] -> [n, H d]      shard r, every head
      -> gated norm, out_proj on the shard

Exactness: the projections, the conv, the scan and the norm compute the same numbers per token and
head as on one rank; the all-to-alls only move them. Their backward moves the gradients back, summing
over the ranks where a channel went to several (Mamba2's B and C when its groups are fewer than the
ranks, each rank reading the group of its heads), so the sum over the group of each rank's backward is
the row's gradient, as for attention (:mod:`ds_tree.models.ulysses`). Parameters are used whole
(projections, norm) or sliced to this rank's heads (conv weight, ``A_log``, ``dt_bias``, ``D``): their
gradients, summed over the ranks as ZeRO does, are the whole row's.

Heads must split evenly: value heads (GDN) / heads (Mamba2) a multiple of S; key heads (GDN) / groups
(Mamba2) a multiple of S or a divisor of it (each rank then reads the one key head or group of its
heads): :func:`check_recurrent_heads` at config time, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from ds_tree.errors import ConfigError
from ds_tree.models.families import family_of


def check_recurrent_heads(text_config, size: int, source: str) -> None:
    """Refuse a hybrid whose recurrent heads do not split over ``size`` ranks (a ``ConfigError`` naming the
    field: its family's ``recurrent.head_fields``)."""
    recurrent = family_of(text_config).recurrent
    if size == 1 or recurrent is None:
        return
    heads_field, shared_field = recurrent.head_fields
    heads, shared = getattr(text_config, heads_field), getattr(text_config, shared_field)
    if heads % size:
        raise ConfigError(
            f"parallel.sequence_parallel_size={size}: model.source {source} has {heads_field}={heads} recurrent "
            f"heads, not a multiple of {size} (each rank scans the whole row for heads / {size} of them)"
        )
    if shared % size and size % shared:
        raise ConfigError(
            f"parallel.sequence_parallel_size={size}: model.source {source} has {shared_field}={shared}, which "
            f"neither divides {size} nor is a multiple of it (a rank's heads must read whole key heads / groups)"
        )


def shared_block(shared: int, heads: int, size: int, position: int) -> range:
    """The key heads (GDN) / groups (Mamba2) that rank ``position``'s heads read: a block of ``shared / size``,
    or the one that its ``heads / size`` heads all belong to when ``shared`` divides ``size``."""
    if shared % size == 0:
        width = shared // size
        return range(position * width, (position + 1) * width)
    first = position * (heads // size) // (heads // shared)
    return range(first, first + 1)


def head_block(heads: int, size: int, position: int) -> range:
    width = heads // size
    return range(position * width, (position + 1) * width)


def channels_of(blocks: list[tuple[int, int, range]]) -> list[int]:
    """Channel indices of ``(offset, width per head, heads)`` blocks, in order."""
    return [offset + head * width + i for offset, width, heads in blocks for head in heads for i in range(width)]


def exchange(tensor: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all over dimension 0 (one slice per rank of ``group``)."""
    tensor = tensor.contiguous()  # (an output ``empty_like`` a strided view would keep its strides, and be misread)
    return all_to_all_single(torch.empty_like(tensor), tensor, group=group)


def sequence_parallel_group():
    """The sequence-parallel process group DeepSpeed's Ulysses registration made
    (:func:`~ds_tree.models.ulysses.enable_sequence_parallel`)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group()


@dataclass(frozen=True)
class HeadShards:
    """A row sharded over a sequence-parallel group, as a recurrent mixer exchanges it (module docstring)."""

    group: object
    size: int
    position: int

    @classmethod
    def of_shard(cls, shard_tokens: int, row_tokens: int) -> HeadShards:
        """The group of a mixer that got ``shard_tokens`` of a row of ``row_tokens`` (its ``kv_end``)."""
        group = sequence_parallel_group()
        size = dist.get_world_size(group)
        if shard_tokens * size != row_tokens:
            raise ValueError(
                f"a recurrent layer got {shard_tokens} tokens of a row of {row_tokens} (kv_end): a sequence-parallel "
                f"shard of a group of {size} ranks holds {row_tokens // size}"
            )
        return cls(group, size, dist.get_rank(group))

    @classmethod
    def of_group(cls, group) -> HeadShards:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def to_heads(self, tensor: torch.Tensor, channels: list[list[int]]) -> torch.Tensor:
        """``[n, C]`` (this rank's shard, every channel) -> ``[S n, c]`` (the row, ``channels[position]``);
        ``channels[q]``: the ``c`` channels rank ``q`` scans."""
        index = torch.as_tensor(channels, device=tensor.device)  # [S, c]
        send = tensor[:, index].transpose(0, 1)  # [S, n, c]: slice q goes to rank q
        received = exchange(send, self.group)  # [S, n, c]: slice q is rank q's shard
        return received.reshape(-1, received.shape[-1])

    def to_shards(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[S n, c]`` (the row, this rank's heads block of ``c`` channels) -> ``[n, S c]`` (its shard, every
        head, blocks in rank order)."""
        send = tensor.reshape(self.size, -1, tensor.shape[-1])  # slice q: shard q's tokens
        received = exchange(send, self.group)  # slice q: rank q's heads block of this shard
        return received.transpose(0, 1).reshape(received.shape[1], -1)


def sliced_conv_forward(self: torch.nn.Conv1d, inputs: torch.Tensor, channels: list[int] | None = None):
    """A depthwise ``Conv1d``'s forward on ``channels`` of its channels only (None: all, the stock forward).

    Installed per instance on the recurrent mixers' ``conv1d`` (:func:`~ds_tree.models.hybrid.install_tree_mixers`):
    called as the module, so ZeRO-3 gathers its weight for the call as for the stock forward."""
    if channels is None:
        return type(self).forward(self, inputs)
    if self.groups != self.in_channels:
        raise ValueError(f"a channel slice of a conv needs a depthwise conv, got groups={self.groups}")
    index = torch.as_tensor(channels, device=self.weight.device)
    bias = None if self.bias is None else self.bias[index]
    return F.conv1d(inputs, self.weight[index], bias, self.stride, self.padding, self.dilation, len(channels))
