"""Sampling engines: one interface over the in-process Hugging Face sampler and a vLLM server.

An engine (:class:`SamplingEngine`, registered by name in :data:`ds_tree.registries.SAMPLING_ENGINES`:
``rollout.engine``, ``ds-tree sample --engine``) does these things (docs/ROLLOUTS.md, *Sampling engines*):

- :meth:`SamplingEngine.continue_prefixes`: for each :class:`PrefixRequest` (the exact token ids of a
  prefix, ``n`` siblings, at most ``max_tokens`` new tokens, stop ids, a seed) return ``n``
  :class:`Continuation` s, each with the sampled token ids and the engine's log-prob of every one.
  Token in, token out: no text is ever re-rendered. Multi-turn environments and the tree sampler
  are both written on this call.
- :meth:`SamplingEngine.sample_tree`: one prompt's group as a :class:`SampledTree` with the tree
  sampler's semantics (segments, branching, width, refill, stops; docs/ROLLOUTS.md). ``hf`` runs
  :func:`ds_tree.sampling.hf.sample_tree` (a shared KV cache in this process); ``vllm`` runs
  :func:`sample_tree_by_segments`: every fork is one request with ``n`` = the number of children, and
  the server's prefix cache serves the shared part.
- :meth:`SamplingEngine.turn_sampler`: the multi-turn rollouts' :class:`TurnSampler` (``n`` assistant
  turns after one exact prefix); :class:`EngineTurnSampler` serves any engine through
  :meth:`~SamplingEngine.continue_prefixes`, ``hf`` has its own (keys/values carried across turns).
- :meth:`SamplingEngine.sync_weights`: the policy's current weights into the engine (a collective
  under ZeRO-3: every rank calls it). ``version`` counts syncs; a trajectory records the version that
  sampled it.
- built for a training run before the policy (:meth:`SamplingEngine.for_run`), or around a model
  (:meth:`SamplingEngine.for_model`, ``ds-tree sample``); :meth:`SamplingEngine.close` stops what it
  started (a managed vLLM server).

What an engine can do is declared, not inferred from its name: ``images`` (a vision-language policy's
image observations), ``recurrent_models`` (hybrid models' recurrent and conv states forked at branch
points), ``logprobs`` (the sampler's log-prob of every sampled token, which ``objective.old_logprobs:
data`` and the importance correction train with) and ``samples_ahead`` (it samples off the training
ranks' cores, so ``rollout.max_staleness > 0`` overlaps sampling with training). ``why_not`` says, per
missing capability, why (a config error quotes it: :func:`ds_tree.registries.missing_capability`).

The tree driver :func:`sample_tree_by_segments` works with any engine: the stop rules are applied
per token to what the engine returns (a branch is cut right after the first token where a rule
holds, that token kept), so a branch stops exactly where the in-process sampler would stop it on
the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ds_tree.sampling.hf import SampledNode, SampledTree, repeats_ngram
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.trees.images import TrajectoryImage


class EngineError(RuntimeError):
    """The sampling engine cannot be used: unreachable, dead, or an answer that is not what was asked."""


@dataclass
class PrefixRequest:
    """Sample ``n`` continuations of the exact token ids ``prefix_ids``."""

    prefix_ids: list[int]
    n: int
    max_tokens: int
    seed: int
    """The request's seed: a function of the caller's generator, so a tree is a function of its seed."""


@dataclass
class Continuation:
    """One sampled continuation: token ids, the engine's log-prob of each (raw: before temperature/top-p)."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str
    """``eos`` (ended on a stop id, which is the last token) or ``length`` (``max_tokens`` sampled)."""


@dataclass
class EngineSampling:
    """How an engine samples: the token-level part of :class:`SamplerSettings` and the stop ids."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: list[int] = field(default_factory=list)


@dataclass
class SampledTurn:
    """One sampled assistant turn."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """``eos`` (a stop token, kept last) or ``length``."""


class TurnSampler:
    """The multi-turn rollouts' turn sampler (docs/ENVIRONMENTS.md): ``n`` assistant turns after one
    exact token prefix. Made by :meth:`SamplingEngine.turn_sampler`; a test's scripted policy subclasses it."""

    forward_tokens: int = 0
    """Tokens the engine was handed or fed so far (what the ``rollout/forward_tokens`` metric counts)."""
    generator_device: torch.device | str = "cpu"
    """Where an episode's ``torch.Generator`` lives (the sampler draws from it there)."""

    def sample(
        self,
        prefix_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        generator: torch.Generator,
        images: Sequence[TrajectoryImage] = (),
    ) -> list[SampledTurn]:
        """``n`` turns after ``prefix_ids`` (whose images, in order, are ``images``), seeded from ``generator``."""
        raise NotImplementedError

    def end_episode(self) -> None:
        """An episode tree is done: drop what was kept for its later turns (nothing by default)."""


class SamplingEngine(Protocol):
    """The interface a rollout loop samples through (module docstring)."""

    name: str
    version: int
    images: bool
    recurrent_models: bool
    logprobs: bool
    samples_ahead: bool
    why_not: dict[str, str]
    """Per capability the engine lacks, why (quoted by the config error that refuses it)."""
    concurrent_trees: int
    """Trees one rank samples at once (1: one after another; ``vllm`` with several servers: several per server)."""

    @classmethod
    def check_config(cls, config) -> None:
        """What this engine needs from a training config that the dry run can see (a ``ConfigError``)."""
        ...

    @classmethod
    def for_run(cls, config, model_config, tokenizer) -> SamplingEngine:
        """A training run's engine, built on every rank before the policy (outside any ZeRO-3 ``zero.Init``);
        the first :meth:`sync_weights` gives it the policy's weights."""
        ...

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer, *, url: str, directory: Path) -> SamplingEngine:
        """An engine holding ``model``'s weights outside a run (``ds-tree sample``): ``url`` an existing server's,
        ``directory`` a scratch folder for what a managed one needs. :class:`EngineError` if it cannot start."""
        ...

    @property
    def generator_device(self) -> torch.device | str:
        """Where a slot's ``torch.Generator`` lives (the sampler draws from it there)."""
        ...

    def continue_prefixes(
        self, requests: Sequence[PrefixRequest], sampling: EngineSampling
    ) -> list[list[Continuation]]: ...

    def sample_tree(
        self,
        prompt_ids: Sequence[int],
        settings: SamplerSettings,
        *,
        generator: torch.Generator,
        eos_token_ids: Sequence[int],
    ) -> SampledTree: ...

    def turn_sampler(self, settings: SamplerSettings, stop_ids: Sequence[int]) -> TurnSampler: ...

    def sync_weights(self, policy: torch.nn.Module) -> float:
        """The policy's weights into the engine (a collective: every rank calls it); seconds taken."""
        ...

    def step_scalars(self) -> dict[str, float]:
        """This rank's ``rollout/`` metrics of the engine since the last call (``vllm``: trees resubmitted to
        another server, servers sampling); none for an engine without such state."""
        ...

    def close(self) -> None:
        """Release what the engine started (a managed server is stopped); idempotent."""
        ...


def request_seed(generator: torch.Generator) -> int:
    """A request's seed drawn from ``generator`` (the engine seeds its own sampler with it)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


class EngineTurnSampler(TurnSampler):
    """A :class:`TurnSampler` on any :class:`SamplingEngine`: ``sample(prefix_ids, n, max_new_tokens,
    generator)`` is one :class:`PrefixRequest` of ``n`` siblings after the exact ids of the conversation
    so far, seeded from ``generator``. Images are not sent (an engine without ``images`` is refused at
    config time for a vision-language policy)."""

    def __init__(self, engine: SamplingEngine, settings: SamplerSettings, stop_ids: Sequence[int]) -> None:
        self.engine = engine
        self.sampling = EngineSampling(settings.temperature, settings.top_p, sorted({int(t) for t in stop_ids}))
        self.forward_tokens = 0
        """Tokens handed to the engine (each prefix in full) plus those sampled: an upper bound of its work."""

    @property
    def generator_device(self) -> torch.device | str:
        return self.engine.generator_device

    def sample(self, prefix_ids, n, max_new_tokens, generator, images=()) -> list[SampledTurn]:
        if images:
            raise EngineError(f"the {self.engine.name} engine does not sample with images")
        request = PrefixRequest([int(t) for t in prefix_ids], n, max_new_tokens, request_seed(generator))
        continuations = self.continue_prefix(request)
        if len(continuations) != n:
            raise EngineError(f"the {self.engine.name} engine answered {len(continuations)} samples for n={n}")
        turns = []
        for continuation in continuations:
            self.forward_tokens += len(request.prefix_ids) + len(continuation.token_ids)
            ended = continuation.finish == "eos" and continuation.token_ids[-1] in self.sampling.stop_ids
            reason = "eos" if ended else "length"
            turns.append(SampledTurn(list(continuation.token_ids), list(continuation.logprobs), reason))
        return turns

    def continue_prefix(self, request: PrefixRequest) -> list[Continuation]:
        """One turn's request on the engine (an engine with several servers keeps an episode on one)."""
        (continuations,) = self.engine.continue_prefixes([request], self.sampling)
        return continuations


# ------------------------------------------------------------------------------- the tree driver
@dataclass
class _Live:
    """A branch about to decode a segment: its completion so far, its node, boundary and quota."""

    completion: list[int]
    node: int
    boundary: int
    quota: int


def sample_tree_by_segments(
    engine: SamplingEngine,
    prompt_ids: Sequence[int],
    settings: SamplerSettings,
    *,
    generator: torch.Generator,
    eos_token_ids: Sequence[int],
) -> SampledTree:
    """One group as a tree (docs/ROLLOUTS.md) with every segment sampled by ``engine.continue_prefixes``.

    Quota, forks, stops and refill follow :func:`ds_tree.sampling.hf.sample_tree`: the children of
    one fork are the ``n`` samples of one request whose prefix is the exact ids prompt + path; all the
    requests of one round (every live fork) go to the engine together. ``forward_tokens`` counts the
    tokens the requests hand the engine (each prefix in full) plus those sampled: an upper bound of what
    the engine runs, which its prefix cache lowers.
    """
    prompt_ids = [int(token) for token in prompt_ids]
    if not prompt_ids:
        raise ValueError("sample_tree needs a non-empty prompt (the first token is never sampled)")
    eos = {int(token) for token in eos_token_ids}
    sampling = EngineSampling(settings.temperature, settings.top_p, sorted(eos))
    nodes: list[SampledNode] = []
    forward_tokens = passes = 0

    def fork(branch: _Live) -> list[_Live]:
        last_level = branch.boundary == settings.branch_levels - 1
        can_fork = branch.boundary < settings.branch_levels
        count = (branch.quota if last_level else min(branch.quota, settings.branching)) if can_fork else 1
        shares = [branch.quota // count + (i < branch.quota % count) for i in range(count)]
        children = []
        for share in shares:
            nodes.append(SampledNode(branch.node))
            children.append(_Live(list(branch.completion), len(nodes) - 1, branch.boundary, share))
        return children

    def stop_reason(completion: list[int], node: SampledNode, segment_end: int) -> str | None:
        if completion[-1] in eos:
            return "eos"
        if repeats_ngram(completion, settings.repetition_ngram):
            return "repetition"
        if len(completion) == segment_end:
            if settings.logprob_floor and np.mean(node.logprobs) < settings.logprob_floor:
                return "logprob_floor"
            if segment_end == settings.max_new_tokens:
                return "length"
        return None

    live = [fork(_Live([], -1, 0, settings.width))]  # sibling sets: the children of one fork
    while live:
        requests = []
        for siblings in live:
            first = siblings[0]
            segment_end = min(settings.segment_length * (first.boundary + 1), settings.max_new_tokens)
            requests.append(
                PrefixRequest(
                    prompt_ids + first.completion,
                    len(siblings),
                    segment_end - len(first.completion),
                    request_seed(generator),
                )
            )
        answers = engine.continue_prefixes(requests, sampling)
        passes += 1
        stopped: list[_Live] = []
        survivors: list[_Live] = []
        for siblings, request, continuations in zip(live, requests, answers, strict=True):
            if len(continuations) != len(siblings):
                raise RuntimeError(f"the {engine.name} engine answered {len(continuations)} samples for n={request.n}")
            forward_tokens += len(request.prefix_ids)
            segment_end = len(siblings[0].completion) + request.max_tokens
            for branch, continuation in zip(siblings, continuations, strict=True):
                node = nodes[branch.node]
                reason = None
                for token, logprob in zip(continuation.token_ids, continuation.logprobs, strict=True):
                    node.token_ids.append(int(token))
                    node.logprobs.append(float(logprob))
                    branch.completion.append(int(token))
                    forward_tokens += 1
                    reason = stop_reason(branch.completion, node, segment_end)
                    if reason is not None:
                        break
                if reason is None and len(branch.completion) != segment_end:
                    raise RuntimeError(
                        f"the {engine.name} engine returned {len(continuation.token_ids)} tokens "
                        f"(finish {continuation.finish!r}) where {request.max_tokens} or a stop token were due"
                    )
                node.finish_reason = reason
                if reason is None:
                    branch.boundary += 1
                    survivors.append(branch)
                else:
                    stopped.append(branch)
        at_fork = [b for b in survivors if b.boundary < settings.branch_levels]
        respawned = []
        for branch in stopped:
            freed = branch.quota - 1
            if freed == 0 or not settings.refill:
                continue
            if at_fork:
                for _ in range(freed):
                    min(at_fork, key=lambda b: b.quota).quota += 1
            else:  # a new sibling of its last segment, from the boundary that segment started at
                start = settings.segment_length * branch.boundary
                parent = nodes[branch.node].parent
                respawned.append(_Live(branch.completion[:start], parent, branch.boundary, freed))
        live = [fork(branch) for branch in survivors + respawned]
    return SampledTree(prompt_ids, nodes, forward_tokens, passes)
