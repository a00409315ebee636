"""Training configuration: a YAML file mapped onto typed dataclasses.

Every section is a dataclass with a docstring under each field; range checks live in
``__post_init__``. The loader checks every value against its field's type: an unknown key, a
value of the wrong type, a string outside a ``Literal`` field's choices, a list of the wrong
length or a non-finite float (``.inf``, ``.nan``) is an error naming the file and the dotted key,
never a silent default. A field set off its default where nothing would read it (LoRA fields with
``rank: 0``, dfs fields outside dfs walks, rollout fields while rollout is disabled, ...) is an error
naming it and what would make it apply (``Config._refuse_settings_that_cannot_apply``). Float fields
also take numeric strings, because YAML reads ``1e-3``
(exponent, no dot) as a string. Command-line overrides are dotted ``key=value`` pairs
(``optimizer.lr=1e-3``, ``max_steps=5``) whose values are parsed as YAML scalars.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal

import yaml

from ds_tree.errors import ConfigError
from ds_tree.registries import (
    AGGREGATIONS,
    ATTENTION_ENGINES,
    ESTIMATORS,
    OBJECTIVES,
    REWARDS,
    SAMPLING_ENGINES,
    TRACKERS,
    configured,
)
from ds_tree.registry import Choices
from ds_tree.sampling.settings import EnvSettings, SamplerSettings, TurnBranchedSettings

# Choices of string fields. An extension point's field is ``Annotated[str, REGISTRY.choices()]``: its
# choices are the registry's names when the value is read (ds_tree.registries), so a registered entry is
# accepted. The Literal fields are fixed sets; where the library keeps the same names (packing modes,
# normalisations, weight policies), tests/test_reliability.py asserts that the two agree.
Dtype = Literal["float32", "bfloat16"]
AttentionEngine = Annotated[str, ATTENTION_ENGINES.choices("auto")]
RecurrentKernels = Literal["auto", "torch", "fla"]  # ds_tree.scans.fla_scan.RECURRENT_KERNELS
Merge = Literal["group", "global"]
PackingMode = Literal["tree", "flat", "dfs"]
OverBudget = Literal["error", "dfs", "sequence_parallel"]
Normalisation = Literal["token_mean", "sequence_mean", "sum"]
WeightPolicy = Literal["exact", "dedup"]
Schedule = Literal["cosine", "constant"]
NonFinitePolicy = Literal["stop", "skip"]
ResumePolicy = Literal["auto", "latest", "newest_complete", "never"]
ObjectiveKind = Annotated[str, OBJECTIVES.choices()]
Estimator = Annotated[str, ESTIMATORS.choices("")]
"""An advantage estimator, or ``""``: the objective's default."""
Aggregation = Annotated[str, AGGREGATIONS.choices()]
KLEstimator = Literal["k1", "k2", "k3"]
OldLogprobs = Literal["recompute", "data"]
Tracker = Annotated[str, TRACKERS.choices()]
SamplingEngine = Annotated[str, SAMPLING_ENGINES.choices()]
PreemptSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"]  # ds_tree.run.preemption.SIGNALS
BestMode = Literal["auto", "max", "min"]
DistillLoss = Literal["reverse_kl_sampled", "kl", "jsd", "reverse_kl"]  # ds_tree.losses.distill.LOSSES
DPOLoss = Literal["sigmoid", "ipo"]  # ds_tree.losses.dpo.LOSSES
DPOPairs = Literal["siblings"]  # ds_tree.trees.pairs.PAIRINGS
CPPODivergence = Literal["tv", "kl"]  # ds_tree.losses.cppo.DIVERGENCES


TEMPO_COEF_MAX = 1e6
"""The largest ``objective.tempo_coef`` in size (1e300 overflowed the advantages, and the error blamed the rewards)."""

RL_ONLY_FIELDS = (
    "estimator",
    "normalise_advantages",
    "tempo_coef",
    "aggregation",
    "aggregation_constant",
    "eps_low",
    "eps_high",
    "dual_clip",
    "kl_coef",
    "kl_estimator",
    "reference",
    "reference_offload",
    "reference_step",
    "entropy_coef",
    "old_logprobs",
    "importance_truncation",
    "ppo_epochs",
    "mini_batches",
    "gamma",
    "lam",
    "critic",
    "cppo",
)
"""``objective`` fields that only an RL objective (``kind`` grpo or ppo) uses."""
SFT_ONLY_FIELDS = ("normalisation", "policy")
"""``objective`` fields that only the SFT objective uses."""
KIND_FIELDS = {
    "distill": (
        "teacher",
        "distill",
        "aggregation",
        "aggregation_constant",
        "eps_low",
        "eps_high",
        "dual_clip",
        "ppo_epochs",
        "mini_batches",
    ),
    "dpo": ("dpo", "reference", "reference_offload"),
}
"""The ``objective`` fields that the distillation and DPO objectives read (``self_check`` aside: every kind
reads it); the other kinds read :data:`SFT_ONLY_FIELDS` (``sft``) or :data:`RL_ONLY_FIELDS` (``grpo``, ``ppo``
and objectives a project registers), none of the fields only these two read."""
KIND_ONLY_FIELDS = ("teacher", "distill", "dpo")
"""``objective`` fields that only the kinds of :data:`KIND_FIELDS` read."""


def objective_strays(kind: str, given: typing.Iterable[str]) -> list[str]:
    """The names among ``given`` (objective fields set by the user) that an objective of ``kind``
    does not use: the one rule of the config (fields off their defaults) and of the ``--objective``
    options of ``verify`` and ``bench`` (options given). Such a field is an error, never ignored."""
    if kind in KIND_FIELDS:
        unused = tuple(n for n in (*RL_ONLY_FIELDS, *SFT_ONLY_FIELDS, *KIND_ONLY_FIELDS) if n not in KIND_FIELDS[kind])
    else:
        unused = (*(RL_ONLY_FIELDS if kind == "sft" else SFT_ONLY_FIELDS), *KIND_ONLY_FIELDS)
    return [name for name in given if name in unused]


def kinds_reading(name: str) -> str:
    """Which ``objective.kind`` s read objective field ``name`` (for the error of a stray one)."""
    kinds = [kind for kind, fields in KIND_FIELDS.items() if name in fields]
    if name in SFT_ONLY_FIELDS:
        kinds.insert(0, "sft")
    elif name in RL_ONLY_FIELDS:
        kinds[:0] = ["grpo", "ppo"]
    return " or ".join(kinds)


@dataclass
class LoraSettings:
    """LoRA adapters trained instead of the full weights (PEFT; docs/LORA.md)."""

    rank: int = 0
    """Adapter rank r (0: no adapters, every weight is trained)."""
    alpha: float = 16.0
    """Scaling numerator: the update is ``alpha / rank * B A``."""
    dropout: float = 0.0
    """Dropout on the adapters' input. Above 0 the tree and the flat baseline draw different masks for a
    shared token (not exact): needs ``objective.self_check: off``."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (suffixes, as PEFT matches them) that get adapters; ``[all-linear]``: every linear
    layer of the decoder, not the LM head."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (e.g. ``[lm_head]``), saved with them."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(
                f"model.lora: rank must be >= 0, alpha > 0 and dropout in [0, 1), got {self.rank}, {self.alpha}, "
                f"{self.dropout}"
            )
        if self.rank and not self.target_modules:
            raise ConfigError("model.lora.target_modules is empty: name the layers that get adapters")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ModelConfig:
    source: str = ""
    """Model config JSON (random init from ``seed``), a local Hugging Face directory, or a hub id
    (``org/name``: resolved through huggingface_hub's cache, fetched where there is network; a local
    path of that name wins; :mod:`ds_tree.hub`)."""
    dtype: Dtype = "float32"
    """Parameter dtype: ``float32`` or ``bfloat16`` (DeepSpeed's bf16 mode)."""
    attention: AttentionEngine = "auto"
    """Tree attention engine: ``auto`` (the default: ``flex`` when a CUDA GPU is visible, ``torch`` on
    the CPU; the run's log names the engine it resolved to), ``torch`` (CPU block-sparse), ``triton``
    (GPU), ``flex`` (PyTorch's FlexAttention; GPU only for training, it has no backward on the CPU),
    ``varlen`` (the flat baseline on flash kernels: ``packing.mode: flat``, bfloat16, CUDA only) or
    ``reference``."""
    recurrent_kernels: RecurrentKernels = "auto"
    """Hybrid models' Gated DeltaNet / Mamba2 scans: ``torch`` (the chunked PyTorch scans, any dtype, the
    float64 oracle), ``fla`` (flash-linear-attention's Triton kernels, float32 compute; ``pip install
    --no-deps fla-core==0.6.0 einops``) or ``auto`` (the default: ``torch`` until fla has been checked on a GPU,
    then ``fla`` on CUDA when installed and the model is not float64). Models without recurrent layers run no
    scans, but ``fla`` is refused there too when fla-core is not installed (the dry run checks the name, not the
    model)."""
    seed: int = 0
    """Seed of the random init."""
    zero_init: bool = False
    """Build the model inside ``deepspeed.zero.Init`` (ZeRO-3: for models that do not fit one rank)."""
    tokenizer: str = ""
    """Optional tokenizer directory or hub id, saved beside the exported Hugging Face model."""
    activation_checkpointing: bool = False
    """Recompute decoder layers in the backward instead of keeping their activations (less memory,
    one more forward of the checkpointed layers)."""
    checkpoint_every: int = 1
    """With ``activation_checkpointing``: checkpoint every k-th decoder layer only (1: all of them)."""
    head_chunk: int = 0
    """LM head, log-softmax and entropy over chunks of this many targets, each recomputed in the
    backward: the head's peak memory is ``head_chunk x vocabulary`` (0: all targets at once)."""
    router_aux_loss_coef: float | None = None
    """MoE models: weight of the router load-balancing loss in the SFT objective (docs/MODELS.md);
    null: the model config's ``router_aux_loss_coef``; 0: off. Ignored by models without a router."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters (``rank > 0``): only they are trained and checkpointed (docs/LORA.md)."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("model.source is required (a config JSON, a model directory or a hub id)")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ConfigError(f"model.router_aux_loss_coef must be >= 0 (or null), got {self.router_aux_loss_coef}")
        if self.checkpoint_every < 1 or self.head_chunk < 0:
            raise ConfigError(
                f"model.checkpoint_every must be >= 1 and model.head_chunk >= 0, got {self.checkpoint_every}, "
                f"{self.head_chunk}"
            )

    @property
    def checkpointed_every(self) -> int:
        """Every how many decoder layers one is checkpointed (0: activation checkpointing off)."""
        return self.checkpoint_every if self.activation_checkpointing else 0


@dataclass
class DataConfig:
    path: str = ""
    """Tokens JSONL file or a dataset directory written by ``tools/convert.py``."""
    groups_per_step: int = 8
    """Trees (groups of trajectories) per optimizer step, over all ranks."""
    merge: Merge = "group"
    """``group``: one tree per group id; ``global``: one trie over each step's trajectories."""
    seed: int = 0
    """Seed of the per-epoch shuffle; with the step number it fixes every step's data."""

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ConfigError(f"data.groups_per_step must be >= 1, got {self.groups_per_step}")


@dataclass
class PackingConfig:
    mode: PackingMode = "tree"
    """``tree`` (tree packing, the default), ``flat`` (the baseline: every trajectory alone) or ``dfs``
    (each tree walked depth-first, one root-to-leaf path in memory; no budget applies, see ``dfs_chunk``;
    with ``parallel.sequence_parallel_size`` S > 1 each tree is walked by a group of S ranks, every chunk
    sharded over it, for SFT and RL alike)."""
    budget: int = 2048
    """Tokens of one packed row (one micro-batch). Larger trees are split into parts."""
    block: int = 1
    """Pad each row to a multiple of this (the GPU kernel's block size; 1 on the CPU)."""
    cost_per_token: float = 1.0
    """Balancing cost model: cost = cost_per_token * tokens + cost_per_pair * visible pairs."""
    cost_per_pair: float = 0.002
    """See ``cost_per_token``; attention's share of the work grows with visible pairs."""
    over_budget: OverBudget = "error"
    """Tree mode, a trajectory longer than ``budget`` (no row can hold its path): ``error`` stops before
    training; ``dfs`` walks that trajectory's tree in dfs mode, the other trees are packed as usual;
    ``sequence_parallel`` puts its tree in a row of up to ``parallel.sequence_parallel_size`` x
    ``budget`` tokens sharded over that many ranks (needs the size > 1, with which such trees always
    go to sharded rows: only a path over size x budget is then an error)."""
    dfs_chunk: int = 0
    """Dfs mode: most tokens forwarded at once; a longer node is cut into chained chunks (0: ``budget``)."""
    dfs_recompute: bool = False
    """Dfs mode: forward each chunk twice (without grad for its children, again with grad before its
    backward), so only one chunk's activations are kept instead of a root-to-leaf path's."""

    def __post_init__(self) -> None:
        if self.budget < 1 or self.block < 1:
            raise ConfigError("packing.budget and packing.block must be >= 1")
        if self.dfs_chunk < 0:
            raise ConfigError(f"packing.dfs_chunk must be >= 0 (0: packing.budget), got {self.dfs_chunk}")
        if self.cost_per_token < 0 or self.cost_per_pair < 0:
            raise ConfigError("packing.cost_per_token and packing.cost_per_pair must be >= 0")

    @property
    def uses_dfs(self) -> bool:
        """Whether any tree is walked depth-first: ``mode: dfs``, or ``over_budget: dfs`` in tree mode."""
        return self.mode == "dfs" or (self.mode == "tree" and self.over_budget == "dfs")


@dataclass
class DistillSettings:
    """``objective.distill``: the divergence ``objective.kind: distill`` minimises (docs/RL.md, "On-policy
    distillation"), from the student ``q`` to the teacher ``p`` at each trained token's context."""

    loss: DistillLoss = "reverse_kl_sampled"
    """``reverse_kl_sampled``: the clipped objective with the per-token advantage ``log p - log q_old`` of
    the sampled token (the reverse KL's sampled gradient); ``kl`` ``KL(p || q)``, ``reverse_kl`` ``KL(q || p)``
    and ``jsd`` (``beta``) over the whole vocabulary at every trained token's context."""
    beta: float = 0.5
    """``jsd``: ``beta KL(p || m) + (1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q``, in (0, 1)."""

    def __post_init__(self) -> None:
        if not 0 < self.beta < 1:
            raise ConfigError(f"objective.distill.beta must be in (0, 1), got {self.beta}")
        if self.beta != 0.5 and self.loss != "jsd":
            raise ConfigError(f"objective.distill.beta applies to loss jsd only (loss is {self.loss})")


@dataclass
class DPOSettings:
    """``objective.dpo``: direct preference optimisation (``objective.kind: dpo``; docs/RL.md, "DPO")."""

    beta: float = 0.1
    """The inverse temperature: a pair's margin is ``beta`` times the difference of its two sequences'
    log-ratios to the reference (> 0)."""
    loss: DPOLoss = "sigmoid"
    """``sigmoid``: ``-log sigmoid(margin)`` (DPO); ``ipo``: ``(log-ratio difference - 1 / (2 beta))^2`` on
    length-averaged log-probs (IPO)."""
    label_smoothing: float = 0.0
    """``sigmoid``: the share of preferences assumed flipped, in [0, 0.5) (conservative DPO)."""
    pairs: DPOPairs = "siblings"
    """Where the pairs come from: ``siblings``, every two trajectories of a tree that branch off one node,
    each ending in its own child of it, with different rewards (the higher one chosen)."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"objective.dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ConfigError(f"objective.dpo.label_smoothing applies to loss sigmoid only (loss is {self.loss})")


@dataclass
class CriticSettings:
    """The learned value model of ``objective.estimator: gae`` (docs/RL.md, "PPO with a learned critic"): its own
    DeepSpeed engine (the policy's ZeRO settings and dtype) and AdamW (the policy's betas, epsilon and weight decay,
    its own learning rate on the policy's schedule), checkpointed with every checkpoint."""

    source: str = ""
    """The critic: a model config JSON (random init from ``model.seed``), a model directory or hub id (its weights
    loaded, a fresh value head added), or ``policy``: a value head on the policy's trunk, sharing its parameters
    (the head alone trains on the value loss; the trunk is the policy's, trained by the policy loss only)."""
    lr: float = 1.0e-5
    """Peak learning rate of the critic's AdamW (> 0), on the policy's warm-up and decay schedule."""
    value_clip: float = 0.2
    """``eps_v``: the clipped value loss's range around the values before the step's updates (0: unclipped)."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.value_clip < 0:
            raise ConfigError(f"objective.critic: lr must be > 0 and value_clip >= 0, got {self.lr}, {self.value_clip}")

    @property
    def on_policy_trunk(self) -> bool:
        """A value head on the policy's trunk (``source: policy``), not a model of its own."""
        return self.source == POLICY_TRUNK


POLICY_TRUNK = "policy"
"""``objective.critic.source`` naming the policy's own trunk."""


@dataclass
class CPPOConfig:
    """``objective.cppo``: CPPO's token mask in place of the ratio clip (docs/RL.md, "CPPO"; Mao et al. 2026,
    arXiv 2606.10968): a position-weighted threshold and a cumulative prefix budget on the divergence from the
    old policy of each trained token, on DPPO's unclipped surrogate ``A r``."""

    enabled: bool = False
    """Mask by CPPO's rule instead of clipping the ratio (``eps_low``, ``eps_high``, ``dual_clip`` then unused)."""
    delta: float = 0.15
    """The token threshold on ``w_k D_k`` (> 0; the paper: 0.15 for dense models, 0.2 for MoE)."""
    w_min: float = 0.8
    """The position weight of a path's last trained token, in (0, 1]; the first has 1, linear between."""
    budget: float = 0.02
    """``delta_b``: the drift a prefix may accumulate per unit of position weight (>= 0)."""
    divergence: CPPODivergence = "tv"
    """``D_k`` of the sampled token: ``tv`` ``|pi - pi_old|`` (DPPO's binary TV) or ``kl`` (the binary KL)."""

    def __post_init__(self) -> None:
        if not self.delta > 0:
            raise ConfigError(f"objective.cppo.delta must be > 0, got {self.delta}")
        if not 0 < self.w_min <= 1:
            raise ConfigError(f"objective.cppo.w_min must be in (0, 1], got {self.w_min}")
        if not self.budget >= 0:
            raise ConfigError(f"objective.cppo.budget must be >= 0, got {self.budget}")


@dataclass
class ObjectiveConfig:
    kind: ObjectiveKind = "sft"
    """``sft``: weighted next-token loss (``normalisation``, ``policy``). ``grpo`` / ``ppo``: the clipped
    policy-gradient objective (docs/RL.md) with advantages from ``estimator``; they differ only in the
    default estimator (``grpo``: group-relative ``grpo``; ``ppo``: ``given``, advantages from the data).
    ``distill``: the student's divergence from ``teacher`` (``distill``); ``dpo``: preference pairs (``dpo``)."""
    normalisation: Normalisation = "token_mean"
    """SFT: ``token_mean`` (over the global batch), ``sequence_mean`` or ``sum``."""
    policy: WeightPolicy = "exact"
    """SFT: ``exact`` (the flat baseline's objective) or ``dedup`` (each distinct token once)."""
    estimator: Estimator = ""
    """RL advantage estimator: ``grpo``, ``rloo``, ``treepo``, ``tempo`` or ``given`` ("": the kind's
    default); docs/RL.md compares them."""
    normalise_advantages: bool = False
    """Divide advantages by the reward standard deviation (``grpo`` and ``tempo``: of the group;
    ``treepo``: of the batch). Off: Dr. GRPO's unnormalised advantages. ``gae``: whiten the per-token advantages
    over the step's trained tokens (mean 0, std 1; the critic's returns use them before whitening)."""
    tempo_coef: float = 1.0
    """``tempo``: coefficient of the branch-gated TD term, ``A_t = a_i + tempo_coef * (V(s_<=t) - V(s_<t))``
    at branching tokens (docs/RL.md); 0 gives exactly GRPO."""
    aggregation: Aggregation = "token_mean"
    """RL loss aggregation: ``token_mean`` (over the step's trained tokens), ``seq_mean_token_mean``,
    ``seq_mean_token_sum`` or ``token_sum_norm`` (divide by ``aggregation_constant``)."""
    aggregation_constant: float = 0.0
    """The constant normaliser of ``token_sum_norm`` (> 0 there, e.g. the generation budget)."""
    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at ``1 - eps_low`` (in [0, 1))."""
    eps_high: float = 0.2
    """Upper clip range: the ratio is clipped at ``1 + eps_high`` (DAPO's clip-higher uses 0.28)."""
    dual_clip: float = 0.0
    """Dual clip constant ``c > 1`` bounding the loss of negative advantages (0: off)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the reference policy (0: no reference model is built)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator: ``k1``, ``k2`` or ``k3``."""
    reference: str = ""
    """Reference policy for the KL term: a model config JSON, HF directory or hub id ("": ``model.source`` at
    ``model.seed``, the initial policy). Kept frozen: whole on every rank, or with ``model.zero_init``
    a ZeRO-3 engine partitioned over the ranks (``ds_tree.engine.reference``), in every layout (packed
    rows, sequence-parallel shards, dfs walks: its forwards padded to the busiest rank's count)."""
    reference_offload: bool = False
    """With ``model.zero_init``: keep the partitioned reference's parameters in CPU memory (ZeRO-3
    ``offload_param``), gathered to the accelerator module by module in its forwards."""
    reference_step: int = 0
    """The KL reference becomes the policy as it is after this many training steps (its weights
    copied at the end of step ``reference_step``; the steps before penalise against the initial
    policy as usual; 0: never). Set it to ``rollout.env.warmup_steps`` to hold RL near the warm-up's
    policy instead of the random initial one (docs/ENVIRONMENTS.md). Checkpoints saved from that
    step on carry the copy (``reference_policy.pt``), so a resumed run penalises against the same
    policy. Needs ``kl_coef > 0``; not with ``reference`` (the initial policy is the one replaced)
    nor with ``model.lora`` (there the reference is the adapters switched off)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus."""
    old_logprobs: OldLogprobs = "recompute"
    """``recompute``: the old policy's log-probs come from a no-grad tree forward at the start of each
    step; ``data``: from the trajectories' sampler ``logprobs`` (trajectories sharing a token must agree)."""
    importance_truncation: float = 0.0
    """Truncated importance weight ``min(pi_old / pi_sampler, C)`` on each token's advantage, with the
    sampler's log-probs from the data (0: off)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts (old log-probs stay those of the step's start)."""
    mini_batches: int = 1
    """Optimizer updates per epoch: the step's groups are cut into this many mini-batches."""
    self_check: str = "first"
    """Tree-vs-flat check inside the run (docs/LORA.md, "Self-check"): ``off``, ``first`` (the first
    step of the run) or ``every:N`` (steps 1, N+1, 2N+1, ...). On a small sample of the step's groups the
    flat per-trajectory loss and gradient are compared with the tree's; errors beyond the dtype's
    tolerance stop the run."""
    gamma: float = 1.0
    """``gae``: the discount per trained token, in (0, 1]."""
    lam: float = 0.95
    """``gae``: GAE's ``lambda``, in [0, 1] (1: the discounted return minus the value; 0: one-step TD)."""
    critic: CriticSettings = field(default_factory=CriticSettings)
    """``gae``'s learned value model (``objective.critic.source`` is required with ``estimator: gae``)."""
    teacher: str = ""
    """``distill``: the teacher, a model config JSON (random init at ``model.seed``), HF directory or hub id with
    the student's tokenizer (checked before any model is built: its vocabulary, and its tokenizer files
    against ``model.tokenizer`` where both have them). Frozen, whole on every rank or with ``model.zero_init``
    partitioned as the KL reference is, in every layout."""
    distill: DistillSettings = field(default_factory=DistillSettings)
    dpo: DPOSettings = field(default_factory=DPOSettings)
    cppo: CPPOConfig = field(default_factory=CPPOConfig)
    """RL: CPPO's prefix-budget mask instead of the ratio clip (``objective.cppo.enabled``)."""

    def __post_init__(self) -> None:
        from ds_tree.losses.sft import check_objective

        try:
            check_objective(self.normalisation, self.policy)
        except ValueError as error:
            raise ConfigError(f"objective: {error}") from None
        given = off_default(self)
        if self.kind == "sft" and self.estimator == "grpo":  # config.yaml files of earlier SFT runs record the
            given.remove("estimator")  # estimator default resolved as below: grpo
        stray = objective_strays(self.kind, given)
        if stray:
            raise ConfigError(
                f"objective.{', objective.'.join(stray)}: only with objective.kind {kinds_reading(stray[0])} "
                f"(kind is {self.kind})"
            )
        if self.kind == "distill" and not self.teacher:
            raise ConfigError("objective.kind distill needs objective.teacher (a model config, directory or hub id)")
        clipped = [name for name in ("eps_low", "eps_high", "dual_clip") if name in given]
        if self.kind == "distill" and self.distill.loss != "reverse_kl_sampled" and clipped:
            raise ConfigError(
                f"objective.{', objective.'.join(clipped)}: the ratio clip applies to objective.distill.loss "
                f"reverse_kl_sampled only (loss is {self.distill.loss}: a divergence, no ratio)"
            )
        if self.aggregation_constant and self.aggregation != "token_sum_norm":
            raise ConfigError(
                f"objective.aggregation_constant ({self.aggregation_constant}) applies to aggregation "
                f"token_sum_norm only (aggregation is {self.aggregation})"
            )
        if not self.estimator and self.kind not in KIND_FIELDS:  # distill and dpo have no estimator
            self.estimator = "given" if self.kind == "ppo" else "grpo"
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ConfigError(
                f"objective: eps_low must be in [0, 1) and eps_high >= 0, got {self.eps_low}, {self.eps_high}"
            )
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"objective.dual_clip must be > 1 (or 0: off), got {self.dual_clip}")
        if self.aggregation == "token_sum_norm" and self.aggregation_constant <= 0:
            raise ConfigError("objective.aggregation token_sum_norm needs objective.aggregation_constant > 0")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.importance_truncation < 0:
            raise ConfigError("objective.kl_coef, entropy_coef and importance_truncation must be >= 0")
        if self.reference_step < 0:
            raise ConfigError(f"objective.reference_step must be >= 0 (0: never), got {self.reference_step}")
        if self.reference_step and not self.kl_coef:
            raise ConfigError(
                f"objective.reference_step ({self.reference_step}) sets the reference of the KL term: "
                "it needs objective.kl_coef > 0"
            )
        if self.reference_step and self.reference:
            raise ConfigError(
                f"objective.reference_step ({self.reference_step}) makes the reference a copy of the policy (of the "
                f"same model); leave objective.reference empty (it is {self.reference!r}), or set reference_step: 0"
            )
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ConfigError("objective.ppo_epochs and objective.mini_batches must be >= 1")
        if self.tempo_coef != 1.0 and self.estimator != "tempo":
            raise ConfigError(
                f"objective.tempo_coef ({self.tempo_coef}) applies to estimator tempo only "
                f"(estimator is {self.estimator})"
            )
        if not math.isfinite(self.tempo_coef):
            raise ConfigError(f"objective.tempo_coef must be finite, got {self.tempo_coef}")
        if abs(self.tempo_coef) > TEMPO_COEF_MAX:  # else the advantages overflow, blamed on the rewards
            raise ConfigError(
                f"objective.tempo_coef ({self.tempo_coef:g}) scales the value differences added to the advantages: "
                f"at most {TEMPO_COEF_MAX:g} in size (larger ones overflow the advantage statistics)"
            )
        self_check_every(self.self_check)  # a ConfigError when malformed
        if self.estimator in ("given", "rloo") and self.normalise_advantages:
            raise ConfigError(f"objective.normalise_advantages does not apply to the {self.estimator} estimator")
        self._check_critic()
        self._check_cppo(given)

    def _check_cppo(self, given: list[str]) -> None:
        """``objective.cppo``'s fields need it enabled; enabled, it replaces the ratio clip and is not combined with
        importance truncation."""
        if not self.cppo.enabled:
            stray = off_default(self.cppo)
            if stray and self.is_rl:
                raise ConfigError(
                    f"objective.cppo.{', objective.cppo.'.join(stray)}: only with objective.cppo.enabled: true"
                )
            return
        clipped = [name for name in ("eps_low", "eps_high", "dual_clip") if name in given]
        if clipped:
            raise ConfigError(
                f"objective.{', objective.'.join(clipped)}: CPPO's mask replaces the ratio clip "
                "(objective.cppo.enabled); leave them out"
            )
        if self.importance_truncation:
            raise ConfigError(
                "objective.importance_truncation: not combined with objective.cppo (its divergence is measured "
                "against the old policy); set it to 0 or cppo.enabled: false"
            )

    def _check_critic(self) -> None:
        """``gae`` and its critic go together; ``gamma``, ``lam`` and the critic's fields need both."""
        if not self.is_rl:
            return
        gae = self.estimator == "gae"
        if gae and not self.critic.source:
            raise ConfigError(
                "objective.estimator gae needs a learned critic: set objective.critic.source (a model config JSON, a "
                "model directory or hub id, or `policy` for a value head on the policy's trunk)"
            )
        if not gae:
            stray = [f"critic.{name}" for name in off_default(self.critic)]
            stray += [name for name in ("gamma", "lam") if getattr(self, name) != GAE_DEFAULTS[name]]
            if stray:
                raise ConfigError(
                    f"objective.{', objective.'.join(stray)}: only with objective.estimator gae (estimator is "
                    f"{self.estimator}): the critic's values are GAE's baseline"
                )
        if not (0 < self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"objective: gamma must be in (0, 1] and lam in [0, 1], got {self.gamma}, {self.lam}")

    @property
    def is_rl(self) -> bool:
        return self.kind != "sft"

    @property
    def frozen_reference(self) -> bool:
        """Whether the objective builds a frozen reference policy: DPO's, or the KL term's (``kl_coef > 0``)."""
        return self.kind == "dpo" or (self.is_rl and bool(self.kl_coef))

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per training step (1 for SFT)."""
        return self.ppo_epochs * self.mini_batches if self.is_rl else 1

    def rl_settings(self):
        """The RL loss parameters (:class:`ds_tree.losses.rl.RLSettings`)."""
        from ds_tree.losses.rl import RLSettings

        return RLSettings(
            aggregation=self.aggregation,
            aggregation_constant=self.aggregation_constant or None,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            dual_clip=self.dual_clip or None,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
            old_logprobs=self.old_logprobs,
            importance_truncation=self.importance_truncation or None,
            cppo=self.cppo_settings(),
        )

    def cppo_settings(self):
        """CPPO's parameters (:class:`ds_tree.losses.cppo.CPPOSettings`), None when it is off."""
        from ds_tree.losses.cppo import CPPOSettings

        if not self.cppo.enabled:
            return None
        c = self.cppo
        return CPPOSettings(delta=c.delta, w_min=c.w_min, budget=c.budget, divergence=c.divergence)


GAE_DEFAULTS = {"gamma": 1.0, "lam": 0.95}
"""``objective.gamma`` and ``objective.lam``'s defaults (set off them only with ``estimator: gae``)."""


def self_check_every(value: str) -> int:
    """``objective.self_check`` as a period: 0 (off), -1 (first step only) or N (``every:N``)."""
    if value == "off":
        return 0
    if value == "first":
        return -1
    prefix, _, number = value.partition(":")
    if prefix == "every" and number.isdigit() and int(number) >= 1:
        return int(number)
    raise ConfigError(f"objective.self_check must be off, first or every:N (N >= 1), got {value!r}")


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    """Peak learning rate of AdamW (> 0)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (>= 0)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's two moment decay rates, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's denominator term (> 0)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables); resolves DeepSpeed's ``gradient_clipping: auto``."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr``."""
    schedule: Schedule = "cosine"
    """``cosine`` decay to ``min_lr_ratio * lr`` at ``max_steps``, or ``constant``."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule as a fraction of ``lr``, in [0, 1]."""
    non_finite: NonFinitePolicy = "stop"
    """A step whose loss or gradient norm (RL: or reward or advantage statistics, as rewards overflowing
    float64 give) is not finite: ``stop`` ends the run with an error (nothing
    of that step is applied or saved: the last checkpoint stays the newest); ``skip`` discards the
    step's update on every rank, counts it (``optim/skipped_steps``) and goes on. Skipped steps do not
    advance the learning-rate schedule. ``skip`` needs DeepSpeed to discard the update itself, which
    it does under ZeRO stages 1-3 and bf16."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.eps <= 0:
            raise ConfigError(f"optimizer.lr and optimizer.eps must be > 0, got lr={self.lr}, eps={self.eps}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.warmup_steps < 0:
            raise ConfigError("optimizer.weight_decay, grad_clip and warmup_steps must be >= 0")
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"optimizer.betas must both be in [0, 1), got {list(self.betas)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class LoggingConfig:
    every: int = 1
    """Console line, ``metrics.jsonl`` record and trackers' metrics every N steps (>= 1; the last step is
    always logged)."""
    report_to: list[Tracker] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers that get the run's config and every metric ``metrics.jsonl`` gets (always
    written), from rank 0: any of ``tensorboard`` (event files in ``<output_dir>/tensorboard``), ``wandb``,
    ``mlflow``, ``trackio``; ``[]``: ``metrics.jsonl`` only. All but TensorBoard are optional extras
    (``pip install -e '.[wandb]'``), refused at the dry run when missing. A resumed run continues the
    trackers' runs (``<output_dir>/trackers.json``; :mod:`ds_tree.run.trackers`, docs/LAUNCH.md)."""
    project: str = "ds_tree"
    """The W&B project, MLflow experiment or trackio project of the run (not used by TensorBoard)."""
    run_name: str = ""
    """The run's name in W&B, MLflow and trackio ("": ``output_dir`` as written in the config)."""
    progress_bar: bool = True
    """A tqdm bar on rank 0 when stderr is a terminal (none in log files and pipes); the step lines print above it."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"logging.every must be >= 1, got {self.every}")
        twice = sorted({name for name in self.report_to if self.report_to.count(name) > 1})
        if twice:
            raise ConfigError(f"logging.report_to names {', '.join(twice)} twice")
        if not self.project:
            raise ConfigError("logging.project must not be empty")
        named = [name for name in ("project", "run_name") if name in off_default(self)]
        if named and not set(self.report_to) - {"tensorboard"}:
            raise ConfigError(
                f"logging.{', logging.'.join(named)}: only W&B, MLflow and trackio runs have names; add one of "
                f"wandb, mlflow, trackio to logging.report_to (it is {self.report_to}) or leave them out"
            )


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept up to the newest one saved; older ones are deleted after a save.
    Checkpoints newer than the step a run resumed from are never deleted."""
    resume: ResumePolicy = "auto"
    """Where a run starts, given ``<output_dir>/checkpoints``. A checkpoint is complete once every rank
    has written it (rank 0 then writes its ``ds_tree_checkpoint.json`` and renames it into place);
    ``latest`` names the newest complete one. ``auto``: resume from ``latest``; start from step 0 when
    there is no checkpoint at all; a ``latest`` that is missing (with checkpoints present), unreadable
    or names anything but a complete checkpoint of that directory is an error listing the complete
    checkpoints. ``latest``: as ``auto``, but a run with nothing to resume from is an error.
    ``newest_complete``: resume from the newest complete checkpoint, whatever ``latest`` says.
    ``never``: start from step 0; an error if complete checkpoints exist (they would be overwritten)."""
    export_hf: bool = True
    """Write the final model as a Hugging Face directory (safetensors) in ``<output_dir>/hf``. With
    ``model.lora``: a PEFT adapter directory in ``<output_dir>/adapter`` (and ``hf`` with ``merge``)."""
    merge: bool = False
    """With ``model.lora`` and ``export_hf``: also write the merged model (adapters added into the base
    weights) to ``<output_dir>/hf``, a plain Hugging Face model."""
    preempt_signals: list[PreemptSignal] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that stop a run cleanly (SLURM preemption, ``scancel``, ``timeout``; docs/LAUNCH.md): every
    rank finishes its current step, the step is saved as a complete checkpoint, and each rank exits
    with code 75 (re-run to resume). A signal reaching one rank stops them all. A second signal (2 s or
    more after the first) or ``preempt_grace_s`` exits at once with 128 + the signal's number, the last
    complete checkpoint unchanged. ``[]``: signals keep their default action (the process ends)."""
    preempt_grace_s: float = 600.0
    """Seconds from the first preemption signal to the forced exit; keep it below what the scheduler
    allows before its SIGKILL (SLURM: the ``GRACE`` of ``--signal=B:USR1@GRACE``, ``KillWait`` or
    ``GraceTime`` of a preemption)."""
    keep_best: str = ""
    """An ``eval/`` metric the ``eval`` section produces (``eval/loss``, ``eval/reward_mean``, ``eval/pass@1``,
    ``eval/pass@K``, ``eval/TAG/...``): the checkpoint that scored best on it is kept beside the newest ones,
    named in ``<output_dir>/checkpoints/best.json``, never deleted by ``keep_last``'s rotation, and kept
    across a resume (docs/EVAL.md). Only checkpoints of evaluated steps are scored: ``every`` must be a
    multiple of ``eval.every_steps``. Empty: off."""
    best_mode: BestMode = "auto"
    """Whether ``keep_best``'s metric is better ``max`` or ``min``; ``auto``: ``min`` for a loss, ``max``
    otherwise."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep_last >= 1")
        if self.preempt_grace_s <= 0:
            raise ConfigError(f"checkpoint.preempt_grace_s must be > 0, got {self.preempt_grace_s}")
        if self.best_mode != "auto" and not self.keep_best:
            raise ConfigError(f"checkpoint.best_mode ({self.best_mode}) is keep_best's: set checkpoint.keep_best")

    def best_direction(self) -> str:
        """``max`` or ``min``: how ``keep_best``'s metric improves (``auto``: ``min`` for a loss)."""
        if self.best_mode != "auto":
            return self.best_mode
        return "min" if self.keep_best.rsplit("/", 1)[-1] == "loss" else "max"


@dataclass
class DistributedConfig:
    timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before the process group fails it. A rank
    that stops (hangs, or is suspended) without exiting holds every other rank in its next
    collective until then. It must cover the longest gap between two collectives: a checkpoint save,
    the Hugging Face export (rank 0 writes while the others wait), the first step's kernel builds."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"distributed.timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class VLLMRolloutConfig:
    """``rollout.vllm``: the vLLM server of ``rollout.engine: vllm`` (docs/ROLLOUTS.md, *Sampling engines*)."""

    url: str | list[str] = ""
    """Existing servers: one URL (``http://host:port``) or a list of them; each needs ``VLLM_SERVER_DEV_MODE=1``
    for weight sync and the policy's model and tokenizer, checked at start. With several, each prompt's tree goes
    to one of them (docs/ROLLOUTS.md, *Several servers*). Empty: rank 0 starts ``servers`` of its own from
    ``.venv-vllm`` (each its own process group, stopped when the run ends or fails)."""
    servers: int = 1
    """Managed servers rank 0 starts (``url`` empty), each its own process on its own port."""
    model_name: str = ""
    """The served model name on ``url`` (empty: the managed server's name)."""
    timeout_s: float = 120.0
    """Seconds one request may take before it is retried (``retries`` times), then the step fails."""
    retries: int = 2
    """Retries of a request that got no answer (refused, reset, timed out)."""
    startup_timeout_s: float = 900.0
    """Seconds a managed server may take to come up (model load, KV cache allocation)."""
    gpu_memory_utilization: float = 0.1
    """vLLM's memory fraction; on the CPU backend the fraction of *CPU* memory it reserves (0.1 for tiny models)."""
    max_model_len: int = 0
    """Longest sequence the managed server accepts; 0: ``packing.budget``."""
    prefix_caching: bool = True
    """The server's automatic prefix caching (shared tree prefixes computed once)."""
    probe_tolerance: float = 1e-3
    """Largest |server - trainer| log-prob on the start-up probe before the server is refused as another model."""
    python: str = ""
    """vLLM's Python (empty: ``.venv-vllm/bin/python`` of the checkout, or ``$DS_TREE_VLLM_PYTHON``)."""

    def urls(self) -> list[str]:
        """``url`` as a list: the existing servers (none: managed ones)."""
        return [self.url] if isinstance(self.url, str) and self.url else list(self.url or [])

    def _check_servers(self) -> None:
        """``servers`` >= 1; ``servers`` > 1 only for managed servers; a list of distinct, non-empty URLs."""
        if self.servers < 1:
            raise ConfigError(f"rollout.vllm.servers must be >= 1, got {self.servers}")
        urls = self.urls()
        if urls and self.servers > 1:
            raise ConfigError(
                f"rollout.vllm.servers ({self.servers}) starts managed servers and rollout.vllm.url names existing "
                "ones: set one of them (list every server in rollout.vllm.url, or leave it empty)"
            )
        for index, url in enumerate(urls):
            if not isinstance(url, str) or not url:
                raise ConfigError(f"rollout.vllm.url[{index}] must be a non-empty URL, got {url!r}")
            if url.rstrip("/") in (u.rstrip("/") for u in urls[:index]):
                raise ConfigError(f"rollout.vllm.url[{index}] ({url}) is listed twice: each server once")

    def __post_init__(self) -> None:
        for name in ("timeout_s", "startup_timeout_s", "probe_tolerance"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"rollout.vllm.{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0 or self.max_model_len < 0:
            raise ConfigError("rollout.vllm.retries and rollout.vllm.max_model_len must be >= 0")
        self._check_servers()
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"rollout.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass
class RolloutConfig(SamplerSettings):
    """Online RL (docs/RL.md, *Online RL*): each step samples its groups from the current policy, with the
    sampler's settings (:class:`~ds_tree.sampling.settings.SamplerSettings`: ``segment_length``,
    ``branching``, ``max_depth``, ``width``, ``max_new_tokens``, ``temperature``, ``top_p``,
    ``repetition_ngram``, ``logprob_floor``, ``refill``, ``independent``) as fields of this section."""

    enabled: bool = False
    """Sample, score and train each step (``data.path`` must then be empty); needs an RL ``objective``
    whose estimator uses rewards and ``model.tokenizer`` (prompts are encoded, completions decoded)."""
    prompts: str = ""
    """Prompts JSONL: one ``{"prompt": text}`` or ``{"prompt_ids": [ids]}`` a line, with an optional
    ``"metadata": {...}`` object handed to the reward function (the answer, the puzzle's numbers)."""
    reward: str = ""
    """Reward function: a name in :data:`ds_tree.registries.REWARDS` (``game24``, ``exact_match``) or a
    ``package.module:function`` taking a ``RewardRequest`` (importable on every rank)."""
    prompts_per_step: int = 4
    """Prompts per training step over all ranks, each sampled as one tree (one group)."""
    seed: int = 0
    """Seed of the prompt order (reshuffled each pass over the prompts) and, with the step and the
    prompt's slot in it, of the slot's sampling generator: a resumed run samples what an uninterrupted
    one would have, without generator state in the checkpoint."""
    env: EnvSettings = field(default_factory=EnvSettings)
    """Multi-turn rollouts against an environment (docs/ENVIRONMENTS.md); off while ``env.path`` is empty."""
    engine: SamplingEngine = "hf"
    """Where groups are sampled, a :data:`ds_tree.registries.SAMPLING_ENGINES` name: ``hf`` (a gathered copy
    of the policy on every rank) or ``vllm`` (a vLLM server, ``rollout.vllm``; weights synced every
    ``sync_every`` optimizer steps). What each can do (images, hybrid models, sampling ahead) is checked here."""
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)
    max_staleness: int = 0
    """Steps sampling runs ahead of training (asynchronous RL, ``engine: vllm``): step ``s`` is sampled with
    the weights synced at or before step ``s - max_staleness`` while the ranks train the steps before it;
    0: every step samples from the weights after the step before (docs/ROLLOUTS.md, *Asynchronous steps*)."""
    sync_every: int = 1
    """Optimizer steps between weight syncs into the sampling engine (1: after every step). A step samples
    with the last synced weights, so a trajectory may be up to ``max_staleness + sync_every - 1`` steps old."""

    def __post_init__(self) -> None:
        """The ranges of the fields, checked whether or not ``enabled`` (a value out of range is an
        error even while it is unused)."""
        if self.prompts_per_step < 1:
            raise ConfigError(f"rollout.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.max_staleness < 0 or self.sync_every < 1:
            raise ConfigError(
                f"rollout.max_staleness must be >= 0 and rollout.sync_every >= 1, got {self.max_staleness} and "
                f"{self.sync_every}"
            )
        if self.logprob_floor > 0:
            raise ConfigError(f"rollout.logprob_floor must be <= 0 (0: off), got {self.logprob_floor}")
        try:
            super().__post_init__()
        except ValueError as error:
            raise ConfigError(f"rollout: {error}") from None

    def sampler_settings(self) -> SamplerSettings:
        """The sampler's fields of this section, as the sampler takes them."""
        kind = TurnBranchedSettings if self.env.turn_branching else SamplerSettings
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplerSettings)})

    def quota_rule_applies(self) -> bool:
        """``rollout.env.turn_branching`` replaces the quota rule of ``branching`` and ``max_depth``."""
        return not self.env.turn_branching

    def check_with(self, config: Config) -> None:
        """What an enabled rollout section needs from itself and from the rest of the config."""
        if not self.prompts:
            raise ConfigError("rollout.prompts is required with rollout.enabled (a prompts JSONL)")
        if self.env.path:
            from ds_tree.rollout.episodes.tasks import check_env_config

            check_env_config(config)
        else:
            configured(REWARDS, self.reward)
        if config.data.path:
            raise ConfigError("data.path must be empty with rollout.enabled: each step's data is sampled")
        objective = config.objective
        if objective.kind == "dpo":
            raise ConfigError(
                "rollout.enabled: objective.kind dpo trains on preference pairs of data.path (ds-tree convert --format "
                "preference, or trees with rewards); set rollout.enabled: false, or objective.kind grpo or distill"
            )
        if not objective.is_rl or objective.estimator == "given":
            raise ConfigError(
                "rollout.enabled needs objective.kind grpo or ppo with a reward-based objective.estimator "
                f"(grpo, rloo, treepo, tempo), or distill; got kind {objective.kind!r}, estimator "
                f"{objective.estimator!r}"
            )
        if objective.mini_batches > self.prompts_per_step:
            raise ConfigError(
                f"objective.mini_batches ({objective.mini_batches}) is more than rollout.prompts_per_step "
                f"({self.prompts_per_step}): a mini-batch is a set of whole groups"
            )
        if not config.model.tokenizer:
            raise ConfigError("rollout.enabled needs model.tokenizer (prompts are encoded, completions decoded)")
        from ds_tree.rollout.ahead import check_staleness_config
        from ds_tree.rollout.loop import check_engine_config

        check_staleness_config(config)
        check_engine_config(config)


@dataclass
class EvalConfig:
    """Evaluation on held-out data and tasks (docs/EVAL.md): every ``every_steps`` steps and at the run's
    end, and with ``ds-tree eval`` on any checkpoint or model. Off while ``data`` and ``prompts`` are empty.
    Its metrics (``eval/...``) go to ``metrics.jsonl`` and every tracker; it never changes the training
    run's random streams (a run with it trains exactly as one without)."""

    every_steps: int = 0
    """Evaluate after every N-th step (0: only after the last); the run's last step is always evaluated."""
    data: str = ""
    """Held-out tokens JSONL or converted dataset (``tools/convert.py``): ``eval/loss``, its exact tree-packed
    loss with the training objective's normalisation (no gradient), with ``eval/tree_tokens`` and
    ``eval/flat_tokens``. A converted dataset must be of ``model.tokenizer`` (or ``data.path``'s)."""
    prompts: str = ""
    """Held-out prompts JSONL (``rollout.prompts``' format, scored by ``rollout.reward``) or, with
    ``rollout.env.path``, held-out tasks of the environment; an optional ``"tag"`` per line gives the
    ``eval/TAG/`` breakdown. Sampled on ``rollout.engine`` with the policy's current weights: needs online
    RL (``rollout.enabled``)."""
    samples: int = 4
    """Completions (episodes) sampled per prompt (task), independently: ``n`` of pass@k."""
    pass_k: int = 0
    """The k of ``eval/pass@K`` (1 <= k <= samples; 0: ``samples``), by the unbiased estimator
    ``1 - C(n - c, k) / C(n, k)`` over ``n`` samples with ``c`` successes."""
    success_threshold: float = 1.0
    """A sample succeeds (pass@k) when its reward is at least this."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy (then every sample of a prompt is the same: use ``samples: 1``)."""
    max_new_tokens: int = 0
    """Longest completion (multi-turn: turn), in tokens; 0: ``rollout.max_new_tokens``."""
    seed: int = 0
    """With the step and the prompt's index, the seed of each prompt's own sampling generator (never the
    training run's generators)."""
    save_samples: bool = True
    """Write every evaluation's samples to ``<output_dir>/eval/step_<N>.jsonl`` (rank 0)."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.max_new_tokens < 0:
            raise ConfigError(
                f"eval.every_steps and eval.max_new_tokens must be >= 0, got {self.every_steps}, {self.max_new_tokens}"
            )
        if self.samples < 1:
            raise ConfigError(f"eval.samples must be >= 1 (completions per prompt), got {self.samples}")
        if not 0 <= self.pass_k <= self.samples:
            raise ConfigError(
                f"eval.pass_k must be in [1, eval.samples] (0: samples), got {self.pass_k} with samples {self.samples}"
            )
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0 (0: greedy), got {self.temperature}")
        stray = [name for name in off_default(self) if name not in ("data", "prompts")]
        if not self.enabled and stray:
            raise ConfigError(
                f"eval.{', eval.'.join(stray)}: only with eval.data or eval.prompts; set one or leave them out"
            )
        sampling = ("samples", "pass_k", "success_threshold", "temperature", "max_new_tokens", "seed")
        stray = [name for name in stray if name in sampling]
        if self.data and not self.prompts and stray:
            raise ConfigError(f"eval.{', eval.'.join(stray)}: only with eval.prompts (sampled tasks); leave them out")

    @property
    def enabled(self) -> bool:
        return bool(self.data or self.prompts)

    @property
    def k(self) -> int:
        """The k of ``eval/pass@K``."""
        return self.pass_k or self.samples

    def metrics(self) -> list[str]:
        """The scores it produces (without the per-tag ones): what ``checkpoint.keep_best`` may name."""
        names = ["eval/loss"] if self.data else []
        if self.prompts:
            names += ["eval/reward_mean", "eval/pass@1", f"eval/pass@{self.k}"]
        return list(dict.fromkeys(names))

    def check_with(self, config: Config) -> None:
        """What the section needs from the rest of the config: sampled tasks an online run's reward or
        environment and engine, holding the current weights; a ``checkpoint.keep_best`` it scores."""
        rollout = config.rollout
        if self.prompts and not rollout.enabled:
            raise ConfigError(
                "eval.prompts needs rollout.enabled: the reward (rollout.reward) or environment (rollout.env.path) "
                "and the sampling engine (rollout.engine) are the rollout section's"
            )
        if self.prompts and (rollout.max_staleness or rollout.sync_every != 1):
            raise ConfigError(
                f"eval.prompts samples on rollout.engine with the current weights, which rollout.max_staleness "
                f"({rollout.max_staleness}) and rollout.sync_every ({rollout.sync_every}) keep older for training: "
                "set them to 0 and 1, or evaluate checkpoints with ds-tree eval"
            )
        best = config.checkpoint.keep_best
        if not best:
            return
        if not self.enabled:
            raise ConfigError(f"checkpoint.keep_best ({best}) needs an eval section (eval.data or eval.prompts)")
        if not best.startswith("eval/") or not (best in self.metrics() or self.prompts and best.count("/") == 2):
            raise ConfigError(
                f"checkpoint.keep_best: no evaluation produces {best!r}; the eval section gives "
                f"{', '.join(self.metrics())}" + (" and eval/TAG/... per tag of eval.prompts" if self.prompts else "")
            )
        every = config.checkpoint.every
        if every and (not self.every_steps or every % self.every_steps):
            raise ConfigError(
                f"checkpoint.keep_best scores the checkpoints of evaluated steps: checkpoint.every ({every}) must be a "
                f"multiple of eval.every_steps ({self.every_steps}; 0: only the last step is evaluated)"
            )


@dataclass
class ParallelConfig:
    sequence_parallel_size: int = 1
    """Ranks per sequence-parallel group (Ulysses, docs/DESIGN.md section 5). With S > 1 the ranks
    form data-parallel x sequence-parallel groups of S consecutive ranks; a tree whose longest path
    is over ``packing.budget`` goes to sequence-parallel rows of up to S x ``packing.budget`` tokens,
    each cut into S contiguous shards, one per rank of a group. The world size and the model's
    attention heads must be multiples of S, and its key/value heads must divide S or be a multiple
    of it (checked at start-up). Any objective (SFT and RL, docs/RL.md "Long trees"). With
    ``packing.mode: dfs`` every tree is walked by a group instead, each chunk sharded over its S ranks
    (``packing.over_budget: dfs``: trees over the budget walked by a group, the rest packed per rank,
    in one plan)."""

    def __post_init__(self) -> None:
        if self.sequence_parallel_size < 1:
            raise ConfigError(f"parallel.sequence_parallel_size must be >= 1, got {self.sequence_parallel_size}")


@dataclass
class Config:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    """The training data; required unless ``rollout.enabled`` (then its trees are sampled each step)."""
    deepspeed: str = "configs/ds/zero3.json"
    """DeepSpeed JSON; its ``auto`` values are resolved from this config."""
    output_dir: str = "runs/default"
    """TensorBoard logs, metrics.jsonl, checkpoints and the exported model go here. It must be a
    directory that can be created or written (checked before any model is built). ``config.yaml``
    records the first run's config; a resumed run whose config differs adds ``config.<N>.yaml``."""
    max_steps: int = 100
    """Optimizer steps. Resuming needs ``max_steps`` >= the checkpoint's step."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out loss and task success (docs/EVAL.md); off unless ``eval.data`` or ``eval.prompts`` is set."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.optimizer.warmup_steps > self.max_steps:
            logging.getLogger(__name__).warning(
                "optimizer.warmup_steps (%d) is more than max_steps (%d): the whole run trains in the warm-up, "
                "at most %.3g x optimizer.lr",
                self.optimizer.warmup_steps,
                self.max_steps,
                self.max_steps / self.optimizer.warmup_steps,
            )
        self._refuse_settings_that_cannot_apply()
        partitioned = self.objective.frozen_reference and self.model.zero_init and not self.model.lora.enabled
        if self.objective.reference_offload and not partitioned:
            raise ConfigError(
                "objective.reference_offload offloads the partitioned reference model: it needs objective.kl_coef > 0 "
                "(or objective.kind dpo) and model.zero_init: true"
            )
        if self.checkpoint.merge and not self.model.lora.enabled:
            raise ConfigError("checkpoint.merge merges LoRA adapters: set model.lora.rank > 0, or merge: false")
        if self.objective.reference_step and self.objective.reference_step >= self.max_steps:
            raise ConfigError(
                f"objective.reference_step ({self.objective.reference_step}) leaves no step to penalise against "
                f"the copied policy: it must be less than max_steps ({self.max_steps})"
            )
        if self.objective.reference_step and self.model.lora.enabled:
            raise ConfigError(
                "objective.reference_step: with model.lora the KL reference is the model with its adapters "
                "disabled, not a copy; set objective.reference_step: 0"
            )
        if self.model.lora.enabled and self.objective.reference:
            raise ConfigError(
                "objective.reference: with model.lora the KL reference is the model with its adapters disabled; "
                "leave objective.reference empty"
            )
        if self.model.lora.dropout and self.objective.self_check != "off":
            raise ConfigError(
                "model.lora.dropout > 0 draws different masks in the tree and in the flat baseline, so "
                "objective.self_check cannot compare them: set objective.self_check: off or model.lora.dropout: 0"
            )
        if self.rollout.enabled:
            self.rollout.check_with(self)
        elif not self.data.path:
            raise ConfigError("data.path is required")
        if not self.output_dir:
            raise ConfigError("output_dir is required")
        self.eval.check_with(self)

    def _refuse_settings_that_cannot_apply(self) -> None:
        """The one rule (as for the objective's fields): a field set off its default where nothing would
        read it is an error naming it and what would make it apply, never silently ignored."""
        lora = self.model.lora
        if not lora.enabled:
            stray = off_default(lora)
            if stray:
                raise ConfigError(
                    f"model.lora.{', model.lora.'.join(stray)}: only with LoRA adapters; set model.lora.rank > 0 "
                    "or leave them out"
                )
        if self.checkpoint.merge and not self.checkpoint.export_hf:
            raise ConfigError(
                "checkpoint.merge writes the merged model in the export: it needs checkpoint.export_hf: true"
            )
        packing = self.packing
        walks = packing.mode == "dfs" or (packing.mode == "tree" and packing.over_budget == "dfs")
        if not walks:
            stray = [name for name in ("dfs_chunk", "dfs_recompute") if name in off_default(packing)]
            if stray:
                raise ConfigError(
                    f"packing.{', packing.'.join(stray)}: only with dfs walks; set packing.mode: dfs (or mode: tree "
                    f"with over_budget: dfs), or leave them out (mode is {packing.mode}, over_budget "
                    f"{packing.over_budget})"
                )
        rollout = self.rollout
        if not rollout.enabled:
            nested = ("enabled", "env", "vllm")
            stray = [f"rollout.{name}" for name in off_default(rollout) if name not in nested]
            stray += [f"rollout.vllm.{name}" for name in off_default(rollout.vllm)]
            stray += [f"rollout.env.{name}" for name in off_default(rollout.env)]
            if stray:
                raise ConfigError(
                    f"{', '.join(stray)}: only with online RL; set rollout.enabled: true or leave them out"
                )
        env = rollout.env
        if not env.path:
            stray = off_default(env)
            if stray:
                raise ConfigError(
                    f"rollout.env.{', rollout.env.'.join(stray)}: only with multi-turn episodes; set rollout.env.path "
                    "or leave them out"
                )
        if env.warmup_lr and not env.warmup_steps:
            raise ConfigError(
                f"rollout.env.warmup_lr ({env.warmup_lr}) is the learning rate of the warm-up steps: set "
                "rollout.env.warmup_steps > 0, or leave warmup_lr out"
            )
        if env.turn_branching:
            if rollout.independent:
                raise ConfigError(
                    "rollout.env.turn_branching: rollout.independent forks every episode at the prompt; set "
                    "independent: false or leave turn_branching out"
                )
            if env.fork == "none":
                raise ConfigError(
                    "rollout.env.turn_branching: rollout.env.fork none forks at the prompt only; set fork: copy or "
                    "replay, or leave turn_branching out"
                )
            late = [
                (turn, count) for turn, count in enumerate(env.turn_branching) if count > 1 and turn >= env.max_turns
            ]
            if late:
                turn, count = late[0]
                raise ConfigError(
                    f"rollout.env.turn_branching {env.turn_branching} forks {count} ways at turn boundary {turn}, but "
                    f"rollout.env.max_turns ({env.max_turns}) ends every episode before it (boundaries "
                    f"0..{env.max_turns - 1} fork): raise max_turns or fork earlier"
                )


def off_default(section: Any) -> list[str]:
    """The fields of the dataclass instance ``section`` whose values differ from their defaults."""
    names = []
    for item in dataclasses.fields(section):
        if item.default is not dataclasses.MISSING:
            default = item.default
        elif item.default_factory is not dataclasses.MISSING:
            default = item.default_factory()
        else:
            continue
        value = getattr(section, item.name)
        if isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        if value != default:
            names.append(item.name)
    return names


# Keys a release replaced: a config that still names one is told what to write instead.
REPLACED_KEYS = {
    "logging.tensorboard": "logging.report_to (a list of trackers: `[tensorboard]` for true, `[]` for false)",
}


def _build(cls: type, values: Any, where: str, prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: {prefix or 'the top level'} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        name = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        if name in REPLACED_KEYS:
            raise ConfigError(f"{where}: {name} was replaced by {REPLACED_KEYS[name]}")
        raise ConfigError(f"{where}: unknown key {name!r} (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        dotted = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, where, dotted)
        else:
            kwargs[name] = _coerce(hint, value, where, dotted)
    missing = [n for n, f in fields.items() if dataclasses.is_dataclass(hints[n]) and n not in values]
    for name in missing:
        if fields[name].default_factory is dataclasses.MISSING:  # a required section
            raise ConfigError(f"{where}: missing section {(prefix + '.' if prefix else '') + name!r}")
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _coerce(hint: Any, value: Any, where: str, dotted: str) -> Any:
    """``value`` checked against the field type ``hint`` (and converted where YAML needs it)."""
    origin = typing.get_origin(hint)
    if origin is UnionType and type(None) in typing.get_args(hint):  # optional: null or the other type
        if value is None:
            return None
        (other,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        return _coerce(other, value, where, dotted)
    if origin is UnionType:  # one of several types (``str | list[str]``): the first that takes the value
        arms = typing.get_args(hint)
        for arm in arms:
            try:
                return _coerce(arm, value, where, dotted)
            except ConfigError:
                continue
        names = " or ".join(str(arm) if typing.get_origin(arm) else arm.__name__ for arm in arms)
        raise ConfigError(f"{where}: {dotted} must be {names}, got {value!r}")
    if origin is Annotated:
        base, *metadata = typing.get_args(hint)
        choices = next((m for m in metadata if isinstance(m, Choices)), None)
        value = _coerce(base, value, where, dotted)
        if choices is not None and not choices.accepts(value):
            raise ConfigError(f"{where}: {dotted} must be one of {', '.join(choices.names())}; got {value!r}")
        return value
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where}: {dotted} must be one of {', '.join(choices)}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {dotted} must be a list, got {value!r}")
        return [_coerce(typing.get_args(hint)[0], v, where, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        types = typing.get_args(hint)
        if not isinstance(value, list | tuple) or len(value) != len(types):
            raise ConfigError(f"{where}: {dotted} must be a list of {len(types)} values, got {value!r}")
        return tuple(_coerce(t, v, where, f"{dotted}[{i}]") for i, (t, v) in enumerate(zip(types, value, strict=True)))
    if hint is float:
        return _finite_float(value, where, dotted)
    if hint is str and value is False and dotted == "objective.self_check":  # YAML 1.1 reads `off` as false
        return "off"
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: {dotted} must be {hint.__name__}, got {value!r}")
    return value


def _finite_float(value: Any, where: str, dotted: str) -> float:
    number = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{where}: {dotted} must be float, got {value!r}")
    if not math.isfinite(number):
        raise ConfigError(f"{where}: {dotted} must be a finite number, got {value!r}")
    return number


def _apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key=value")
    key, raw = override.split("=", 1)
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw else ""


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (YAML), apply dotted ``key=value`` overrides, and validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: malformed YAML ({error})") from None
    for override in overrides:
        _apply_override(tree, override)
    config = _build(Config, tree, str(path), "")
    _resolve_inputs(config, path)
    return config


REPOSITORY = Path(__file__).resolve().parents[1]
INPUT_PATHS = (
    "model.source",
    "model.tokenizer",
    "data.path",
    "deepspeed",
    "objective.reference",
    "objective.critic.source",
    "objective.teacher",
    "rollout.prompts",
    "eval.data",
    "eval.prompts",
)
"""Config fields naming files the run reads (``output_dir`` is written, and stays as given)."""


def _resolve_inputs(config: Config, path: Path) -> None:
    """A relative input path that does not exist from the current directory is looked up beside
    the config file, then in the repository (``configs/tiny_cpu.yaml`` names ``configs/ds/zero3.json``,
    as ``launch/train.sh`` runs it from there), so a config works from any directory; the first
    existing candidate wins, and a path found nowhere is left as given (its check names it)."""
    for dotted in INPUT_PATHS:
        section, _, name = dotted.rpartition(".")
        owner = config
        for part in section.split(".") if section else ():
            owner = getattr(owner, part)
        value = getattr(owner, name)
        if not value or value == POLICY_TRUNK or Path(value).is_absolute() or Path(value).exists():
            continue
        for base in (path.resolve().parent, REPOSITORY):
            if (base / value).exists():
                setattr(owner, name, str(base / value))
                break


def config_to_dict(config: Config) -> dict:
    """Plain types only (tuples as lists), so ``yaml.safe_dump`` and JSON both take it."""
    return _plain(dataclasses.asdict(config))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
