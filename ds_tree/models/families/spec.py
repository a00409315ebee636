"""The model-family spec: what ds_tree needs to know of a model family beyond transformers' own code.

One :class:`FamilySpec` per family, registered in :data:`ds_tree.registries.MODEL_FAMILIES` under its
config's ``model_type`` (docs/MODELS.md, "Adding a model family"). The code that loads, checks, plans and
samples a model asks the spec of its config (:func:`family_of`), never a ``model_type`` or a class name.
A model type that is not registered gets :data:`PLAIN`: attention through transformers' interface,
nothing else to do (and a model whose layers mix tokens outside it is refused as before,
:mod:`ds_tree.models.token_mixing`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ds_tree.registries import MODEL_FAMILIES
from ds_tree.vocab.vision_processor import VisionFamily

LOGIT_TRANSFORMS = {"logit_scale": (None, 1.0), "logits_scaling": (None, 1.0)}
"""Config fields that transform the logits after ``lm_head`` (Cohere's and Granite's scaling), with the
values that leave them unchanged: every family's default (a config of any family may carry them)."""


@dataclass(frozen=True)
class RecurrentSpec:
    """A hybrid family's recurrent layers, which run per tree node (:mod:`ds_tree.models.hybrid`)."""

    mixer: str
    """What the layers are, in messages: ``Gated DeltaNet`` or ``Mamba2``."""
    tree_forwards: Mapping[str, Callable]
    """Mixer class name -> its tree forward (installed per instance by ``hybrid.install_tree_mixers``)."""
    sizes: Callable[[object], dict]
    """The memory model's hook: a mixer module -> the fields of
    :class:`ds_tree.memory.predict.RecurrentMixer` (what its tree forward keeps for the backward)."""
    head_fields: tuple[str, str]
    """The text config's fields of the recurrent heads and of the key heads / groups they share, which a
    sequence-parallel group splits (:func:`ds_tree.models.head_parallel.check_recurrent_heads`)."""
    cache_layers: tuple[str, ...]
    """The generation-cache layer classes of the family, all of which the tree sampler forks
    (:mod:`ds_tree.sampling.state_cache`)."""


@dataclass(frozen=True)
class FamilySpec:
    """One model family (module docstring). Every field's default is what a plain attention model needs."""

    model_type: str
    """The HF config's ``model_type`` it is registered under."""
    recurrent: RecurrentSpec | None = None
    """A hybrid's recurrent layers (None: attention only)."""
    float64_norms: Mapping[str, Callable] = field(default_factory=dict)
    """Norm class name -> its forward without transformers' float32 cast, for float64 models (any other
    ``...RMSNorm`` with a ``variance_epsilon`` gets the plain one: ``ds_tree.models.float64``)."""
    float64_forwards: Mapping[str, Callable] = field(default_factory=dict)
    """Model class name -> its forward without a float32 cast of the logits, for float64 models."""
    routers: tuple[str, ...] = ()
    """Its softmax-top-k router classes: their float64 forward and the load-balancing loss are known
    (:mod:`ds_tree.models.moe`); any other router is refused in float64."""
    vision: VisionFamily | None = None
    """A vision-language model whose language model runs on trees (:mod:`ds_tree.models.vision`): its image
    processor settings (None: text only)."""
    bidirectional_images: bool = False
    """Its image tokens attend to each other bidirectionally inside the language model: refused at load,
    the tree mask is causal."""
    logit_transforms: Mapping[str, tuple] = field(default_factory=lambda: dict(LOGIT_TRANSFORMS))
    """Config fields that transform the logits after ``lm_head``, with their identity values: the chunked
    head (``model.head_chunk``) refuses any other value (:mod:`ds_tree.models.logprobs`)."""


PLAIN = FamilySpec("")
"""The spec of a model type that is not registered."""


def family_of(config) -> FamilySpec:
    """The spec of ``config``'s family: its ``model_type``'s, else its text config's (a multimodal wrapper
    of a registered language model), else :data:`PLAIN`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for model_type in (getattr(config, "model_type", None), getattr(text, "model_type", None)):
        if model_type in MODEL_FAMILIES:
            return MODEL_FAMILIES.get(model_type)
    return PLAIN


def family_of_model(model) -> FamilySpec:
    """The spec of ``model``'s family (a DeepSpeed engine's module's; :data:`PLAIN` for a module without a
    config)."""
    config = getattr(getattr(model, "module", model), "config", None)
    return PLAIN if config is None else family_of(config)


def families_with(predicate: Callable[[FamilySpec], bool]) -> list[FamilySpec]:
    """The registered families for which ``predicate`` holds, in registration order (for messages that list
    what is supported)."""
    return [spec for _, spec in MODEL_FAMILIES.items() if predicate(spec)]
