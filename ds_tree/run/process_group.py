"""The run's process group: one per rank, started before any model is built, whatever the launcher."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_tree.run.op_builds import announce_op_builds
from ds_tree.run.shm import release_allreduce_buffers


def ensure_distributed_env() -> None:
    """A single process started without a launcher still gets a (1-rank) process group."""
    if "RANK" in os.environ:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise RuntimeError("WORLD_SIZE > 1 but RANK is not set: start ranks with deepspeed, torchrun or srun")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


CUDA_BACKENDS = "cpu:gloo,cuda:nccl"
"""On CUDA the process group has a backend per device type: NCCL for the GPU tensors (DeepSpeed's
gradients and parameters), gloo for the trainer's own CPU scalars (normalisers, losses, metric sums,
the preemption flag, the checkpoint handshake), which NCCL refuses ("No backend type associated with
device type cpu", seen on the first GPU run of the trainer)."""


def init_process_group(timeout: timedelta) -> None:
    """On CUDA, the rank's process group over :data:`CUDA_BACKENDS`, this rank's GPU its device
    (``deepspeed.init_distributed`` then takes the group as it is); elsewhere nothing: DeepSpeed's
    CPU accelerator makes its own (gloo, and its shared-memory all-reduce)."""
    import deepspeed

    if deepspeed.get_accelerator().device_name() != "cuda" or dist.is_initialized():
        return
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(CUDA_BACKENDS, timeout=timeout)


def start(ds_config: dict, timeout_s: float, world_size: int) -> int:
    """This rank's process group (``distributed.timeout_s`` on every collective); its rank. The DeepSpeed ops
    the group builds the first time are announced; a group of another size than ``world_size`` (the one the
    config was checked for) is an error."""
    import deepspeed

    ensure_distributed_env()
    announce_op_builds(ds_config)  # the first CPU run compiles DeepSpeed ops for ~35 s
    timeout = timedelta(seconds=timeout_s)
    init_process_group(timeout)
    deepspeed.init_distributed(timeout=timeout)  # takes the group made above, if any
    release_allreduce_buffers()
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"WORLD_SIZE={world_size} but the process group has {dist.get_world_size()}")
    return dist.get_rank()
