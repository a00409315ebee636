"""Value models: a transformers model with a one-output head, called as the runners call a causal LM.

PPO's critic (``objective.critic``, :mod:`ds_tree.objectives.critic`) scores a value per tree token: the value
head at ``pred_pos`` of target ``t``, the value of the state before ``t`` is generated (it depends on the prefix
only, so every path through the token shares it). The runners (:mod:`ds_tree.engine.runners`) run any model
through ``model(**inputs, logits_to_keep=index)`` and read ``.logits``; a :class:`ValueModel` answers that call
with the values at ``index`` (``[1, len(index), 1]``), and :func:`values_at` is the head the runners apply to
them instead of the log-softmax (:attr:`~ds_tree.engine.runners.RunContext.head`). The no-target forwards the
runners make for ZeRO-3's collectives (zero-loss and dummy calls, label 0) read the one output as a one-class
distribution: a zero loss through every parameter, as for a causal LM.

Two kinds:

- :func:`load_value_model`: ``AutoModelForTokenClassification`` with ``num_labels = 1`` from a model config (random
  init), a model directory or hub id (the trunk's weights loaded, the head new), with the tree attention swapped in
  as the policy's (:func:`~ds_tree.models.loading.load_model`); no dropout on the head.
- :class:`TrunkValueHead` (``source: policy``): a linear head on the policy's own trunk. The trunk runs without
  gradients inside it: the value loss trains the head alone, and the trunk is the policy's, trained by the policy
  loss only (its features are the policy's, the head a linear probe on them).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.modeling_outputs import TokenClassifierOutput

from ds_tree.errors import ConfigError
from ds_tree.model_roles.compatibility import check_same_tokenizer, role_config
from ds_tree.models.loading import load_config
from ds_tree.models.ulysses import check_heads

CRITIC_FIELD = "objective.critic.source"


def check_critic(config) -> None:
    """A critic of its own (``objective.critic.source`` not ``policy``) fits the policy, before any model is built:
    its config readable, its heads split under sequence parallelism, a vocabulary that holds the policy's token
    ids (it embeds them) and, where both have one, the policy's tokenizer
    (:mod:`ds_tree.model_roles.compatibility`): a :class:`ConfigError` naming the field."""
    source = config.objective.critic.source
    critic = role_config(source, CRITIC_FIELD)
    check_heads(critic, config.parallel.sequence_parallel_size, source)
    try:
        policy = load_config(config.model.source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{CRITIC_FIELD}: {error}") from None
    critic_vocab, policy_vocab = critic.get_text_config().vocab_size, policy.get_text_config().vocab_size
    if critic_vocab < policy_vocab:
        raise ConfigError(
            f"{CRITIC_FIELD}: {source} has a vocabulary of {critic_vocab} tokens, model.source {policy_vocab}: the "
            "critic reads the policy's token ids, so it needs at least the policy's vocabulary (use a critic with "
            "the policy's tokenizer, or critic.source: policy)"
        )
    why = "the critic reads the policy's token ids: use a critic with the policy's tokenizer"
    check_same_tokenizer(config, source, CRITIC_FIELD, "policy", why)


VALUE_HEAD = "score"
"""The head's module name in transformers' token-classification models (and :class:`TrunkValueHead`)."""


class ValueModel(torch.nn.Module):
    """A token-classification model with one label, answering the runners' ``logits_to_keep`` call (module doc)."""

    def __init__(self, scorer: torch.nn.Module) -> None:
        super().__init__()
        self.scorer = scorer

    @property
    def config(self):
        return self.scorer.config

    def forward(self, *, logits_to_keep=None, use_cache=None, **inputs) -> TokenClassifierOutput:
        values = self.scorer(**inputs, use_cache=False).logits
        if logits_to_keep is not None:
            values = values[:, logits_to_keep]
        return TokenClassifierOutput(logits=values)


class TrunkValueHead(torch.nn.Module):
    """A value head on the policy's trunk (``objective.critic.source: policy``; module docstring).

    ``trunk`` is the policy's decoder (its module, not a submodule of this one: the critic's engine holds and
    partitions the head alone). It runs without gradients here, with the inputs the runners give (tree positions,
    ``kv_end``, a dfs walk's path cache, a sequence-parallel shard), so its features are those the policy computes.
    """

    def __init__(self, trunk: torch.nn.Module, hidden_size: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        object.__setattr__(self, "trunk", trunk)  # not registered: the policy's parameters stay the policy's
        torch.manual_seed(seed)
        self.score = torch.nn.Linear(hidden_size, 1, dtype=torch.float32).to(dtype)

    @property
    def config(self):
        return self.trunk.config

    def forward(self, *, logits_to_keep=None, use_cache=None, **inputs) -> TokenClassifierOutput:
        with torch.no_grad():
            hidden = self.trunk(**inputs, use_cache=False).last_hidden_state
        if logits_to_keep is not None:
            hidden = hidden[:, logits_to_keep]
        return TokenClassifierOutput(logits=self.score(hidden.to(self.score.weight.dtype)))


def policy_trunk(policy: torch.nn.Module) -> torch.nn.Module:
    """The decoder of ``policy`` (a causal LM, inside a DeepSpeed engine or PEFT wrapper): its hidden states
    without the LM head."""
    model = getattr(policy, "module", policy)
    if hasattr(model, "get_base_model"):  # PEFT: the adapters live inside the base model's layers
        model = model.get_base_model()
    return model.get_decoder()


def load_value_model(
    source: str,
    *,
    attention: str,
    dtype: torch.dtype,
    seed: int,
    checkpoint_every: int = 0,
    recurrent_kernels: str = "auto",
) -> ValueModel:
    """The critic of ``source`` (module docstring), in training mode."""
    from ds_tree.models.loading import load_model

    scorer = load_model(
        source,
        attention=attention,
        dtype=dtype,
        seed=seed,
        checkpoint_every=checkpoint_every,
        recurrent_kernels=recurrent_kernels,
        value_head=True,
    )
    return ValueModel(scorer)


def values_at(
    model,
    row,
    predictors: np.ndarray,
    labels: np.ndarray,
    device: torch.device | str = "cpu",
    *,
    entropy=None,
    head_chunk: int = 0,
) -> tuple[torch.Tensor, None]:
    """The value head at row positions ``predictors`` (``labels`` unused), float32 or wider: the head of the
    runners for a value model (:attr:`~ds_tree.engine.runners.RunContext.head`, the signature of
    :func:`~ds_tree.models.logprobs.logprobs_and_entropy_at`; a value model has no vocabulary to chunk)."""
    index = torch.as_tensor(predictors, device=device)
    values = model(**row.tensors(device), logits_to_keep=index, use_cache=False).logits[0, :, 0]
    if values.dtype in (torch.bfloat16, torch.float16):
        values = values.float()
    return values, None
