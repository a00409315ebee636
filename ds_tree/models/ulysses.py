"""Ulysses sequence parallelism with the tree attention as the core attention (docs/DESIGN.md section 5).

DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` builds the sequence-parallel groups
(``S`` consecutive ranks each) and replaces the model's registered attention function, process-wide,
by its wrapper: the wrapper exchanges q/k/v with an all-to-all (each rank then holds the whole row for
``H / S`` heads), all-gathers ``position_ids``, calls the tree attention with the other kwargs as they
came (``kv_end``: the whole row's, see :class:`~ds_tree.packing.sequence_parallel.RowShard`) and
returns to shards with a second all-to-all.

The same model also computes rows one rank holds alone. :func:`enable_sequence_parallel` therefore
gives the model a dispatcher: a query shorter than ``kv_end`` (a shard) goes through Ulysses, a query
as long as ``kv_end`` (a whole row) straight to the tree attention. A hybrid's recurrent mixers see
the same shard and whole-row ``kv_end`` and make their own head-parallel exchange
(:mod:`ds_tree.models.head_parallel`) over the group this registration built.

Gradient scale: the engine is built without DeepSpeed's ``mpu``, so ZeRO sees all ranks as one
data-parallel group and divides the summed gradient by the world size at every stage; the trainer's
loss x world size cancels that, as without sequence parallelism. Each rank backpropagates only the
loss terms predicted from its shard; the all-to-all's backward carries every term's gradient to the
ranks that hold its inputs, so the sum over ranks is the row's gradient. (With ``mpu``, DeepSpeed
divides by ``world / S`` at stages 0-2 and with ``reduce_scatter: false``, but by ``world`` under
default ZeRO-3, which reduce-scatters without the sequence-parallel correction; it would also treat
the group as model-parallel in batch sizes and checkpoint file names.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ds_tree.errors import ConfigError
from ds_tree.models.head_parallel import check_recurrent_heads
from ds_tree.models.vision import attention_implementations, is_vision_language

SUFFIX = "_sequence_parallel"
"""Added to the tree attention's name for its sequence-parallel dispatcher."""
_ENABLED: dict[tuple[str, tuple[int, int, int]], str] = {}
"""(attention name, (S, attention heads, key/value heads)) -> the dispatcher's name registered for them in this
process: ``name + SUFFIX`` for the first heads, a name with the heads for a second model's (a distillation
teacher with other heads than the student's)."""


@dataclass(frozen=True)
class SequenceParallelGroup:
    """This rank's place among the sequence-parallel groups."""

    size: int
    """Ranks per group (S)."""
    index: int
    """Which group (ranks ``index * size ..``)."""
    position: int
    """This rank's position in its group: the shard of each row it computes."""


def check_sequence_parallel(config, world_size: int, model_config) -> None:
    """What ``parallel.sequence_parallel_size`` needs, checked before any process group starts."""
    size = config.parallel.sequence_parallel_size
    if size == 1:
        if config.packing.over_budget == "sequence_parallel":
            raise ConfigError(
                "packing.over_budget=sequence_parallel shards over-budget trees over parallel.sequence_parallel_size "
                "ranks; set that size > 1 (or over_budget: dfs to walk them on one rank)"
            )
        return
    if world_size % size:
        raise ConfigError(f"parallel.sequence_parallel_size ({size}) does not divide the world size ({world_size})")
    check_heads(model_config, size, config.model.source)


def check_heads(model_config, size: int, source: str) -> None:
    """Refuse a model whose heads Ulysses cannot split over ``size`` ranks (config error naming both), a
    hybrid's recurrent heads included (:func:`~ds_tree.models.head_parallel.check_recurrent_heads`)."""
    if size == 1:
        return
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % size:
        raise ConfigError(
            f"parallel.sequence_parallel_size={size}: model.source {source} has {heads} attention heads, "
            f"not a multiple of {size}"
        )
    if kv_heads % size and size % kv_heads:
        raise ConfigError(
            f"parallel.sequence_parallel_size={size}: model.source {source} has {kv_heads} key/value heads, "
            f"which neither divide {size} nor are a multiple of it"
        )
    check_recurrent_heads(text, size, source)


def enable_sequence_parallel(model, size: int) -> SequenceParallelGroup:
    """Sequence-parallel groups of ``size`` ranks and Ulysses around ``model``'s tree attention.

    Call once the process group exists, on every rank, before the DeepSpeed engine is built. The
    model's attention becomes ``<tree engine>_sequence_parallel`` (:func:`_dispatcher`); the plain
    name stays the plain tree attention, so models built later in the process (a reference, a
    verification oracle) are not sequence-parallel. A second call in one process (a test that builds
    several engines) reuses the registration if the heads are the same.
    """
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    if not name.startswith("tree_") or SUFFIX in name:
        # Under "flex_attention" Ulysses would rebuild a causal block mask and drop the tree.
        raise ValueError(f"sequence parallelism needs a plain tree attention implementation, the model has {name!r}")
    text = model.config.get_text_config()
    key = (size, text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    dispatcher = _ENABLED.get((name, key))
    if dispatcher is None:
        core = ALL_ATTENTION_FUNCTIONS[name]
        first = not any(registered == name for registered, _ in _ENABLED)
        if first and not _groups_built(parallel_state_sp):  # it builds the groups
            UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model,
                core_attn_implementation=name,
                sequence_parallel_size=size,
                micro_batch_size=1,
                seq_length_is_variable=True,
            )
            ulysses = ALL_ATTENTION_FUNCTIONS[name]  # Ulysses took the name over, process-wide: give it back
            ALL_ATTENTION_FUNCTIONS[name] = core
        else:  # the groups exist: another head count's exchange on them
            ulysses = _ulysses_on_group(core, text)
        dispatcher = name + SUFFIX if first else f"{name}{SUFFIX}_{key[1]}_{key[2]}"
        AttentionInterface.register(dispatcher, _dispatcher(core, ulysses, size))
        _ENABLED[(name, key)] = dispatcher
    # a vision-language model's tower keeps its own attention (per image): only the language model's changes
    vision = is_vision_language(model.config)
    model.set_attn_implementation(attention_implementations(dispatcher) if vision else dispatcher)
    position = parallel_state_sp.get_sequence_parallel_rank()
    return SequenceParallelGroup(size=size, index=dist.get_rank() // size, position=position)


def _groups_built(parallel_state_sp) -> bool:
    """Whether DeepSpeed's sequence-parallel groups exist in this process."""
    try:
        return parallel_state_sp.get_sequence_parallel_group() is not None
    except AssertionError:
        return False


def _ulysses_on_group(core, text):
    """DeepSpeed's Ulysses exchange around ``core`` for a model of ``text``'s heads on the sequence-parallel
    group already built (what ``register_with_transformers`` makes, which builds the groups once only), called
    as its wrapper calls it: the attention mask dropped (the tree's is ``kv_end``)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    exchange = UlyssesSPAttentionHF(
        attn=core,
        batch_size=1,
        attn_head_count=text.num_attention_heads,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        num_hidden_layers=text.num_hidden_layers,
        process_group=parallel_state_sp.get_sequence_parallel_group(),
        seq_length_is_variable=True,
        local_seq_length=None,
        global_seq_length=None,
    )

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        return exchange(module, query, key, value, None, *args, **kwargs)

    return attention


def _dispatcher(core, ulysses, size: int):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        kv_end = kwargs.get("kv_end")
        if kv_end is None or kv_end.shape[-1] == query.shape[2]:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        if kv_end.shape[-1] != query.shape[2] * size:
            raise ValueError(
                f"a sequence-parallel shard of {query.shape[2]} tokens needs the whole row's kv_end "
                f"({query.shape[2] * size} tokens), got {kv_end.shape[-1]}"
            )
        return ulysses(module, query, key, value, attention_mask, *args, **kwargs)

    return attention
