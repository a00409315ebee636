"""The KL term's reference policy through a run (``objective.kl_coef``, ``reference_step``; docs/RL.md).

Built once the policy's engine exists: the policy with its adapters switched off under ``model.lora`` (no
second model), else a frozen model, whole or ZeRO-3 partitioned (:func:`ds_tree.engine.reference.build_reference`).
With ``objective.reference_step`` it becomes a copy of the policy at the end of that step, and every
checkpoint saved from then on carries the copy (:data:`~ds_tree.engine.reference.REFERENCE_FILE`), which a
resumed run loads back.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.config import Config
from ds_tree.engine.build import model_dtype
from ds_tree.engine.reference import (
    REFERENCE_FILE,
    build_reference,
    copy_policy,
    load_reference_state,
    reference_state,
)
from ds_tree.models.lora import AdaptersDisabled
from ds_tree.run import checkpoint

logger = logging.getLogger(__name__)


def frozen_model(config: Config, policy, ds_config: dict, hf_deepspeed_config=None, *, source: str = ""):
    """A frozen model beside the policy (``policy``: its DeepSpeed engine), on every rank: without ``source``
    the reference policy, under ``model.lora`` the policy with its adapters off (no second model), else
    ``objective.reference`` (default ``model.source`` at ``model.seed``); with ``source`` that model (a
    distillation teacher). In the policy's dtype; whole, or partitioned under ``model.zero_init``
    (:func:`~ds_tree.engine.reference.build_reference`)."""
    if config.model.lora.enabled and not source:
        return AdaptersDisabled(policy)
    return build_reference(
        config, ds_config, dtype_of(policy, config), policy.device, hf_deepspeed_config, source=source
    )


def dtype_of(policy, config: Config) -> torch.dtype:
    """The policy's parameter dtype (``model.dtype``'s in a run; a check's own, float64, in the tests), which
    its frozen models take."""
    parameter = next(iter(getattr(policy, "module", policy).parameters()), None)
    return parameter.dtype if parameter is not None else model_dtype(config)


class KLReference:
    """The reference of one run (module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.model = None
        """The frozen reference (a model, a ZeRO-3 engine, or the policy's engine with its adapters off); None
        without a KL term."""

    def build(self, policy, ds_config: dict, hf_deepspeed_config=None) -> None:
        """The reference of a run with a KL term, on every rank (``policy``: the policy's DeepSpeed engine)."""
        if self.config.objective.kl_coef:
            self.model = frozen_model(self.config, policy, ds_config, hf_deepspeed_config)

    def copied(self, step: int) -> bool:
        """Whether the reference is the policy's copy after ``step`` steps (``objective.reference_step``)."""
        at = self.config.objective.reference_step
        return self.model is not None and bool(at) and step >= at

    def end_step(self, done: int, policy: torch.nn.Module) -> None:
        """After ``done`` steps: at ``objective.reference_step`` the policy's weights into the reference (every
        rank: a collective under ZeRO-3)."""
        if self.model is not None and done == self.config.objective.reference_step:
            copy_policy(self.model, policy)
            logger.info("step %d: the KL reference is now the policy of this step (objective.reference_step)", done)

    def check_resumable(self, path: Path, step: int) -> None:
        """Checkpoint ``path`` of ``step`` holds the copy a run past ``reference_step`` needs (found at the dry
        run, not after the model is built)."""
        at = self.config.objective.reference_step
        if at and step >= at and not (path / REFERENCE_FILE).is_file():
            raise checkpoint.CheckpointError(self._missing(path, step))

    def save(self, path: Path, step: int) -> None:
        """The copied reference's weights into checkpoint directory ``path`` of ``step``, when it is a copy
        (every rank: a collective)."""
        if not self.copied(step):
            return
        state = reference_state(self.model)  # whole on rank 0, empty elsewhere
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(state, path / REFERENCE_FILE)

    def load(self, path: Path, step: int) -> None:
        """The copy that checkpoint ``path`` of ``step`` holds back into the reference (every rank)."""
        file = path / REFERENCE_FILE
        if not file.is_file():
            raise checkpoint.CheckpointError(self._missing(path, step))
        # memory-mapped: the ranks of a node share the pages instead of each reading the whole file
        load_reference_state(self.model, checkpoint.trusted_load(file, map_location="cpu", mmap=True))

    def _missing(self, path: Path, step: int) -> str:
        at = self.config.objective.reference_step
        return (
            f"{path} holds no {REFERENCE_FILE}: objective.reference_step ({at}) makes the KL reference the "
            f"policy of step {at}, and this checkpoint of step {step} was saved without it (by a run "
            f"without reference_step?). Resume from a checkpoint before step {at}, or set "
            "objective.reference_step: 0"
        )
