"""A run's checkpoint as a model's weights, without DeepSpeed's engine (``ds-tree eval --checkpoint``).

The checkpoint's files are checked against its record first (size, sha256, nothing unlisted: the trust rule
of a resume, docs/LAUNCH.md), and every ``torch.load`` runs with ``weights_only=True``
(:func:`~ds_tree.run.checkpoint.weights_only_loads`). ZeRO-3 shards are consolidated into the fp32 weights by
DeepSpeed's ``zero_to_fp32``; a checkpoint of stage 0-2 holds the whole module. A LoRA run's checkpoint
holds its adapters: they are loaded into the adapted model and merged into its weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ds_tree.config import Config
from ds_tree.run import checkpoint
from ds_tree.run.checkpoint import CheckpointError


def checkpoint_location(path: Path) -> tuple[Path, str]:
    """``(checkpoints folder, tag)`` of ``path``: a checkpoint directory, or a checkpoints folder (its latest)."""
    if (path / checkpoint.LATEST).is_file():
        tag = checkpoint.read_latest(path)
        if tag is None:
            raise CheckpointError(f"{path}: no checkpoint named in {path / checkpoint.LATEST}")
        return path, tag
    return path.parent, path.name


def verified_record(directory: Path, tag: str) -> dict:
    """The record of checkpoint ``tag``, every file of it checked against the record."""
    record = checkpoint.read_record(directory, tag)
    if record is None:
        why = checkpoint.why_incomplete(directory, tag)
        raise CheckpointError(f"{directory / tag}: not a complete checkpoint ({why})")
    path = directory / tag
    problems = checkpoint.verify_files(path, record, sorted(record["files"])) + checkpoint.unlisted_files(path, record)
    if problems:
        raise CheckpointError(f"refusing to load {path}: {'; '.join(problems)}")
    return record


def consolidated_state(directory: Path, tag: str) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights, whole: ZeRO stages 0-2 keep them in ``mp_rank_00_model_states.pt`` (the
    module the run forwarded), stage 3 partitions them, consolidated in float32 by DeepSpeed's ``zero_to_fp32``."""
    states = directory / tag / "mp_rank_00_model_states.pt"
    if states.is_file():
        return dict(checkpoint.trusted_load(states, map_location="cpu")["module"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with checkpoint.weights_only_loads():
        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)


def load_checkpoint_weights(model: torch.nn.Module, path: Path, config: Config) -> tuple[torch.nn.Module, int]:
    """``model`` (``model.source`` as built for the run) holding checkpoint ``path``'s weights (LoRA: its adapters,
    merged), and the checkpoint's step. A checkpoint of another architecture is a :class:`CheckpointError`."""
    directory, tag = checkpoint_location(path)
    record = verified_record(directory, tag)
    state = consolidated_state(directory, tag)
    lora = config.model.lora
    if lora.enabled:
        from ds_tree.models.lora import apply_lora

        model = apply_lora(model, lora)
    load_weights(model, state, directory / tag, adapters_only=lora.enabled)
    if lora.enabled:
        model = model.merge_and_unload()
    return model, int(record["step"])


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], where: Path, adapters_only: bool) -> None:
    """``state`` into ``model``: every entry a parameter of it, and every parameter set but tied ones (and, with
    ``adapters_only``, the frozen base's)."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a shape that differs
        raise CheckpointError(f"{where}: its weights do not fit model.source ({str(error).splitlines()[0]})") from None
    loaded = {parameter.data_ptr() for name, parameter in model.named_parameters() if name in state}
    frozen = {name for name, parameter in model.named_parameters() if not parameter.requires_grad}
    named = dict(model.named_parameters())
    unset = [
        name
        for name in missing
        if name in named and named[name].data_ptr() not in loaded and not (adapters_only and name in frozen)
    ]
    if unexpected or unset:
        raise CheckpointError(
            f"{where}: its weights do not fit model.source (not in the model: {unexpected[:3]}; not in the "
            f"checkpoint: {unset[:3]})"
        )
