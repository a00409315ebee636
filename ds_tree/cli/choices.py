"""The choices and defaults that the commands' ``--help`` lists, importable without torch.

An extension point's choices are its registry's names (:mod:`ds_tree.registries`), read when a
command builds its parser, so an entry registered before that is offered: the functions below. The
other values are kept next to code that needs torch or transformers (model dtypes, the Triton kernel's
dtypes, the synthetic-data and tokenizer defaults); importing those modules takes seconds, so a command
builds its parser from these copies and imports the library after parsing. tests/test_cli.py asserts
that every copy equals the library's value.
"""

from __future__ import annotations

from typing import get_args

from ds_tree import config
from ds_tree.attention.engines import cpu_engines
from ds_tree.registries import AGGREGATIONS, ATTENTION_ENGINES, ESTIMATORS, OBJECTIVES, SAMPLING_ENGINES


def engines() -> tuple[str, ...]:
    """``model.attention`` / ``--attention``: ``auto`` and the registered attention engines."""
    return ATTENTION_ENGINES.choices("auto").names()


def cpu_attention_engines() -> tuple[str, ...]:
    """``bench-attention --engine``: the attention engines with a native CPU kernel (the oracle aside)."""
    return cpu_engines()


def objectives() -> tuple[str, ...]:
    """``objective.kind`` / ``--objective``."""
    return OBJECTIVES.names()


def estimators() -> tuple[str, ...]:
    """``objective.estimator`` / ``--estimator``."""
    return ESTIMATORS.names()


def aggregations() -> tuple[str, ...]:
    """``objective.aggregation`` / ``--aggregation``."""
    return AGGREGATIONS.names()


def sampling_engines() -> tuple[str, ...]:
    """``rollout.engine`` / ``sample --engine``."""
    return SAMPLING_ENGINES.names()


MODES = get_args(config.PackingMode)
"""ds_tree.packing.modes.MODES"""
NORMALISATIONS = get_args(config.Normalisation)
"""ds_tree.losses.sft.NORMALISATIONS"""
POLICIES = get_args(config.WeightPolicy)
"""ds_tree.losses.sft.POLICIES"""
KL_ESTIMATORS = get_args(config.KLEstimator)
"""ds_tree.losses.rl.KL_ESTIMATORS"""
DISTILL_LOSSES = get_args(config.DistillLoss)
"""ds_tree.losses.distill.LOSSES"""
DPO_LOSSES = get_args(config.DPOLoss)
"""ds_tree.losses.dpo.LOSSES"""
DPO_PAIRINGS = get_args(config.DPOPairs)
"""ds_tree.trees.pairs.PAIRINGS"""

MODEL_DTYPES = ("float64", "float32", "bfloat16", "float16")
"""ds_tree.models.loading.DTYPES"""
VERIFY_DTYPES = ("float64", "float32")
"""ds_tree.verify.tree_vs_flat.VERIFY_DTYPES: the dtypes with a tolerance"""
BENCH_DTYPES = ("float32", "bfloat16")
"""ds_tree.bench.steps.BENCH_DTYPES"""
KERNEL_DTYPES = ("float32", "float16", "bfloat16")
"""ds_tree.kernel.function.DTYPES"""

BLOCK = 128
"""ds_tree.attention.blocksparse.DEFAULT_BLOCK"""
HUB_MIN_KEYS = 64
"""ds_tree.attention.blocksparse.HUB_MIN_KEYS"""
HUB_MIN_QUERIES = 128
"""ds_tree.attention.blocksparse.HUB_MIN_QUERIES"""

TOKENIZER_VOCAB_SIZE = 1024
"""ds_tree.vocab.tokenizer.DEFAULT_VOCAB_SIZE"""
SYNTHETIC_SEED = 0
"""SyntheticConfig().seed (ds_tree.data.synthetic)"""
SYNTHETIC_MAX_TOKENS = 512
"""SyntheticConfig().max_tokens"""

CONVERT_FORMATS = ("chat", "tokens", "tree", "preference")
"""ds_tree.data.convert.FORMATS"""
MERGES = ("group", "global")
"""ds_tree.data.convert.MERGES"""
PREFIX_POLICIES = ("full", "drop", "error")
"""ds_tree.data.convert.PREFIX_POLICIES"""
CONVERT_DEFAULTS = {
    "format": "chat",
    "group_key": "group_id",
    "train_on": "assistant",
    "merge": "group",
    "prefix_policy": "full",
    "max_image_pixels": 40_000_000,
}
"""ds_tree.data.convert.ConvertOptions' defaults of the options convert lists"""
