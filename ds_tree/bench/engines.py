"""Sampling throughput of the tree sampler on the hf and vllm engines (docs/ROLLOUTS.md, *Sampling engines*).

The same model (``configs/models/tiny_llama_vllm.json`` of the repository, float32, seed 0), the
same prompts and the same tree shape on each engine; vLLM with prefix caching on and off (a managed
server each, started and stopped here). :func:`engine_throughput` yields one result per engine:
sampled tokens, seconds and tokens/s over the groups after one warm-up group.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ds_tree.config import REPOSITORY
from ds_tree.data.convert import load_tokenizer
from ds_tree.models.loading import load_model
from ds_tree.sampling.hf_engine import HFEngine
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.sampling.vllm import VLLMEngine

MODEL_CONFIG = REPOSITORY / "configs" / "models" / "tiny_llama_vllm.json"
"""The model every engine samples with (a config: random weights, seed 0)."""


def bench_prompts(groups: int, prompt_tokens: int) -> list[list[int]]:
    """``groups + 1`` prompts of ``prompt_tokens`` ids each (the first one warms up)."""
    return [[3 + (7 * group + i) % 1000 for i in range(prompt_tokens)] for group in range(groups + 1)]


def time_engine(name: str, engine, prompts: list[list[int]], settings: SamplerSettings) -> dict:
    """Sample every prompt's tree on ``engine`` (seeded by its index, no EOS); the first one is not timed."""
    trees, seconds = [], 0.0
    for index, prompt in enumerate(prompts):
        started = time.perf_counter()
        tree = engine.sample_tree(prompt, settings, generator=torch.Generator().manual_seed(index), eos_token_ids=())
        if index:  # the first group warms up
            seconds += time.perf_counter() - started
            trees.append(tree)
    tokens = sum(tree.sampled_tokens for tree in trees)
    return {
        "engine": name,
        "groups": len(trees),
        "sampled_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else float("inf"),
    }


def engine_throughput(
    tokenizer: str | Path,
    *,
    groups: int = 4,
    prompt_tokens: int = 200,
    independent: bool = False,
    model_config: str | Path = MODEL_CONFIG,
) -> Iterator[dict]:
    """One result per engine, as each finishes: hf, then vLLM with prefix caching on and off.

    ``tokenizer`` is a tokenizer directory (the managed vLLM server needs one); the sampler runs
    its default tree (16-token segments, 2 x 2 x 2, 64 tokens), or ``independent`` samples.
    Raises ValueError for counts below 1, :class:`~ds_tree.errors.DataError` for a tokenizer that
    does not load and :class:`~ds_tree.sampling.interface.EngineError` when vLLM fails."""
    if groups < 1 or prompt_tokens < 1:
        raise ValueError(f"groups ({groups}) and prompt_tokens ({prompt_tokens}) must be >= 1")
    tokenizer = load_tokenizer(tokenizer)
    model = load_model(model_config, dtype="float32", seed=0).eval()
    settings = SamplerSettings(independent=independent)
    prompts = bench_prompts(groups, prompt_tokens)
    with torch.no_grad():
        yield time_engine("hf", HFEngine(model), prompts, settings)
    for caching in (True, False):
        with tempfile.TemporaryDirectory() as directory:
            engine = VLLMEngine.for_model(
                model, tokenizer, url="", directory=directory, prefix_caching=caching, max_model_len=1024
            )
            try:
                yield time_engine(f"vllm (prefix caching {'on' if caching else 'off'})", engine, prompts, settings)
            finally:
                engine.close()
