"""The collectives of a step's host work: summaries gathered, scalars summed, units sent to the rank that needs them.

:class:`Collectives` wraps one process group (None: the default group) with what the per-rank planner
(:mod:`ds_tree.packing.step_units`) and the objectives' statistics need: ``all_gather`` of small objects,
``all_reduce`` of float64 arrays, and ``all_to_all`` of picklable objects (each rank sends each other rank
its own payload, point to point in one collective: ``all_to_all_single`` of the pickled bytes, which gloo and
NCCL both run). Tensors live where the group's backend wants them (NCCL: this rank's CUDA device; gloo:
the CPU). The planner one step ahead runs on a thread with a gloo group of its own
(:mod:`ds_tree.engine.plan_ahead`), so its collectives never interleave with the training step's.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class Collectives:
    """One process group's collectives for host work (module docstring); ``group`` None: the default group."""

    group: object | None = None
    received_bytes: int = 0
    """Payload bytes :meth:`all_to_all` brought to this rank since the counter was last reset."""

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def device(self) -> torch.device:
        """Where the group's tensors must be (NCCL: this rank's CUDA device)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_gather(self, value: object) -> list:
        """``value`` of every rank, in rank order (``all_gather_object``)."""
        gathered: list[object | None] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def all_reduce(self, values: Sequence[float] | np.ndarray, op: str = "sum") -> np.ndarray:
        """``values`` (float64) reduced over the ranks by ``op`` (``sum``, ``max`` or ``min``)."""
        tensor = torch.tensor(np.asarray(values, dtype=np.float64), device=self.device())
        dist.all_reduce(tensor, op=OPS[op], group=self.group)
        return tensor.cpu().numpy()

    def all_to_all(self, outgoing: Sequence[object]) -> list:
        """``outgoing[r]`` goes to rank ``r``; returns what each rank sent this one (its own entry unpickled
        as sent). One ``all_to_all_single`` of the sizes, one of the pickled bytes."""
        world, me = self.world_size, self.rank
        payloads = [b"" if r == me else pickle.dumps(value, protocol=5) for r, value in enumerate(outgoing)]
        device = self.device()
        send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=device)
        receive_sizes = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_to_all_single(receive_sizes, send_sizes, group=self.group)
        sizes_in, sizes_out = receive_sizes.tolist(), send_sizes.tolist()
        sent = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8) if sum(sizes_out) else None
        send = (sent if sent is not None else torch.empty(0, dtype=torch.uint8)).to(device)
        receive = torch.empty(sum(sizes_in), dtype=torch.uint8, device=device)
        dist.all_to_all_single(receive, send, sizes_in, sizes_out, group=self.group)
        self.received_bytes += int(sum(sizes_in))
        data = receive.cpu().numpy().tobytes()
        starts = np.concatenate([[0], np.cumsum(sizes_in)]).tolist()
        return [outgoing[r] if r == me else pickle.loads(data[starts[r] : starts[r + 1]]) for r in range(world)]
