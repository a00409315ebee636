"""LoRA adapters on a tree-attention model, with the PEFT library (``model.lora``; docs/LORA.md).

The adapters are added after the tree attention swap (:func:`ds_tree.models.loading.load_model`):
PEFT replaces the target ``nn.Linear`` layers by LoRA layers around them and leaves the attention
modules, and so the packed layout (``kv_end``, depth ``position_ids``), every attention engine, the
dfs walk's cached attention and activation checkpointing, as they were. Every base weight is frozen;
the optimizer sees the adapter weights (and ``modules_to_save`` copies) only.

Tree == flat holds for adapters exactly as for full weights: restoration weights act on the loss,
whatever the parameters are. LoRA dropout does not: a token shared by several trajectories gets one
dropout mask in the tree and one per trajectory in the flat baseline (an unbiased estimate of the
same expectation, not the same number), so ``dropout > 0`` is refused unless ``objective.self_check``
is off.

The KL reference of an adapter run is the same model with its adapters disabled
(:class:`AdaptersDisabled`): no second model in memory, and under ZeRO-3 it is partitioned with the
policy (``model.zero_init`` works).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

ALL_LINEAR = "all-linear"
"""PEFT's name for every linear layer of the decoder (not the LM head)."""


def peft_config(settings, *, init_lora_weights: bool = True):
    """The ``peft.LoraConfig`` of ``settings`` (:class:`ds_tree.config.LoraSettings`)."""
    from peft import LoraConfig

    targets = settings.target_modules
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=ALL_LINEAR if list(targets) == [ALL_LINEAR] else list(targets),
        modules_to_save=list(settings.modules_to_save) or None,
        init_lora_weights=init_lora_weights,
        task_type="CAUSAL_LM",
        bias="none",
    )


def apply_lora(model: torch.nn.Module, settings, *, init_lora_weights: bool = True):
    """``model`` wrapped by PEFT with adapters of ``settings``; only the adapters require gradients.

    A float64 model gets float64 adapters (PEFT's default upcasts only 16-bit ones, to float32; a
    bf16 run under DeepSpeed casts the whole module to bf16 when the engine starts). A
    ``target_modules`` entry that matches no layer is PEFT's ``ValueError``, named by the caller.
    """
    from peft import get_peft_model

    tied = getattr(model.config, "tie_word_embeddings", False)
    untied = [name for name in settings.modules_to_save if name in ("lm_head", "embed_tokens")]
    if tied and untied:  # a trained copy of one of them would silently untie the pair
        raise ValueError(
            f"model.lora.modules_to_save: {untied[0]} is tied to the other embedding in this model "
            "(tie_word_embeddings); adapt it with target_modules instead, or train all weights"
        )
    names = [name for name, _ in model.named_modules()]
    unmatched = [n for n in settings.modules_to_save if not any(m == n or m.endswith(f".{n}") for m in names)]
    if unmatched:  # PEFT skips such a name silently: the run would train without that module
        leaves = sorted({m.rpartition(".")[2] for m in names if m and not m.rpartition(".")[2].isdigit()})
        raise ValueError(
            f"model.lora.modules_to_save: {unmatched[0]!r} matches no module of this model (its module names: "
            f"{', '.join(leaves)})"
        )
    try:
        wrapped = get_peft_model(model, peft_config(settings, init_lora_weights=init_lora_weights))
    except ValueError as error:
        raise ValueError(f"model.lora: {error}") from None
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise ValueError("model.lora: no parameter is trained (check target_modules and modules_to_save)")
    return wrapped


def adapter_parameter_count(model_config, settings) -> int:
    """Trained parameters of ``settings``'s adapters on a model of ``model_config`` (counted on the
    ``meta`` device: no memory), for ``ds-tree plan``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = apply_lora(AutoModelForCausalLM.from_config(model_config), settings)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def peft_model_of(model):
    """The PEFT model inside ``model`` (a DeepSpeed engine, or the PEFT model itself), or None."""
    from peft import PeftModel

    inner = getattr(model, "module", model)
    return inner if isinstance(inner, PeftModel) else None


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates (all of them without adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


class AdaptersDisabled:
    """The policy with its adapters off: the base model, for the KL reference's log-probs.

    Calls go to the same module (a DeepSpeed engine or a PEFT model) inside PEFT's
    ``disable_adapter`` (LoRA layers return their base layer's output; ``modules_to_save`` use the
    original module), so under ZeRO-3 they are the policy's own collective forwards: every rank
    makes them in the same number (:func:`~ds_tree.objectives.rl_rows.gathers_collectively` reads the
    engine's ZeRO stage through this wrapper). Attribute reads go to the wrapped module.
    """

    def __init__(self, model) -> None:
        if peft_model_of(model) is None:
            raise TypeError("AdaptersDisabled needs a PEFT model (model.lora) or an engine around one")
        self.model = model

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


@contextmanager
def adapters_disabled(model):
    """While inside, ``model``'s adapters are off (PEFT's ``disable_adapter``)."""
    with peft_model_of(model).disable_adapter():
        yield


def adapter_state_dict(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights of ``model`` (a PEFT model) as PEFT saves them, from ``state_dict``
    (the full one, e.g. ZeRO-3's consolidated) or the model's own."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=state_dict)


def save_adapter(model, state_dict: dict[str, torch.Tensor] | None, directory) -> None:
    """``adapter_config.json`` and ``adapter_model.safetensors`` in ``directory``: what
    ``PeftModel.from_pretrained(base, directory)`` loads."""
    model.save_pretrained(str(directory), state_dict=adapter_state_dict(model, state_dict), safe_serialization=True)


def merged_state_dict(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA update merged in (``W + scale * B A``) and the
    ``modules_to_save`` copies in place of the originals, keyed as the plain Hugging Face model.

    Computed from a full ``state_dict`` of the PEFT model (ZeRO-3: the consolidated one on rank 0),
    so nothing is gathered or changed in the training model.
    """
    peft = model
    adapter = peft.active_adapter
    config = peft.peft_config[adapter]
    scale = config.lora_alpha / config.r
    prefix = "base_model.model."
    merged: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix) or ".lora_" in key or f".modules_to_save.{adapter}." in key:
            continue
        name = key[len(prefix) :]
        name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
        merged[name] = value
    for key, value in state_dict.items():
        if f".lora_A.{adapter}.weight" in key:
            base = key.replace(f".lora_A.{adapter}.weight", "")
            b = state_dict[base + f".lora_B.{adapter}.weight"]
            name = base[len(prefix) :] + ".weight"
            weight = merged[name]
            delta = (b.double() @ value.double()) * scale
            if getattr(config, "fan_in_fan_out", False):
                delta = delta.T
            merged[name] = (weight.double() + delta).to(weight.dtype)
        elif f".modules_to_save.{adapter}." in key:
            name = key[len(prefix) :].replace(f".modules_to_save.{adapter}.", ".")
            merged[name] = value
    return merged
