"""Announce DeepSpeed's one-time C++ op builds, which are otherwise silent for half a minute.

On the CPU, ``deepspeed.init_distributed`` JIT-compiles the shared-memory all-reduce op
(``deepspeed_shm_comm``, ~35 s on 2 cores), and a config that offloads the optimizer to the CPU
compiles ``cpu_adam`` when the engine is built. Each is cached under ``TORCH_EXTENSIONS_DIR``
(``launch/train.sh`` points it at ``<repo>/.cache/torch_extensions``) and reused by later runs;
:func:`announce_op_builds` says which will be built before the wait starts.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

BUILDERS = {"ShareMemCommBuilder": "the shared-memory comm op", "CPUAdamBuilder": "CPU Adam (optimizer offload)"}


def _offloads_optimizer(ds_config: dict) -> bool:
    zero = ds_config.get("zero_optimization") or {}
    return (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")


def _extension_root() -> Path:
    """Where torch's JIT loader keeps built extensions (``torch.utils.cpp_extension``'s rule)."""
    import torch
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{python}_{accelerator}"


def pending_op_builds(ds_config: dict) -> list[tuple[str, Path]]:
    """(op name, cache folder) of each op this run will JIT-compile because no build is cached."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    wanted = ["ShareMemCommBuilder"] if get_accelerator().device_name() == "cpu" else []
    if _offloads_optimizer(ds_config):
        wanted.append("CPUAdamBuilder")
    pending = []
    for class_name in wanted:
        builder = get_accelerator().create_op_builder(class_name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue  # DeepSpeed will not use it here
        if installed_ops.get(builder.name, False):
            continue  # prebuilt at install time
        folder = _extension_root() / builder.name
        if not (folder / f"{builder.name}.so").is_file():
            pending.append((builder.name, folder))
    return pending


def announce_op_builds(ds_config: dict) -> None:
    """Log one line per DeepSpeed op about to be compiled (rank 0's console); never fails the run."""
    try:
        pending = pending_op_builds(ds_config)
    except Exception as error:  # noqa: BLE001 - an announcement only
        logger.debug("could not tell which DeepSpeed ops will be built: %s", error)
        return
    for name, folder in pending:
        logger.info("building DeepSpeed's %s op once (about 30-60 s, cached in %s for later runs)", name, folder)
