"""Activation memory: what autograd holds for backward (bench and the checks measure with these).

Two meters. :class:`SavedTensorMeter` counts everything a row saves, which is the row's peak
because its graph lives until its backward. The dfs walk (:mod:`ds_tree.engine.dfs`) frees each
chunk's graph at the chunk's backward, so its activation memory is the peak of what is alive,
measured here. Deterministic on the CPU, so bounds on it are testable.
"""

from __future__ import annotations

import torch


class SavedTensorMeter:
    """Bytes of distinct tensors autograd saves for backward: the activation memory of a step.

    Storages of ``exclude`` (e.g. the parameters, which linear layers save for their backward) are
    not counted."""

    def __init__(self, exclude=()) -> None:
        self.excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class PeakSavedMeter:
    """Largest total of distinct tensor storages saved for backward and alive at one time.

    Storages of ``exclude`` (e.g. the parameters, which linear layers save for their backward) are
    not counted.
    """

    def __init__(self, exclude=()) -> None:
        self.excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, saved references]
        self.current = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded:
            return tensor
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _HeldTensor(self, key, tensor)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _HeldTensor) else packed

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _HeldTensor:
    """A saved tensor; when autograd drops it (backward done, graph freed) the meter forgets it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: PeakSavedMeter, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key)
