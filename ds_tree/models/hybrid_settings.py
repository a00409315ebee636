"""What a hybrid model cannot do yet, refused at config time (the trainer's dry run).

Apart from :mod:`ds_tree.models.hybrid` because it needs :class:`ds_tree.config.ConfigError`, and
the config module reaches the model modules (an import cycle otherwise).
"""

from __future__ import annotations

from ds_tree.config import ConfigError
from ds_tree.models.hybrid import HYBRID_MODEL_TYPES, is_hybrid


def check_hybrid_settings(config, model_config) -> None:
    """Refuse, before anything is built, what the recurrent layers cannot do yet (a ``ConfigError``
    naming the field): the dfs walk and sequence-parallel shards would each need the recurrent and
    conv states handed from chunk to chunk / rank to rank, which is not built (a chunk or shard
    would start from a zero state: wrong gradients); online RL samples with a KV cache that is
    forked at branch points, and a recurrent state is not forked yet."""
    if not is_hybrid(model_config):
        return
    kind = HYBRID_MODEL_TYPES[model_config.get_text_config().model_type]
    what = f"{model_config.model_type} is a hybrid model ({kind} layers)"
    packing, parallel = config.packing, config.parallel
    if packing.mode == "dfs" or packing.over_budget == "dfs":
        field = "packing.mode: dfs" if packing.mode == "dfs" else "packing.over_budget: dfs"
        raise ConfigError(
            f"{field}: {what}; the dfs walk forwards a tree chunk by chunk and would have to hand each "
            "chunk's recurrent and convolution state to the next, which is not built. Use packing.mode: tree "
            "(split trees carry their ancestor path, which supplies the states)"
        )
    if parallel.sequence_parallel_size > 1 or packing.over_budget == "sequence_parallel":
        raise ConfigError(
            f"parallel.sequence_parallel_size / packing.over_budget: sequence_parallel: {what}; a shard's "
            "recurrent state would be the previous shard's final state, a sequential hand-off across the "
            "sequence-parallel group that is not built. Use parallel.sequence_parallel_size: 1 and a "
            "packing.budget that holds the longest trajectory"
        )
    if config.rollout.enabled:
        raise ConfigError(
            f"rollout.enabled: {what}; the tree sampler forks the KV cache at branch points and cannot fork "
            "a recurrent state yet. Sample offline with another model, or train offline (rollout.enabled: false)"
        )
