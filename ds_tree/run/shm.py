"""Unlink DeepSpeed's CPU all-reduce buffers once every rank has mapped them.

On the CPU, ``deepspeed.init_distributed`` creates one shared-memory file per rank,
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (69 MB each in 0.19.8), and
maps every other rank's file before it returns; nothing ever unlinks them, so each run with a new
port leaves its files behind until /dev/shm fills up. Once all ranks are past initialisation
(a barrier), each rank unlinks its own name: the mappings stay valid until the processes exit,
and the memory is freed then, even when a run is killed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

SHM_DIRECTORY = Path("/dev/shm")


def buffer_path(rank: int) -> Path:
    """This rank's buffer file, named as DeepSpeed's shm.cpp names it."""
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT", "29500")
    return SHM_DIRECTORY / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank}"


def release_allreduce_buffers() -> bool:
    """Unlink this rank's buffer after every rank has opened all of them; True if one was removed."""
    dist.barrier()
    try:
        buffer_path(dist.get_rank()).unlink()
    except FileNotFoundError:  # not a CPU run, or DeepSpeed built without the shm op
        return False
    return True
