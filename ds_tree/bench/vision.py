"""What ``ds-tree bench`` measures of a vision-language model's images (docs/BENCHMARKS.md).

Counted, not estimated:
- :func:`row_images`: the distinct images (and their patches) of a step's packed rows, one pass: an
  image of a tree once per row holding it, an image of a flat trajectory once per trajectory, as
  :meth:`~ds_tree.packing.rows.PackedRow.image_inputs` hands them to the tower.
- :class:`TowerCounter`: the tower's calls, and the images and patches it encoded, read off its
  ``grid_thw`` by a forward hook during the benched steps (every pass of an RL step; a row without
  images encodes one blank image of ``merge^2`` patches, counted too).

The patch-aware ideal prices a vision patch in language-model tokens by the dense FLOPs rule (the
``6 N`` of training FLOPs per element, N its matrix-multiply weights; :func:`patch_weight`): a patch
costs the weights of every matrix product it passes through in the tower (the patch embedding, every
block, and the mergers' weights shared among the ``merge^2`` patches of a merged token), a token the
weights of the decoder layers. Left out of both, as the token ideal leaves them out: attention scores
(per visible pair, which ``ideal_cost`` prices for the language model), the LM head (it scores
trained targets, not tokens), embedding lookups and norms. That is the price at scale, where matrix
products dominate; on a small model on the CPU they do not, so SFT reports also price with this
machine's times: a patch at the tower's own seconds per patch (:func:`tower_seconds_per_patch`, timed
alone on the first measured step's images), a token at the rest of both modes' forward-and-backward
time per packed token.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.models.vision import is_vision_language

MATMUL_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
"""Modules whose weights are multiply-adds per element they process (a patch embedding's convolution has
kernel = stride = one patch, so its weights are one output position's)."""
MERGER_NAME = "merger"
"""The tower's children whose name holds this run once per merged token (Qwen2.5-VL ``merger``,
Qwen3-VL ``merger`` and ``deepstack_merger_list``)."""


def tower_of(model):
    """The vision tower of a vision-language model (transformers' ``model.model.visual``), else None."""
    model = getattr(model, "module", model)  # a DeepSpeed engine wraps the Hugging Face model
    if not is_vision_language(model.config):
        return None
    return model.model.visual


def multiply_adds(module: torch.nn.Module) -> int:
    """Multiply-adds per element of ``module``'s matrix products: the weights of its linear and convolution layers."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, MATMUL_MODULES))


def patch_weight(model) -> float | None:
    """Language-model tokens one vision patch costs by the dense FLOPs rule (module docstring): the tower's
    multiply-adds per patch over the decoder layers' per token (None for a model without a tower)."""
    tower = tower_of(model)
    if tower is None:
        return None
    merge = tower.spatial_merge_size
    per_merged_token = sum(multiply_adds(child) for name, child in tower.named_children() if MERGER_NAME in name)
    per_patch = multiply_adds(tower) - per_merged_token + per_merged_token / (merge * merge)
    decoder = getattr(model, "module", model).model.language_model
    return per_patch / multiply_adds(decoder.layers)


def image_patches(grid_thw) -> int:
    """Patches of an image of grid ``(t, h, w)``, before merging: what the tower's blocks run on."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w


def row_images(rows) -> dict:
    """``images`` and ``patches`` the tower encodes for ``rows`` in one pass: each part's distinct images."""
    images = patches = 0
    for row in rows:
        for part in row.layout_parts:
            distinct = np.unique(part.image_id[part.image_id >= 0])
            images += distinct.size
            patches += sum(image_patches(part.tree.images[i].grid_thw) for i in distinct)
    return {"images": images, "patches": patches}


def tower_seconds_per_patch(model, images, synchronize, repeats: int = 3) -> float:
    """Seconds per patch of the tower's forward and backward on ``images`` (distinct
    :class:`~ds_tree.trees.images.TrajectoryImage` s, encoded in one call as a row's are): the median of
    ``repeats`` timed calls after one untimed. ``synchronize()`` waits for the device before each clock
    read. The parameters' gradients are dropped after."""
    tower = tower_of(model)
    parameter = next(tower.parameters())
    pixels = torch.cat([torch.as_tensor(image.pixel_values) for image in images]).to(parameter)
    grids = torch.as_tensor([image.grid_thw for image in images], device=parameter.device)
    seconds = []
    for _ in range(repeats + 1):
        synchronize()
        started = time.perf_counter()
        output = tower(pixels, grid_thw=grids, return_dict=True)
        deepstack = getattr(output, "deepstack_features", None) or []  # Qwen3-VL's, fed to the decoder too
        sum([output.pooler_output.sum(), *(level.sum() for level in deepstack)]).backward()
        synchronize()
        seconds.append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return statistics.median(seconds[1:]) / sum(image_patches(image.grid_thw) for image in images)


def distinct_images(trajectories) -> list:
    """The distinct images of ``trajectories`` (by identity), in order of first appearance."""
    return list({image.key: image for trajectory in trajectories for image in trajectory.images}.values())


@dataclass
class TowerCounter:
    """Calls of a vision tower and the images and patches they encoded, by a forward hook (:meth:`attach`)."""

    calls: int = 0
    images: int = 0
    patches: int = 0

    @classmethod
    def attach(cls, *models) -> TowerCounter | None:
        """One counter hooked on the towers of ``models`` (a policy and its reference; None entries skipped);
        None when none has a tower."""
        towers = [tower_of(model) for model in models if model is not None]
        towers = [tower for tower in towers if tower is not None]
        if not towers:
            return None
        counter = cls()
        for tower in towers:
            tower.register_forward_hook(counter._count, with_kwargs=True)
        return counter

    def _count(self, _module, _args, kwargs, _output) -> None:
        grids = kwargs["grid_thw"]
        self.calls += 1
        self.images += len(grids)
        self.patches += sum(image_patches(grid) for grid in grids.tolist())

    def take(self) -> dict:
        """The counts since the last ``take`` (then zero)."""
        counts = {"tower_calls": self.calls, "tower_images": self.images, "tower_patches": self.patches}
        self.calls = self.images = self.patches = 0
        return counts
