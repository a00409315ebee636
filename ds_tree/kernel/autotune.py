"""Launch configurations of the Triton tree kernels, searched per head dim and shape bucket on a GPU.

The search space is data (:data:`SEARCH_SPACE`): per head dim, tile shapes of the forward and of the
backward, warps and pipeline stages. :func:`tune` times forward + backward of every candidate on one
row (``triton.testing.do_bench``) and returns the winner with every timing; :func:`installed` puts
winners into ``kernels.TUNED`` for a block of code, where ``kernels.launch_config`` finds them by
``kernels.tuning_key`` (head dim, dtype, length bucket, tile schedule). A manual cache rather than
``triton.autotune``: the tile lists depend on the tile shapes, so they must be built on the host for
the configuration that will run, which ``triton.autotune`` (choosing inside the launch) cannot do.

GPU only. Under the Triton interpreter or on the CPU :func:`tune` refuses (timing the interpreter says
nothing about a GPU, and each candidate would cost minutes): nothing on the CPU path imports this
module, ``ds-tree gpu-check`` imports it only in its kernel section on CUDA. Not yet run on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ds_tree.kernel import kernels


def _config(forward: tuple[int, int], backward: tuple[int, int], num_warps: int, num_stages: int) -> dict:
    return {"forward": forward, "backward": backward, "num_warps": num_warps, "num_stages": num_stages}


SEARCH_SPACE: dict[int, list[dict]] = {
    # bf16/fp16 on Hopper. Forward tiles after the Triton fused-attention tutorial (128 x 64/128,
    # 4-8 warps, 2-4 stages); small tiles for rows of tiny nodes, where most of a large tile is
    # masked. The backward shares one shape between dQ and dK/dV (one classification, two lists).
    128: [
        _config((128, 64), (64, 64), 8, 2),  # the default (kernels.block_sizes)
        _config((128, 64), (64, 64), 8, 3),
        _config((128, 128), (64, 64), 8, 2),
        _config((128, 64), (64, 64), 4, 3),
        _config((64, 64), (64, 64), 4, 3),
        _config((64, 32), (32, 32), 4, 2),
    ],
    64: [
        _config((128, 64), (64, 64), 4, 2),  # the default
        _config((128, 64), (64, 64), 4, 3),
        _config((128, 128), (64, 64), 8, 3),
        _config((64, 64), (64, 64), 4, 3),
        _config((64, 32), (32, 32), 4, 2),
    ],
}
"""Candidates per (padded) head dim; other head dims run the default only."""


def candidates(head_dim: int) -> list[dict]:
    """The configurations :func:`tune` tries for ``head_dim`` (the default alone outside the space)."""
    return SEARCH_SPACE.get(head_dim) or [kernels.block_sizes(head_dim)]


def tune(
    kv_end: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    tile_schedule: str,
    warmup_ms: int = 10,
    rep_ms: int = 40,
) -> dict:
    """Time forward + backward of every candidate on the row ``kv_end [1, N]`` (CUDA, int32 or int64) with
    random ``[1, heads or kv_heads, N, head_dim]`` inputs; ``{"key", "winner", "timings"}``, each timing
    ``{"config", "ms"}`` or ``{"config", "error"}`` (a candidate that does not compile or fit)."""
    if kernels.INTERPRET or not kv_end.is_cuda:
        raise RuntimeError("autotune runs on a CUDA GPU only (not under TRITON_INTERPRET=1, not on the CPU)")
    from triton.testing import do_bench

    n = kv_end.shape[-1]
    kv_end = kv_end.to(torch.int32).contiguous()
    q, k, v = (torch.randn(1, h, n, head_dim, dtype=dtype, device=kv_end.device) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(1, n, heads, head_dim, dtype=dtype, device=kv_end.device)
    scale = head_dim**-0.5
    timings = []
    for config in candidates(head_dim):

        def step(config=config):
            out, lse = kernels.forward(q, k, v, kv_end, scale, tile_schedule=tile_schedule, config=config)
            kernels.backward(grad, q, k, v, out, lse, kv_end, scale, tile_schedule=tile_schedule, config=config)

        try:
            timings.append({"config": config, "ms": do_bench(step, warmup=warmup_ms, rep=rep_ms)})
        except Exception as error:  # noqa: BLE001 - out of shared memory or registers: the next candidate
            timings.append({"config": config, "error": f"{type(error).__name__}: {str(error)[:200]}"})
    timed = [entry for entry in timings if "ms" in entry]
    if not timed:
        raise RuntimeError(f"no candidate configuration ran: {timings}")
    return {
        "key": kernels.tuning_key(head_dim, dtype, n, tile_schedule),
        "winner": min(timed, key=lambda entry: entry["ms"])["config"],
        "timings": timings,
    }


@contextmanager
def installed(records: list[dict]) -> Iterator[None]:
    """Within the block the kernels launch with the winners of ``records`` (what :func:`tune` returned)
    in their shape buckets; ``kernels.TUNED`` is as before afterwards."""
    saved = dict(kernels.TUNED)
    kernels.TUNED.update({record["key"]: record["winner"] for record in records})
    try:
        yield
    finally:
        kernels.TUNED.clear()
        kernels.TUNED.update(saved)
