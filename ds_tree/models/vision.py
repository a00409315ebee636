"""Vision-language models on trees: Qwen2.5-VL and Qwen3-VL.

Only the language model gets the tree attention. The vision tower keeps its own attention
(bidirectional inside each image, transformers' ``sdpa``) and encodes **each distinct image of a row
once**, in one call per forward: a packed row lists its distinct images (a shared screenshot once,
however many trajectories of its tree pass through it) and, per placeholder token, which image and
patch it is (:meth:`~ds_tree.packing.rows.PackedRow.image_inputs`). The model's forward (replaced
per instance by :func:`install_vision`) encodes those images (``cu_seqlens`` keeps each image's
attention to itself), gathers the merged-patch features at the row's placeholders and hands them to
the model as its ``mm_encoder_outputs`` (transformers' own entry for precomputed vision features,
which it scatters into the input embeddings; Qwen3-VL's deepstack features go the same way). The
gather sums every copy's gradient into the one encoding, so each image's gradient reaches the tower
once, the sum over all trajectories through it. The flat baseline encodes an image once per
trajectory (each trajectory is its own tree).

Positions: the row passes ``position_ids`` as ``[4, 1, N]``: the depth (the text position the tree
attention and the mask builders read) and the three multimodal rotary sections laid out on the
tree (:func:`attach_rope_positions` computes each trajectory's with the model's own
``get_rope_index``, from the config alone; the trie checks that shared tokens agree).

float64: transformers computes the vision tower's rotary embedding in float32
(``apply_rotary_pos_emb_vision`` casts ``q``/``k`` with ``.float()``); in a float64 model the
gradient of an image encoded once (tree) and the sum of the gradients of its copies (flat) would
then differ at float32 round-off. :func:`install_vision` makes that function compute in
``promote_types(dtype, float32)``: unchanged for float32/bf16, float64 for float64.

The dfs walk (``ds_tree.engine.dfs``) encodes each distinct image of a walked row once: the chunk that
owns it (the lowest common ancestor of the chunks holding its placeholders,
:mod:`ds_tree.packing.dfs_images`) encodes it in its forward and the walk caches the features, as leaves
that require grad, with the chunk's keys and values; the chunks below read them (:class:`WalkedImages`,
:func:`encode_walked_images`) and their backwards accumulate the features' gradient, which the owner's
backward sends through the tower once, with its own tokens' (its surrogate adds ``<features, grad>``, as
for the keys and values). An image cut by a chunk boundary, shown again deeper in a path or in two sibling
branches is encoded once per walk (with ``recompute``, twice where its owner has chunks below: a no-grad
forward, then the one with grad), and its gradient reaches the tower once. Every chunk of a row with images
gets its rotary positions (text after an image too). Every forward still calls the tower once, on the blank
patch when the chunk owns no image, so ZeRO-3's lockstep calls pair up. The text config alone switches to
the walk's cached attention.

Online rollouts: multi-turn environments return image observations (:mod:`ds_tree.rollout.images`),
sampled on the HF engine, whose tree sampler feeds the prompt's images and rotary positions
(``ds_tree.sampling.hf.sample_tree``: ``images``); the sampler's own forward passes ``pixel_values``
(the stock path, below).

Sequence-parallel rows (Ulysses, :class:`~ds_tree.packing.sequence_parallel.RowShard`): each rank of the
group encodes the images with placeholders in its shard (an image cut by the shard boundary on both ranks),
gathers its placeholders' features and backpropagates their gradient into the tower; the tower's parameters
take the same path as the language model's (summed over the group by the trainer's reduction), so the sum
is the row's gradient. The shard's ``[4, 1, n]`` positions are the row's cut like its tokens; a tree row
without images gets its depths as all four rows, so that the language model hands them to the attention
(the Ulysses wrapper gathers them).

Refused (:func:`check_vision_settings`, naming the field): the dfs walk sharded over a sequence-parallel
group (its chunks' shards carry neither images nor rotary positions), sampling on vLLM, single-turn online
RL (its prompts are text); and at load
(:func:`check_vision_model_type`) models whose image tokens attend to each other bidirectionally
inside the language model (Gemma 3): the tree mask is causal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ds_tree.errors import ConfigError
from ds_tree.models.families import families_with, family_of
from ds_tree.registries import missing_capability

VISION_ATTENTION = "sdpa"
"""The vision tower's attention: transformers' own, per image (float64 on the CPU's math kernel)."""


def is_vision_language(config) -> bool:
    """Whether ``config``'s family is a vision-language model that runs on trees (its spec's ``vision``)."""
    return family_of(config).vision is not None


def vision_model_types() -> str:
    """The registered vision-language families' model types, for messages."""
    return ", ".join(spec.model_type for spec in families_with(lambda spec: spec.vision is not None))


def check_vision_model_type(config) -> None:
    """Refuse a vision-language model whose language model attends bidirectionally among image tokens (its
    family's ``bidirectional_images``)."""
    if family_of(config).bidirectional_images:
        raise ValueError(
            f"{type(config).__name__} ({config.model_type}): its image tokens attend to each other bidirectionally "
            "inside the language model; the tree mask is causal (k <= q), so tree training would change the "
            f"model. Supported vision-language models: {vision_model_types()}"
        )


def attention_implementations(text_implementation: str) -> dict[str, str]:
    """``attn_implementation`` per sub-config: the tree engine for the language model, the tower's own."""
    return {"": text_implementation, "text_config": text_implementation, "vision_config": VISION_ATTENTION}


def check_vision_settings(config, model_config) -> None:
    """What the trainer does not run with a vision-language model yet, refused before anything is built
    (a ``ConfigError`` naming the field)."""
    if not is_vision_language(model_config):
        return
    what = f"{model_config.model_type} is a vision-language model"
    packing = config.packing
    if config.parallel.sequence_parallel_size > 1 and "dfs" in (packing.mode, packing.over_budget):
        raise ConfigError(
            f"parallel.sequence_parallel_size with packing.mode / over_budget: dfs: {what}; the walk sharded over "
            "the group passes each chunk's shard its depths only, neither its images nor its multimodal rotary "
            "positions (the per-walk image cache, ds_tree/packing/dfs_images.py, serves unsharded chunks): walk on "
            "one rank (sequence_parallel_size: 1) or shard rows (over_budget: sequence_parallel)"
        )
    rollout = config.rollout
    missing = missing_capability(rollout.engine, "images") if rollout.enabled else None
    if missing:
        raise ConfigError(f"rollout.engine: {rollout.engine}: {what}; {missing}")
    if rollout.enabled and not rollout.env.path:
        raise ConfigError(
            f"rollout.env.path: {what}; single-turn online RL samples text prompts only: image observations come from "
            'a multi-turn environment (docs/ENVIRONMENTS.md, "Image observations")'
        )


# --------------------------------------------------------------------------- rotary positions
def _backbone_class(config):
    """The family's ``...VLModel`` class (it holds ``get_rope_index``), from transformers' model mapping."""
    from transformers import MODEL_MAPPING

    return MODEL_MAPPING[type(config)]


def rope_positions(config, input_ids: np.ndarray, image_index: np.ndarray | None, grids) -> np.ndarray:
    """``[3, length]`` rotary positions of one trajectory by the model's own ``get_rope_index``.

    Called unbound on a stand-in that holds the config (the rule reads ``self.config`` and
    ``self.get_vision_position_ids`` only), so the data can be prepared before any model is built."""
    if image_index is None or not len(grids):
        return np.broadcast_to(np.arange(input_ids.size), (3, input_ids.size)).copy()
    backbone = _backbone_class(config)
    stand_in = SimpleNamespace(config=config)
    stand_in.get_vision_position_ids = functools.partial(backbone.get_vision_position_ids, stand_in)
    positions, _ = backbone.get_rope_index(
        stand_in,
        torch.as_tensor(input_ids)[None],
        mm_token_type_ids=torch.as_tensor((image_index >= 0).astype(np.int32))[None],
        image_grid_thw=torch.as_tensor(np.asarray(grids, dtype=np.int64)),
    )
    return positions[:, 0].numpy().astype(np.int64)


def image_input_shape(config) -> tuple[int, int]:
    """What the vision tower of the model whose ``config`` is given takes: values per patch (channels x
    temporal patch x patch x patch, the columns of ``pixel_values``) and the merge size."""
    vision = config.vision_config
    return vision.in_channels * vision.temporal_patch_size * vision.patch_size**2, vision.spatial_merge_size


def check_image_inputs(config, patch_values: int, merge_size: int, what: str) -> None:
    """A ValueError when images of ``patch_values`` values per patch and ``merge_size`` (``what`` says whose)
    are not what the vision tower of ``config`` takes: images processed for another vision family (Qwen2.5-VL's
    14-pixel patches, 1176 values, against Qwen3-VL's 16-pixel ones, 1536) would fail deep in the tower or
    the sampler; the error names the family to process them with."""
    values, merge = image_input_shape(config)
    if (patch_values, merge_size) != (values, merge):
        vision = config.vision_config
        raise ValueError(
            f"{what} has {patch_values} values per patch and merge size {merge_size}, but the model "
            f"({config.model_type}) takes {values} ({vision.in_channels} channels x temporal patch "
            f"{vision.temporal_patch_size} x patch {vision.patch_size}x{vision.patch_size}) and merge size {merge}: "
            f"it was processed for another vision family; process the images with the model's family "
            f"(a processor folder from ds-tree make-tokenizer --vision {config.model_type}, then convert again)"
        )


def attach_rope_positions(config, trajectories) -> None:
    """Set ``rope_positions`` of every trajectory with images (in place; text-only ones keep None) by the
    rule of the model whose ``config`` is given; a ValueError when there are images and it has no tower, or
    images processed for another vision family (:func:`check_image_inputs`)."""
    if any(t.images for t in trajectories) and not is_vision_language(config):
        raise ValueError(
            f"the data has images and the model ({config.model_type}) has no vision tower; use a vision-language "
            f"model ({vision_model_types()}: configs/models/tiny_qwen2_5_vl.json)"
        )
    checked = set()
    for trajectory in trajectories:
        for image in trajectory.images or ():
            shape = (image.pixel_values.shape[1], image.merge_size)
            if shape not in checked:
                check_image_inputs(config, *shape, f"{trajectory.where}: the data's image (grid {image.grid_thw})")
                checked.add(shape)
    for trajectory in trajectories:
        if trajectory.images and trajectory.rope_positions is None:
            grids = [image.grid_thw for image in trajectory.images]
            trajectory.rope_positions = rope_positions(config, trajectory.input_ids, trajectory.image_index, grids)


# --------------------------------------------------------------------------- the forward
def _rotary_vision_promoted(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb_vision`` in ``promote_types(dtype, float32)`` (module docstring)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import rotate_half

    wide = torch.promote_types(q.dtype, torch.float32)
    q_wide, k_wide = q.to(wide), k.to(wide)
    cos, sin = cos.unsqueeze(-2).to(wide), sin.unsqueeze(-2).to(wide)
    q_embed = (q_wide * cos) + (rotate_half(q_wide) * sin)
    k_embed = (k_wide * cos) + (rotate_half(k_wide) * sin)
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def _modeling_module(model):
    import importlib

    return importlib.import_module(type(model).__module__)


def install_vision(model) -> None:
    """Make ``model``'s forward accept ``row_images`` (:class:`~ds_tree.packing.rows.RowImages`) and its
    vision rotary embedding keep a float64 model's precision (module docstring). Idempotent."""
    if not is_vision_language(model.config):
        return
    module = _modeling_module(model)
    module.apply_rotary_pos_emb_vision = _rotary_vision_promoted  # same result for float32/bf16 (docstring)
    if getattr(model, "_ds_tree_vision", False):
        return
    original = model.forward

    def forward(*args, row_images=None, **kwargs):
        if kwargs.get("pixel_values") is not None:  # the sampler's prefill: the stock path (one process, no ZeRO)
            return original(*args, **kwargs)
        kwargs["mm_encoder_outputs"] = {"image": encode_images(model, row_images)}
        positions = kwargs.get("position_ids")
        if kwargs.get("kv_end") is not None and positions is not None and positions.ndim == 2:
            # a tree row without images: its depths as all four rows, so that the language model hands them to
            # the attention as text positions (the Ulysses wrapper gathers them) as it does for a row with images
            kwargs["position_ids"] = positions[None].expand(4, -1, -1)
        return original(*args, **kwargs)

    model.forward = forward
    model._ds_tree_vision = True


def _language_backbone(model):
    return getattr(model, "module", model).model  # the DeepSpeed engine wraps the Hugging Face model


def encode_images(model, images):
    """The features of a forward's placeholders: a packed row's (:class:`~ds_tree.packing.rows.RowImages`, or
    None) by :func:`encode_row_images`, a dfs chunk's (:class:`WalkedImages`) by :func:`encode_walked_images`."""
    if isinstance(images, WalkedImages):
        return encode_walked_images(model, images)
    return encode_row_images(model, images)


def encode_row_images(model, row_images):
    """The tower called once on the row's distinct images (``cu_seqlens`` keeps each image's attention
    to itself), its merged features gathered at the row's placeholders.

    A row without images (``None``) encodes one blank image of one merged patch and passes no features,
    its output joined to them times 0: every forward calls the tower once, forward and backward, so
    ZeRO-3's parameter gathers (collectives) pair up across ranks whatever images each rank's rows hold.
    """
    if row_images is None:
        blank = _run_tower(model, [], [])
        return _encoder_outputs(_blank_joined(blank, blank.gather(_index_on(model, []))))
    encoded = _run_tower(model, row_images.pixel_values, row_images.grids)
    return _encoder_outputs(encoded.gather(_index_on(model, row_images.feature_index)))


@dataclass
class ImageFeatures:
    """Merged-patch features of some images, one row per merged patch, and Qwen3-VL's deepstack levels
    (the same rows, one tensor per level; none for Qwen2.5-VL)."""

    merged: torch.Tensor
    deepstack: list[torch.Tensor]

    @classmethod
    def concatenate(cls, parts: list[ImageFeatures]) -> ImageFeatures:
        levels = range(len(parts[0].deepstack))
        return cls(torch.cat([p.merged for p in parts]), [torch.cat([p.deepstack[i] for p in parts]) for i in levels])

    def tensors(self) -> list[torch.Tensor]:
        return [self.merged, *self.deepstack]

    def gather(self, index: torch.Tensor) -> ImageFeatures:
        """The rows at ``index`` (a row gathered several times sums its copies' gradients)."""
        return ImageFeatures(self.merged[index], [level[index] for level in self.deepstack])

    def leaves(self) -> ImageFeatures:
        """Detached copies that require grad: what a dfs walk caches for its chunks below."""
        return ImageFeatures(_leaf(self.merged), [_leaf(level) for level in self.deepstack])


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_()


@dataclass
class WalkedImages:
    """A dfs chunk's images (:mod:`ds_tree.engine.dfs`, :class:`~ds_tree.packing.dfs_images.WalkImages`): the
    ones it encodes itself, and the features of its ancestors' images, encoded once by them and cached
    with their keys and values, which it reads instead of encoding them again."""

    pixel_values: list[np.ndarray]
    """The images the chunk encodes (none: the tower runs on the blank patch, as for a row without images)."""
    grids: list[tuple[int, int, int]]
    cached: list[ImageFeatures]
    """The ancestors' cached features the chunk reads."""
    feature_index: np.ndarray
    """Per placeholder of the chunk, in order: its row in the concatenation of the chunk's own features and
    ``cached``'s."""
    encoded: ImageFeatures | None = None
    """Set by the forward: the features of the chunk's own images (with their graph; None: it encodes none)."""


def encode_walked_images(model, images: WalkedImages):
    """The tower called once on the chunk's own images (or the blank patch, joined times 0, so that every
    forward calls it once: ZeRO-3 pairing, :func:`encode_row_images`); the chunk's placeholders gathered
    from its own features and its ancestors' cached ones. The own features are kept in ``images.encoded``."""
    blank = not images.pixel_values
    encoded = _run_tower(model, images.pixel_values, images.grids)
    images.encoded = None if blank else encoded
    sources = (images.cached or [encoded]) if blank else [encoded, *images.cached]  # blank alone: no placeholders
    gathered = ImageFeatures.concatenate(sources).gather(_index_on(model, images.feature_index))
    return _encoder_outputs(_blank_joined(encoded, gathered) if blank else gathered)


def _run_tower(model, pixel_values: list, grids: list) -> ImageFeatures:
    """One call of the tower on ``pixel_values`` (none: one blank image of one merged patch)."""
    visual = _language_backbone(model).visual
    parameter = next(visual.parameters())
    if not pixel_values:
        merge = visual.spatial_merge_size
        grids = [(1, merge, merge)]
        pixels = torch.zeros(merge * merge, _patch_dim(visual), dtype=parameter.dtype)  # config: ZeRO-3 partitions
    else:
        pixels = torch.cat([torch.as_tensor(p).to(parameter.dtype) for p in pixel_values])
    output = visual(
        pixels.to(parameter.device), grid_thw=torch.as_tensor(grids, device=parameter.device), return_dict=True
    )
    return ImageFeatures(output.pooler_output, list(getattr(output, "deepstack_features", None) or []))


def _index_on(model, index) -> torch.Tensor:
    return torch.as_tensor(index, dtype=torch.long, device=next(_language_backbone(model).visual.parameters()).device)


def _blank_joined(blank: ImageFeatures, features: ImageFeatures) -> ImageFeatures:
    """``features`` with the blank encoding joined times 0: the tower stays in the graph, contributing nothing."""
    return ImageFeatures(
        features.merged + 0.0 * blank.merged.sum(),
        [level + 0.0 * whole.sum() for level, whole in zip(features.deepstack, blank.deepstack, strict=True)],
    )


def _encoder_outputs(features: ImageFeatures):
    """``mm_encoder_outputs["image"]`` for transformers: one features tensor (and deepstack levels)."""
    if not features.deepstack:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=[features.merged])
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    return BaseModelOutputWithDeepstackFeatures(
        pooler_output=[features.merged], deepstack_features=[[level] for level in features.deepstack]
    )


def _patch_dim(visual) -> int:
    """Values per patch (channels x temporal patch x patch x patch), from the config."""
    config = visual.config
    return config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size
