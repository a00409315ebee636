"""What a hybrid model cannot do yet, refused at config time (the trainer's dry run).

Apart from :mod:`ds_tree.models.hybrid`: it reads the training config's sections (packing,
parallel, rollout), which the layer's own modules never see.
"""

from __future__ import annotations

from ds_tree.errors import ConfigError
from ds_tree.models.families import family_of
from ds_tree.models.hybrid import is_hybrid
from ds_tree.registries import missing_capability


def check_hybrid_settings(config, model_config) -> None:
    """Refuse, before anything is built, what the recurrent layers cannot do (a ``ConfigError``
    naming the field): online RL samples with an engine that declares ``recurrent_models`` (``hf``: the
    in-process tree sampler forks the recurrent states, Falcon-H1's combined cache layer included).
    Packed rows, split parts, the dfs walk and sequence-parallel rows and walks (head-parallel,
    :mod:`ds_tree.models.head_parallel`) carry the states exactly."""
    if not is_hybrid(model_config):
        return
    what = f"{model_config.model_type} is a hybrid model ({family_of(model_config).recurrent.mixer} layers)"
    rollout = config.rollout
    missing = missing_capability(rollout.engine, "recurrent_models") if rollout.enabled else None
    if missing:
        raise ConfigError(f"rollout.engine: {rollout.engine}: {what}; {missing}")
