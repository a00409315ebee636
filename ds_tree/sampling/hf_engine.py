"""The ``hf`` sampling engine: a Hugging Face model in this process (the default, ``rollout.engine: hf``).

A training run builds its generation model on every rank before the policy, with the policy's
architecture and dtype and its own weights (:meth:`HFEngine.for_run`). :meth:`HFEngine.sync_weights`
copies the policy's current weights into it: under ZeRO-3 the partitioned parameters are gathered for
the copy (``deepspeed.zero.GatheredParameters``, a collective), so each rank briefly holds the whole
model once more. That is fine for the small models this trains on the CPU; for large ones DeepSpeed's
hybrid engine (inference kernels over the gathered weights) is the alternative. The copy has no ZeRO
hooks, so ranks then sample different amounts without any collective, in eval mode and without
gradients; the training model is left as it was.

Trees are sampled by :func:`ds_tree.sampling.hf.sample_tree` (one shared KV cache), multi-turn turns by
:class:`HFTurnSampler`, which carries keys/values from a leaf's turn to its next. It samples
vision-language policies' images and hybrid models (their recurrent and conv states are forked at
branch points, :mod:`ds_tree.sampling.state_cache`), but on the training ranks' own cores: it does not
sample ahead of training (``rollout.max_staleness``) on its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from ds_tree.sampling.hf import sample_tree
from ds_tree.sampling.interface import Continuation, SampledTurn, TurnSampler
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.sampling.state_cache import has_recurrent_layers
from ds_tree.trees.images import TrajectoryImage


class HFEngine:
    """Sampling with a Hugging Face model in this process (module docstring)."""

    name = "hf"
    images = True
    recurrent_models = True
    logprobs = True
    samples_ahead = False
    concurrent_trees = 1
    why_not = {
        "samples_ahead": "the hf engine samples on the training ranks' own cores, so sampling ahead of training "
        "would only take them from it",
    }

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.version = 0

    @classmethod
    def check_config(cls, config) -> None:
        """Nothing beyond the model's own checks."""

    @classmethod
    def for_run(cls, config, model_config, tokenizer) -> HFEngine:
        """The generation model: the policy's architecture and dtype (a vision-language policy: the trainer's
        class, its tower's sdpa too, as :mod:`ds_tree.models.loading` builds it), built on the CPU; the first
        :meth:`sync_weights` moves it to the policy's device and fills it."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from ds_tree.models.vision import is_vision_language

        dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
        auto = AutoModelForImageTextToText if is_vision_language(model_config) else AutoModelForCausalLM
        model = auto.from_config(model_config, attn_implementation="sdpa", dtype=dtype)
        return cls(model.eval().requires_grad_(False))

    @classmethod
    def for_model(cls, model, tokenizer, *, url: str = "", directory=None) -> HFEngine:
        """``model`` itself samples (``url`` and ``directory`` are a server's: unused here)."""
        return cls(model)

    @property
    def generator_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def continue_prefixes(self, requests, sampling):
        results = []
        for request in requests:
            settings = SamplerSettings(
                segment_length=request.max_tokens,
                max_new_tokens=request.max_tokens,
                width=request.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                independent=True,
                refill=False,
            )
            generator = torch.Generator(device=self.generator_device).manual_seed(request.seed)
            tree = sample_tree(
                self.model, request.prefix_ids, settings, generator=generator, eos_token_ids=sampling.stop_ids
            )
            results.append(
                [
                    Continuation(node.token_ids, node.logprobs, "eos" if node.finish_reason == "eos" else "length")
                    for node in tree.nodes
                ]
            )
        return results

    def sample_tree(self, prompt_ids, settings, *, generator, eos_token_ids):
        return sample_tree(self.model, prompt_ids, settings, generator=generator, eos_token_ids=eos_token_ids)

    def turn_sampler(self, settings: SamplerSettings, stop_ids: Sequence[int]) -> HFTurnSampler:
        return HFTurnSampler(self.model, settings, stop_ids)

    def sync_weights(self, policy: torch.nn.Module) -> float:
        """The policy's current weights into the generation model (a collective under ZeRO-3: every rank
        calls it); seconds taken."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        started = time.perf_counter()
        source = dict(policy.named_parameters())
        partitioned = [p for p in source.values() if hasattr(p, "ds_id")]
        with GatheredParameters(partitioned, enabled=bool(partitioned)), torch.no_grad():
            self.model.to(next(iter(source.values())).device)  # a no-op after the first sync
            for name, target in self.model.named_parameters():
                target.copy_(source[name])
        self.version += 1
        return time.perf_counter() - started

    def step_scalars(self) -> dict[str, float]:
        """No engine metrics: the model is this process's."""
        return {}

    def close(self) -> None:
        """Nothing to stop: the model is this process's."""


class HFTurnSampler(TurnSampler):
    """``n`` assistant turns after one exact token prefix, on a Hugging Face model with the project's
    tree sampler (the prefix prefilled once, its keys/values shared by the ``n`` continuations).

    Keys/values are carried across turns: each sampled turn's (its prefix and tokens, all but the stop
    token, which was never fed) are kept until a later call's prefix extends them, the next turn of
    that leaf after its observation was bridged on; that call feeds only the stop token and the
    observation instead of prefilling the whole path again (``forward_tokens`` counts what is fed).
    The result is the full prefill's to round-off (float64: equal to 1e-12, the same tokens;
    tests/test_multiturn.py). :meth:`end_episode` drops what is kept; models with recurrent layers
    prefill every turn (``carry`` off).
    """

    def __init__(self, model, settings: SamplerSettings, stop_ids: Sequence[int], carry: bool = True) -> None:
        self.model = model
        self.settings = settings
        self.stop_ids = list(stop_ids)
        self.forward_tokens = 0
        self.carry = carry and not has_recurrent_layers(model.config)
        self.carried: list[tuple[list[int], list]] = []
        """(token ids fed, their keys/values) of the turns sampled since :meth:`end_episode`."""

    @property
    def generator_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def take_carried(self, prefix_ids: list[int]):
        """The kept keys/values of the longest fed ids that ``prefix_ids`` extends (removed: a leaf's
        next turn is sampled once), or None."""
        best = None
        for index, (ids, _) in enumerate(self.carried):
            if len(ids) < len(prefix_ids) and prefix_ids[: len(ids)] == ids:
                if best is None or len(ids) > len(self.carried[best][0]):
                    best = index
        return None if best is None else self.carried.pop(best)[1]

    def end_episode(self) -> None:
        self.carried.clear()

    def sample(
        self,
        prefix_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        generator: torch.Generator,
        images: Sequence[TrajectoryImage] = (),
    ) -> list[SampledTurn]:
        """``images``: the prefix's images in order (a vision-language policy; ``sample_tree``'s)."""
        settings = dataclasses.replace(
            self.settings,
            width=n,
            independent=True,
            max_new_tokens=max_new_tokens,
            segment_length=max_new_tokens,
            refill=False,
        )
        prefix_ids = [int(token) for token in prefix_ids]
        tree = sample_tree(
            self.model,
            prefix_ids,
            settings,
            generator=generator,
            eos_token_ids=self.stop_ids,
            prefix_key_values=self.take_carried(prefix_ids) if self.carry else None,
            keep_key_values=self.carry,
            images=images,
        )
        self.forward_tokens += tree.forward_tokens
        turns = []
        for leaf in tree.leaf_nodes():
            ids, logprobs = tree.completion(leaf)
            reason = "eos" if tree.nodes[leaf].finish_reason == "eos" else "length"
            turns.append(SampledTurn(ids, logprobs, reason))
            if self.carry and reason == "eos":  # a cut turn ends its leaf: nothing continues it
                self.carried.append((prefix_ids + ids[:-1], tree.leaf_key_values[leaf]))
        return turns
