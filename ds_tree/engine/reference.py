"""The reference policy of the KL term (``objective.kl_coef > 0``): frozen, whole or ZeRO-3 partitioned.

Built from ``objective.reference`` (default ``model.source`` at ``model.seed``, the initial policy):

- without ``model.zero_init`` a plain model, whole on every rank (no collective in its forward);
- with ``model.zero_init`` a second DeepSpeed engine: ZeRO stage 3 without an optimizer, its
  parameters partitioned over all ranks as they are created (the policy's DeepSpeed settings:
  dtype, bucket sizes), so an 8B reference costs ``16 GB / world size`` per rank in bf16 instead of
  16 GB; with ``objective.reference_offload`` the partition lives in CPU memory (``offload_param``).
  Its forward gathers parameters collectively, so every rank must make as many reference forwards,
  in the same order relative to the policy's: one per packed item (every rank runs as many), one
  per chunk of a walked tree (dfs), the reference's pass padded to the busiest rank's count after
  the old policy's pass (:func:`~ds_tree.objectives.rl_rows.prepare_rl_rows`).

Under sequence parallelism the reference scores the same shards as the policy, through the same
Ulysses attention (:func:`~ds_tree.models.ulysses.enable_sequence_parallel`).

With ``objective.reference_step`` the reference's weights are replaced by the policy's at the end of
that step (:func:`copy_policy`); checkpoints saved after it hold them in :data:`REFERENCE_FILE`
(:func:`reference_state`), which a resumed run loads back (:func:`load_reference_state`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist

from ds_tree.models.loading import load_model
from ds_tree.models.ulysses import enable_sequence_parallel


def reference_ds_config(ds_config: dict, offload: bool = False) -> dict:
    """The reference engine's DeepSpeed config: the policy's batch sizes, dtype and ZeRO-3 settings
    (stage 3 whatever the policy's), no optimizer, parameters offloaded to CPU memory if ``offload``."""
    zero = {
        key: value
        for key, value in ds_config.get("zero_optimization", {}).items()
        if key not in ("offload_optimizer", "offload_param", "stage")
    }
    zero["stage"] = 3
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": ds_config["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": ds_config["gradient_accumulation_steps"],
        "train_batch_size": ds_config["train_batch_size"],
        "bf16": {"enabled": bool(ds_config.get("bf16", {}).get("enabled", False))},
        "zero_optimization": zero,
        "steps_per_print": ds_config.get("steps_per_print", 10**9),
        "wall_clock_breakdown": False,
    }


def build_reference(config, ds_config: dict, dtype: torch.dtype, device, policy_hf_config=None, *, source: str = ""):
    """The reference policy (module docstring): a model, or a DeepSpeed engine under ``model.zero_init``.

    ``policy_hf_config``: the policy's ``HfDeepSpeedConfig`` (``model.zero_init``), made current again
    once the reference is built (transformers keeps one process-wide). ``source``: another frozen model
    built the same way (on-policy distillation's teacher; "": ``objective.reference`` or ``model.source``).
    """
    source = source or config.objective.reference or config.model.source
    size = config.parallel.sequence_parallel_size
    if not config.model.zero_init:
        reference = load_model(
            source,
            attention=config.model.attention,
            dtype=dtype,
            seed=config.model.seed,
            recurrent_kernels=config.model.recurrent_kernels,
        )
        reference.to(device).eval().requires_grad_(False)
        if size > 1:  # it scores the same shards as the policy
            enable_sequence_parallel(reference, size)
        return reference

    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import set_hf_deepspeed_config

    engine_config = reference_ds_config(ds_config, config.objective.reference_offload)
    holder = HfDeepSpeedConfig(engine_config)  # transformers builds the model inside zero.Init with it
    try:
        model = load_model(
            source,
            attention=config.model.attention,
            dtype=dtype,
            seed=config.model.seed,
            recurrent_kernels=config.model.recurrent_kernels,
        )
    finally:
        if policy_hf_config is not None:
            set_hf_deepspeed_config(policy_hf_config)
    del holder
    model.requires_grad_(False)
    if size > 1:
        enable_sequence_parallel(model, size)
    engine, _, _, _ = deepspeed.initialize(model=model, config=engine_config)
    engine.eval()
    return engine


REFERENCE_FILE = "reference_policy.pt"
"""The reference's weights in a checkpoint saved after ``objective.reference_step`` (whole tensors)."""


def reference_module(reference) -> torch.nn.Module:
    """The reference's model: the module of its DeepSpeed engine (``model.zero_init``), else itself."""
    return getattr(reference, "module", reference)


def _partitioned(parameter: torch.nn.Parameter) -> bool:
    return hasattr(parameter, "ds_id")


@contextmanager
def _gathered(parameters: list[torch.nn.Parameter], modified: bool = False) -> Iterator[None]:
    """The ZeRO-3 partitioned ones among ``parameters`` whole on every rank (a collective); with
    ``modified``, what rank 0 holds at the end is partitioned back (every rank writes the same)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    partitioned = [p for p in parameters if _partitioned(p)]
    with GatheredParameters(partitioned, modifier_rank=0 if modified else None, enabled=bool(partitioned)):
        yield


def _pairs(reference, named: dict[str, torch.Tensor], what: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The reference's parameters by name, checked to be the same set, shapes included, as ``named``."""
    target = dict(reference_module(reference).named_parameters())
    if sorted(target) != sorted(named):
        missing = sorted(set(named) ^ set(target))[:3]
        raise RuntimeError(f"the reference policy and {what} do not have the same parameters ({missing} differ)")
    for name, parameter in target.items():
        shape = tuple(getattr(parameter, "ds_shape", parameter.shape))
        other = named[name]
        if shape != tuple(getattr(other, "ds_shape", other.shape)):
            raise RuntimeError(f"{name}: the reference policy's shape {shape} is not that of {what}")
    return list(target.items())


@torch.no_grad()
def copy_policy(reference, policy: torch.nn.Module) -> None:
    """The policy's current weights into the reference (``objective.reference_step``). A collective
    under ZeRO-3 (each parameter gathered in turn: one at a time whole in memory): every rank calls it."""
    source = dict(policy.named_parameters())
    for name, target in _pairs(reference, source, "the policy"):
        with ExitStack() as stack:
            stack.enter_context(_gathered([source[name]]))
            stack.enter_context(_gathered([target], modified=True))
            target.copy_(source[name])


@torch.no_grad()
def reference_state(reference) -> dict[str, torch.Tensor]:
    """The reference's weights, whole, on the CPU: on rank 0 (every rank calls it: a collective under
    ZeRO-3); an empty dict on the other ranks."""
    state = {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, parameter in reference_module(reference).named_parameters():
        with _gathered([parameter]):
            if rank == 0:
                state[name] = parameter.detach().to("cpu", copy=True)
    return state


@torch.no_grad()
def load_reference_state(reference, state: dict[str, torch.Tensor]) -> None:
    """:func:`reference_state`'s weights back into the reference (every rank, the same ``state``)."""
    for name, target in _pairs(reference, state, "the saved reference"):
        with _gathered([target], modified=True):
            target.copy_(state[name])
