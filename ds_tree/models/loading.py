"""Building Hugging Face causal LMs with tree attention swapped in.

``source`` is either a config JSON file (random init from a seed, for tests and the quickstart),
a local Hugging Face model directory (weights loaded), or a hub id (``org/name``) resolved through
huggingface_hub's cache (:mod:`ds_tree.hub`; a local path of that name wins). Any model class that
dispatches attention through transformers' ``AttentionInterface`` works: Llama, Qwen2, Qwen3,
Mistral, ... Models with other token-mixing layers (state-space, linear attention) are refused
(:mod:`ds_tree.models.token_mixing`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.integrations import is_deepspeed_zero3_enabled

from ds_tree.attention.registry import (
    attention_engine,
    implementation_name,
    register_tree_attention,
    resolve_engine,
    tree_engines,
)
from ds_tree.errors import ConfigError, HubError
from ds_tree.hub import CONFIG_FILES, MODEL_FILES, is_hub_id, local_path
from ds_tree.kernel.tile_lists import resolve_schedule
from ds_tree.models.float64 import keep_logits_in_float64, keep_norms_in_float64
from ds_tree.models.hybrid import install_tree_mixers
from ds_tree.models.moe import check_router_noise, use_float64_routing
from ds_tree.models.token_mixing import check_layer_types
from ds_tree.models.vision import attention_implementations, check_vision_model_type, install_vision, is_vision_language
from ds_tree.scans.fla_scan import resolve_recurrent_kernels

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
"""Model config fields that must be positive integers where a config has them."""


def check_shape(fields: dict, source: str | Path) -> None:
    """Refuse sizes no model can have, naming the field: a size that is not a positive integer,
    attention heads that do not divide the hidden size (without an explicit ``head_dim``), key/value
    heads that do not divide the attention heads. ``ValueError`` (a config error, exit 2)."""
    for name in SIZE_FIELDS:
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")
    hidden, heads = fields.get("hidden_size"), fields.get("num_attention_heads")
    kv_heads = fields.get("num_key_value_heads")
    if hidden and heads and fields.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"{source}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); "
            "change one, or give head_dim"
        )
    if heads and kv_heads and heads % kv_heads:
        raise ValueError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )


def load_config(source: str | Path) -> PretrainedConfig:
    """Config from a JSON file (must name its ``model_type``), a local model directory or a hub id (its
    ``config.json`` only); its sizes checked (:func:`check_shape`)."""
    source = local_path(source, CONFIG_FILES)
    if source.is_dir():
        config = AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=False)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        check_shape({name: getattr(text, name, None) for name in (*SIZE_FIELDS, "head_dim")}, source)
        return config
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such model config file or directory")
    try:
        fields = json.loads(source.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{source}: malformed JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{source}: a model config must be a JSON object")
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{source}: the config needs a 'model_type' field (e.g. \"llama\")")
    check_shape(fields, source)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # noqa: BLE001 - transformers' validators raise their own types
        reason = str(error).strip().splitlines()[-1].strip() if str(error).strip() else type(error).__name__
        raise ValueError(f"{source}: not a valid {model_type} config ({reason})") from None


def check_attention_settings(config) -> None:
    """``model.attention``'s engine against ``packing.mode``, ``model.dtype`` and the device
    (:func:`check_model_settings`); a ``ConfigError`` naming the fields."""
    name = resolve_engine(config.model.attention)
    engine = attention_engine(name)
    alternatives = " or ".join(", ".join(tree_engines()).rsplit(", ", 1))
    if engine.flat_rows_only and config.packing.mode != "flat":
        raise ConfigError(
            f"model.attention: {name} runs flat rows only (kernels over independent sequences), and packing.mode "
            f"is {config.packing.mode}: set packing.mode: flat for the flat baseline, or use {alternatives} for "
            "tree rows"
        )
    if engine.dtypes and config.model.dtype not in engine.dtypes:
        raise ConfigError(
            f"model.attention: {name} needs model.dtype: {engine.dtypes[0]} (its kernels take "
            f"{'/'.join(engine.dtypes)} only), got {config.model.dtype}; use {alternatives} in float32"
        )
    if torch.cuda.is_available():
        return
    cpu = resolve_engine("auto", "cpu")
    if not engine.runs_on("cpu") or (engine.interpreted_off_cuda and os.environ.get("TRITON_INTERPRET") != "1"):
        raise ConfigError(
            f"model.attention: {name} needs a CUDA GPU and none is visible ({engine.cpu_limit}); use {cpu} on the CPU"
        )
    if not engine.trains_on("cpu"):
        raise ConfigError(
            f"model.attention: {name} cannot train on the CPU: {engine.cpu_limit}; use {cpu} on the CPU, or {name} "
            "on a CUDA GPU"
        )


def check_model_settings(config) -> None:
    """What the training config asks of the model that can be checked before anything is built, for the
    engine ``model.attention`` resolves to here (``auto``: flex with a CUDA GPU, torch without), from its
    capabilities (:mod:`ds_tree.attention.engines`): one that runs flat rows only (varlen) needs
    ``packing.mode: flat``; one that takes some dtypes only (varlen: bfloat16) needs ``model.dtype`` among
    them; without a CUDA GPU, one with no CPU kernel (varlen) or no CPU backward (flex: FlexAttention has a
    forward only there) is refused, and one that runs off CUDA only in Triton's interpreter (triton) needs
    ``TRITON_INTERPRET=1`` (which the tests use). ``model.recurrent_kernels: fla`` needs ``fla-core``
    installed; ``objective.reference`` must be a loadable model config; ``$DS_TREE_TRITON_TILES`` must name a
    tile schedule (checked on any machine: the config may be meant for a GPU's)."""
    try:  # the Triton engine's tile schedule from the environment: wrong on this machine, wrong on the GPU's
        resolve_schedule()
    except ValueError as error:
        raise ConfigError(f"{error} (the environment variable of the Triton engine's tile schedule)") from None
    check_attention_settings(config)
    # fla named but not installed is refused here; model.dtype has no float64 (verify's own dtype is checked
    # where verify loads the model)
    resolve_recurrent_kernels(config.model.recurrent_kernels)
    reference = config.objective.reference
    if config.objective.is_rl and reference:
        try:
            check_layer_types(load_config(reference))
            check_hub_weights(reference)
        except (OSError, ValueError) as error:
            raise ConfigError(f"objective.reference: {error}") from None


def has_weights(source: str | Path) -> bool:
    source = Path(source)
    return source.is_dir() and (any(source.glob("*.safetensors")) or any(source.glob("*.bin")))


def weights_snapshot(repo_id: str) -> Path:
    """The cached snapshot of hub model ``repo_id`` with its weights (fetched where there is network); a
    :class:`HubError` when it holds no safetensors."""
    source = local_path(repo_id, MODEL_FILES)
    if not has_weights(source):
        raise HubError(
            f"{repo_id}: its cached snapshot ({source}) holds no *.safetensors weights (.bin checkpoints are "
            f"not loaded: they are pickles); download them with `hf download {repo_id}`, or convert the model "
            "to safetensors"
        )
    return source


def check_hub_weights(source: str | Path) -> None:
    """Offline, a hub id's cached snapshot must hold the weights the run will load (:func:`weights_snapshot`),
    checked at the dry run rather than when the run starts. With network nothing is checked here: the run
    downloads them (the dry run fetches a config only)."""
    from huggingface_hub import constants

    if is_hub_id(source) and constants.is_offline_mode():
        weights_snapshot(str(source))


def load_model(
    source: str | Path,
    *,
    attention: str = "torch",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    checkpoint_every: int = 0,
    device: torch.device | str | None = None,
    recurrent_kernels: str = "auto",
    value_head: bool = False,
) -> PreTrainedModel:
    """A causal LM with ``attn_implementation = tree_<attention>``, in training mode; with ``value_head`` the
    same trunk with a one-output token-classification head instead of the LM head, without dropout (a critic,
    :mod:`ds_tree.model_roles.values`; its weights new, the trunk's loaded where ``source`` has them).

    ``attention: auto`` resolves (:func:`~ds_tree.attention.registry.resolve_engine`) for the device
    the model will *run* on, ``device``: the model is always built on the CPU here and moved by the
    caller (DeepSpeed's engine, ``.to(device)``), so the device it is built on says nothing. ``device``
    None: CUDA when a GPU is visible, else the CPU, the device DeepSpeed's accelerator picks; pass it
    where the caller runs elsewhere (``ds-tree bench --device``, ``verify`` on the CPU).

    Random init (seeded with ``seed``) from a config file or a weightless directory; weights
    from a directory that has them, or from a hub id's snapshot (which must hold safetensors). A
    config whose ``layer_types`` name token mixing outside the attention interface is refused
    before anything is built. ``checkpoint_every = k > 0``
    recomputes every k-th decoder layer in the backward (:func:`enable_activation_checkpointing`).
    ``recurrent_kernels`` (hybrids): the GDN / Mamba2 scans' engine for ``device``
    (:func:`~ds_tree.scans.fla_scan.resolve_recurrent_kernels`: ``auto`` is fla on CUDA when installed).
    """
    register_tree_attention()
    implementation = implementation_name(resolve_engine(attention, device))
    dtype = parse_dtype(dtype)
    if is_hub_id(source):  # a hub model is trained from its weights, never silently re-initialised
        source = weights_snapshot(source)
    config = load_config(source)
    check_layer_types(config)
    check_vision_model_type(config)
    model_class, head = AutoModelForCausalLM, {}
    if is_vision_language(config):  # the tree engine for the language model only (ds_tree.models.vision)
        if value_head:
            raise ValueError(f"{source}: a vision-language model cannot be a value model (a critic); use a text model")
        model_class, implementation = AutoModelForImageTextToText, attention_implementations(implementation)
    if value_head:
        model_class, head = AutoModelForTokenClassification, {"num_labels": 1, "classifier_dropout": 0.0}
        config.update(head)
    if has_weights(source):
        model = model_class.from_pretrained(
            source,
            attn_implementation=implementation,
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=False,
            **head,
        )
    else:
        torch.manual_seed(seed)
        # Initialised in float32 whatever the dtype, so float64 and float32 runs of one seed hold
        # the same weights. Under ZeRO-3 init the parameters are partitioned as they are made;
        # DeepSpeed itself casts them (bf16) when the engine starts.
        model = model_class.from_config(config, attn_implementation=implementation, dtype=torch.float32)
        if not is_deepspeed_zero3_enabled():
            model.to(dtype)
    check_router_noise(model)
    install_tree_mixers(model, resolve_recurrent_kernels(recurrent_kernels, device, dtype))
    if dtype == torch.float64:  # before install_vision, which wraps the model's forward
        keep_logits_in_float64(model)
        keep_norms_in_float64(model)
        use_float64_routing(model)
    install_vision(model)
    model.config.use_cache = False
    if checkpoint_every:
        enable_activation_checkpointing(model, checkpoint_every)
    model.train()
    return model


def enable_activation_checkpointing(model: PreTrainedModel, every: int = 1) -> None:
    """Recompute every ``every``-th decoder layer in the backward instead of keeping its activations.

    transformers' own mechanism (``activation_checkpointing_enable``): each
    ``GradientCheckpointingLayer`` runs its ``forward`` inside non-reentrant
    :func:`torch.utils.checkpoint.checkpoint`, its keyword arguments bound to it, so the tree's
    ``kv_end`` and ``position_ids`` reach the recomputed forward unchanged. It wraps ``forward``,
    not ``__call__``: the layer's own module hooks (ZeRO-3 gathers and releases a layer's
    parameters there) stay outside the checkpoint and run once per forward; the recompute gathers
    the parameters through its submodules' hooks in the backward, where ZeRO-3 needs them for the
    layer's gradient anyway. DeepSpeed's ``deepspeed.checkpointing.checkpoint`` is reentrant and
    takes positional tensors only (the keyword inputs would have to be re-packed), and what it adds
    (partitioning activations across model-parallel ranks, CPU offload) has no use here.
    """
    if every < 1:
        raise ValueError(f"activation checkpointing every {every} layers: must be >= 1")
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every
    )
