"""Every extension point of ds_tree, each one :class:`~ds_tree.registry.Registry`, with its built-in entries.

The built-ins are lazy (``"package.module:attribute"``, imported on first lookup), so this module and the
names it knows are importable without torch: the config's checks (``Annotated[str, X.choices()]`` fields,
:mod:`ds_tree.config`) and the commands' ``--help`` choices (:mod:`ds_tree.cli.choices`) read
:meth:`~ds_tree.registry.Registry.names` from here, never a copy. A project adds its own component by
decorator or call on the registry (``@ESTIMATORS.register("mine")``), in a module imported before the config
is loaded; what each kind of component must provide is said where its interface is defined (the module each
registry's built-ins live in).

========================  ==========================  ===================================================
registry                  selected by                 a component is
========================  ==========================  ===================================================
ATTENTION_ENGINES         model.attention             the engine and its capabilities (ds_tree.attention)
RUNNERS                   a work item's ``kind``      how an execution kind runs (ds_tree.engine.runners)
OBJECTIVES                objective.kind              an objective's step (ds_tree.objectives)
ESTIMATORS                objective.estimator         an advantage estimator (ds_tree.losses.advantages)
AGGREGATIONS              objective.aggregation       a policy loss's token aggregation (ds_tree.losses.rl)
TURN_FORMATS              rollout.env.format          a chat family's tool-call dialect (ds_tree.turn_formats)
TRACKERS                  logging.report_to           an experiment tracker (ds_tree.run.trackers)
REWARDS                   rollout.reward              a reward function (ds_tree.rollout.rewards)
ENVIRONMENTS              rollout.env.path            an environment class (ds_tree.rollout.env)
SAMPLING_ENGINES          rollout.engine              a sampling engine (ds_tree.sampling.interface)
MODEL_FAMILIES            the model's ``model_type``  a family's spec (ds_tree.models.families)
========================  ==========================  ===================================================
"""

from __future__ import annotations

from ds_tree.errors import ConfigError
from ds_tree.registry import Registry, RegistryError, UnknownName


def _callable(what: str):
    """A registry's ``check``: a component must be callable (``what`` it must be, for the message)."""

    def check(name: str, found: object) -> None:
        if not callable(found):
            raise TypeError(f"{name!r} is not {what} (it is a {type(found).__name__})")

    return check


def _builtins(registry: Registry, entries: dict[str, str]) -> Registry:
    for name, target in entries.items():
        registry.register_lazy(name, target)
    return registry


ATTENTION_ENGINES: Registry = _builtins(
    Registry("attention engine", field="model.attention"),
    {
        "reference": "ds_tree.attention.engines:REFERENCE",
        "torch": "ds_tree.attention.engines:TORCH",
        "triton": "ds_tree.attention.engines:TRITON",
        "flex": "ds_tree.attention.engines:FLEX",
        "varlen": "ds_tree.attention.engines:VARLEN",
    },
)

RUNNERS: Registry = _builtins(
    Registry("execution kind"),
    {
        "packed": "ds_tree.engine.runners:PACKED",
        "shard": "ds_tree.engine.runners:PACKED",
        "walked": "ds_tree.engine.runners:WALKED",
        "walked_shard": "ds_tree.engine.dfs_sequence_parallel:WALKED_SHARD",
    },
)

OBJECTIVES: Registry = _builtins(
    Registry("objective", field="objective.kind"),
    {
        "sft": "ds_tree.objectives.sft:SFT",
        "grpo": "ds_tree.objectives.policy_gradient:GRPO",
        "ppo": "ds_tree.objectives.policy_gradient:PPO",
        "distill": "ds_tree.objectives.distill:Distill",
        "dpo": "ds_tree.objectives.dpo:DPO",
    },
)

ESTIMATORS: Registry = _builtins(
    Registry("advantage estimator", field="objective.estimator"),
    {
        name: f"ds_tree.losses.advantages:{name}"
        for name in ("grpo", "rloo", "treepo", "tempo", "sibling", "gae", "given")
    },
)

AGGREGATIONS: Registry = _builtins(
    Registry("loss aggregation", field="objective.aggregation"),
    {
        name: f"ds_tree.losses.rl:aggregation_{name}"
        for name in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
    },
)

TURN_FORMATS: Registry = _builtins(
    Registry("chat format", field="rollout.env.format"),
    {
        "hermes": "ds_tree.turn_formats.hermes:HermesFormat",
        "qwen3": "ds_tree.turn_formats.hermes:Qwen3Format",
        "qwen3_coder": "ds_tree.turn_formats.qwen3_coder:Qwen3CoderFormat",
        "llama3_json": "ds_tree.turn_formats.llama3:Llama3JsonFormat",
        "mistral": "ds_tree.turn_formats.mistral:MistralFormat",
        "harmony": "ds_tree.turn_formats.harmony:HarmonyFormat",
    },
)

TRACKERS: Registry = _builtins(
    Registry("tracker", field="logging.report_to"),
    {
        "tensorboard": "ds_tree.run.trackers:TensorBoardTracker",
        "wandb": "ds_tree.run.trackers:WandbTracker",
        "mlflow": "ds_tree.run.trackers:MlflowTracker",
        "trackio": "ds_tree.run.trackers:TrackioTracker",
    },
)

REWARDS: Registry = _builtins(
    Registry("reward", field="rollout.reward", paths=True, check=_callable("a function of a RewardRequest")),
    {
        "game24": "ds_tree.envs.game24:reward",
        "exact_match": "ds_tree.rollout.rewards:exact_match_reward",
    },
)

ENVIRONMENTS: Registry = _builtins(
    Registry("environment", field="rollout.env.path", paths=True, check=_callable("an environment class or factory")),
    {
        "secret_tool": "ds_tree.envs.secret_tool:SecretToolEnv",
        "tau_shop": "ds_tree.envs.tau_shop:ShopEnv",
        "gui_screens": "ds_tree.envs.gui_screens:GuiScreensEnv",
    },
)

SAMPLING_ENGINES: Registry = _builtins(
    Registry("sampling engine", field="rollout.engine"),
    {
        "hf": "ds_tree.sampling.hf_engine:HFEngine",
        "vllm": "ds_tree.sampling.vllm:VLLMEngine",
    },
)

MODEL_FAMILIES: Registry = _builtins(
    Registry("model family", field="model.source (its config's model_type)"),
    {
        "llama": "ds_tree.models.families.attention_only:LLAMA",
        "qwen2": "ds_tree.models.families.attention_only:QWEN2",
        "qwen3": "ds_tree.models.families.attention_only:QWEN3",
        "mistral": "ds_tree.models.families.attention_only:MISTRAL",
        "phi3": "ds_tree.models.families.attention_only:PHI3",
        "gemma": "ds_tree.models.families.gemma:GEMMA",
        "gemma2": "ds_tree.models.families.gemma:GEMMA2",
        "gemma3_text": "ds_tree.models.families.gemma:GEMMA3_TEXT",
        "gemma3": "ds_tree.models.families.gemma:GEMMA3",
        "gemma3n": "ds_tree.models.families.gemma:GEMMA3N",
        "paligemma": "ds_tree.models.families.gemma:PALIGEMMA",
        "mixtral": "ds_tree.models.families.mixture_of_experts:MIXTRAL",
        "qwen2_moe": "ds_tree.models.families.mixture_of_experts:QWEN2_MOE",
        "qwen3_moe": "ds_tree.models.families.mixture_of_experts:QWEN3_MOE",
        "qwen3_next": "ds_tree.models.families.gated_delta_net:QWEN3_NEXT",
        "qwen3_5_text": "ds_tree.models.families.gated_delta_net:QWEN3_5",
        "qwen3_5_moe_text": "ds_tree.models.families.gated_delta_net:QWEN3_5_MOE",
        "bamba": "ds_tree.models.families.mamba2:BAMBA",
        "nemotron_h": "ds_tree.models.families.mamba2:NEMOTRON_H",
        "falcon_h1": "ds_tree.models.families.mamba2:FALCON_H1",
        "qwen2_5_vl": "ds_tree.models.families.qwen_vl:QWEN2_5_VL",
        "qwen3_vl": "ds_tree.models.families.qwen_vl:QWEN3_VL",
    },
)


def missing_capability(engine: str, capability: str) -> str | None:
    """None when the sampling engine ``engine`` declares ``capability`` (one of the capability attributes of
    :class:`ds_tree.sampling.interface.SamplingEngine`: ``images``, ``recurrent_models``, ``logprobs``,
    ``samples_ahead``); else why it lacks it (its ``why_not``) and which engines have it, for a config error.
    Imports the engines."""
    found = SAMPLING_ENGINES.get(engine)
    if getattr(found, capability):
        return None
    why = found.why_not.get(capability, f"the {engine} engine does not declare {capability}")
    able = [name for name, other in SAMPLING_ENGINES.items() if getattr(other, capability)]
    return f"{why}; use rollout.engine: {' or '.join(able)}" if able else f"{why}; no registered engine can"


def configured(registry: Registry, name: str):
    """``registry.get(name)`` for the config field that names it: a :class:`ConfigError` that names the field
    and says why not (an unknown name lists the choices; a ``package.module:attribute`` says why it does not
    import, or what it is instead of the kind the registry holds)."""
    try:
        return registry.get(name)
    except UnknownName as error:  # it names the field and the choices
        raise ConfigError(str(error)) from None
    except (RegistryError, TypeError) as error:
        raise ConfigError(f"{registry.field} {error}") from None
