"""Refusing models whose layers mix tokens outside the tree attention.

Tree training is exact only when every layer that mixes tokens does so through transformers'
attention interface, where the tree attention sits. A layer that runs along the packed row by
itself (a state-space mixer such as Mamba's, a linear-attention recurrence, a short convolution)
lets one branch's tokens reach its sibling branches: training runs, and the gradients are wrong.
Two checks catch such models:

- :func:`check_layer_types` (static, before anything is built, so the dry run sees it): every
  entry of ``config.layer_types`` (transformers 5 names each layer's kind there: Mamba, Bamba,
  Jamba, Falcon-H1, Qwen3-Next, ... list ``linear_attention``, ``hybrid``, ``conv``) must be one
  known to go through the attention interface or to act on each token alone.
- :func:`check_branch_isolation` (a probe of the built model): a tree of a shared root and two
  branches A and B is run twice, with different tokens in A, with hooks on every decoder layer. The
  root and B do not see A, so their hidden states must not change: the first layer whose output
  there changes is refused, named with its submodules. A correct layer changes nothing there at
  all (measured: exactly 0 for Llama in float32 and bfloat16). The leaks of tiny random-init
  models (hidden size 32), as a fraction of the layer's update of those hidden states, measured
  1.08 (Mamba), 0.63 (Qwen3-Next's linear attention) and 0.021 in float32, 0.042 in bfloat16
  (Jamba's Mamba layer): well above the threshold of 1e-3. The probe is 12 tokens and two
  forwards; under ZeRO-3 every rank must call it (the forward gathers the parameters
  collectively) and every rank decides alike, from the same input.
"""

from __future__ import annotations

import math

import torch

from ds_tree.models.families import families_with, family_of
from ds_tree.models.hybrid import RECURRENT_LAYER_TYPES

# Layer kinds whose token mixing is the attention interface's, or that act on each token alone.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "mlp", "moe")
LEAK_THRESHOLD = 1e-3
"""A layer leaks when its output at the isolated positions moves by more than this fraction of its update there."""

# The probe tree in DFS order: root (4 tokens), branch A (4), branch B (4); A and B follow the root.
ROOT, BRANCH_A, BRANCH_B = range(0, 4), range(4, 8), range(8, 12)
POSITION_IDS = [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
KV_END = [12] * 4 + [8] * 4 + [12] * 4
ISOLATED = [*ROOT, *BRANCH_B]


class UnsupportedModelError(ValueError):
    """A model whose token mixing bypasses the tree attention."""


def check_layer_types(config) -> None:
    """Refuse a config whose ``layer_types`` name a layer kind outside :data:`SUPPORTED_LAYER_TYPES`."""
    layer_types = getattr(config, "layer_types", None) or []
    # The recurrent mixers of the hybrid families run per tree node (ds_tree.models.hybrid); the same
    # layer kind in any other model type is a mixer that has no tree forward here.
    supported = SUPPORTED_LAYER_TYPES
    if family_of(config).recurrent is not None:
        supported = SUPPORTED_LAYER_TYPES + RECURRENT_LAYER_TYPES
    unsupported: dict[str, list[int]] = {}
    for index, kind in enumerate(layer_types):
        if kind not in supported:
            unsupported.setdefault(str(kind), []).append(index)
    if unsupported:
        listed = "; ".join(f"{kind} (layers {', '.join(map(str, layers))})" for kind, layers in unsupported.items())
        raise UnsupportedModelError(
            f"{type(config).__name__} ({config.model_type}): layer_types has {listed}. Tree training is exact only "
            f"for layers that mix tokens through transformers' attention interface with causal (or sliding-window) "
            f"attention (supported layer types: {', '.join(SUPPORTED_LAYER_TYPES)}); state-space, linear-attention "
            "and convolution layers would train with wrong gradients (the recurrent layers of "
            f"{', '.join(sorted(hybrid_model_types()))} run on trees: docs/MODELS.md, 'Hybrid models')"
        )


def hybrid_model_types() -> list[str]:
    """The model types of the registered families whose recurrent layers run on trees."""
    return [spec.model_type for spec in families_with(lambda spec: spec.recurrent is not None)]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules of the classes the model lists as its blocks (``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    # A vision-language model lists its vision tower's blocks too: they mix patches of one image, not tokens.
    blocks = [
        module for module in model.modules() if type(module).__name__ in names and "Vision" not in type(module).__name__
    ]
    inner = {id(child) for block in blocks for child in block.modules() if child is not block}
    return [block for block in blocks if id(block) not in inner]


def check_branch_isolation(model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
    """Refuse ``model`` if a layer lets tree branch A change the hidden states of the root or branch B."""
    vocab = model.config.get_text_config().vocab_size
    first = torch.arange(12) % vocab
    second = first.clone()
    second[list(BRANCH_A)] = (first[list(BRANCH_A)] + vocab // 2) % vocab
    layers = decoder_layers(model)
    captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    run = [0]

    def hook(module, args, kwargs, output):
        hidden_in = args[0] if args else kwargs["hidden_states"]
        hidden_out = output[0] if isinstance(output, tuple) else output
        captured[run[0]].append(
            (hidden_in[0, ISOLATED].detach().float().cpu(), hidden_out[0, ISOLATED].detach().float().cpu())
        )

    handles = [layer.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for run[0], input_ids in enumerate((first, second)):
                logits = model(
                    input_ids=input_ids[None].to(device),
                    position_ids=torch.tensor([POSITION_IDS], device=device),
                    kv_end=torch.tensor([KV_END], device=device),
                    use_cache=False,
                ).logits
                captured[run[0]].append((torch.zeros(()), logits[0, ISOLATED].detach().float().cpu()))
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    for index, ((hidden_in, out_first), (_, out_second)) in enumerate(zip(*captured, strict=True)):
        change = float((out_first - out_second).abs().max())
        update = float((out_first - hidden_in).abs().max())
        if change > LEAK_THRESHOLD * update:
            module = layers[index] if index < len(layers) else model
            parts = sorted({type(child).__name__ for child in module.children()})
            where = f"layer {index}" if index < len(layers) else "the model's output"
            share = change / update if update else math.inf
            raise UnsupportedModelError(
                f"{type(model).__name__}: {where} ({type(module).__name__}: {', '.join(parts)}) lets the tokens of "
                f"one tree branch change the hidden states of another (by {share:.3g} of the layer's update): it "
                "mixes tokens outside transformers' attention interface, so tree training would compute wrong "
                "gradients"
            )
