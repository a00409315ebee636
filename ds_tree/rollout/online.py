"""Online RL: every training step samples trees from the current policy, scores them and trains on them.

One step (``rollout.enabled``; docs/RL.md, *Online RL*):

1. the step's prompts come from ``(rollout.prompt_seed, step)`` as a dataset's groups do
   (:class:`~ds_tree.data.sampler.StepSampler`): ``prompts_per_step`` slots, slot ``j`` sampled by
   rank ``j mod world_size``;
2. every rank copies the current weights into its generation model: under ZeRO-3 the partitioned
   parameters are gathered for the copy (``deepspeed.zero.GatheredParameters``, a collective), so each
   rank briefly holds the whole model once more. That is fine for the small models this trains on the
   CPU; for large ones DeepSpeed's hybrid engine (inference kernels over the gathered weights) is the
   alternative. The copy has no ZeRO hooks, so ranks then sample different amounts without any
   collective, in eval mode and without gradients; the training model is left as it was;
3. each slot is sampled with its own ``torch.Generator`` seeded from ``(rollout.seed, step, slot)``:
   the samples are a function of the weights and the step only, so a run resumed from a checkpoint
   samples exactly what the uninterrupted run did, with no generator state to save, and the result does
   not depend on the number of ranks;
4. each rank scores its own completions (``rollout.reward``), then ``all_gather_object`` gives every
   rank the same trajectory list in slot order. A trajectory whose reward function failed (reward
   ``None``) is dropped with a warning naming it, and counted in ``rollout/reward_failures``.

With ``rollout.engine: vllm`` step 2 is a weight sync to a vLLM server instead (rank 0 writes a
snapshot, the server reloads it; :mod:`ds_tree.sampling.vllm`) and step 3 sends each slot's
segments to the server (:func:`ds_tree.sampling.interface.sample_tree_by_segments`), seeded from the same
generator. Every trajectory records the ``policy_version`` (training steps taken) that sampled it.

The trajectories then go through the RL step exactly as offline rollouts do (advantages, old
log-probs, updates). :func:`rollout_scalars` gives the ``rollout/`` metrics.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.data.convert import load_tokenizer
from ds_tree.data.sampler import StepSampler
from ds_tree.errors import ConfigError, DataError
from ds_tree.rollout.ahead import (
    AheadSampler,
    drop_stale,
    sampling_version,
    staleness_bound,
    sync_due,
    version_used,
)
from ds_tree.rollout.prompts import read_prompts, stop_token_ids
from ds_tree.rollout.rewards import RewardRequest, reward_function, score
from ds_tree.sampling.interface import EngineError, HFEngine, SamplingEngine
from ds_tree.sampling.settings import path_limit
from ds_tree.trees.trajectory import Trajectory

logger = logging.getLogger(__name__)


def slot_generator(seed: int, step: int, slot: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one prompt slot of one step: a function of ``(seed, step, slot)`` only."""
    state = np.random.SeedSequence([seed, step, slot]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state))


def rank_slots(n_slots: int, rank: int, world_size: int) -> list[int]:
    """The slots ``rank`` samples: every ``world_size``-th, starting at ``rank``."""
    return list(range(rank, n_slots, world_size))


@dataclass
class SlotResult:
    """One slot's sampled tree, scored (what a rank sends to the others)."""

    slot: int
    trajectories: list[Trajectory]
    """The tree's leaves as trajectories, rewards set (``None`` where the reward function failed)."""
    prompt_tokens: int
    leaves: int
    depth: int
    sampled_tokens: int
    """Distinct tokens the sampler drew (each shared segment once)."""
    forward_tokens: int
    """Tokens the sampler ran through the model (prompt prefill included)."""
    failures: list[str] = field(default_factory=list)
    """The reward function's failure messages."""


def kept_trajectories(results: list[SlotResult]) -> list[Trajectory]:
    """Every slot's trajectories in slot order, those without a reward dropped with one warning naming them."""
    kept, dropped = [], []
    for result in sorted(results, key=lambda r: r.slot):
        for trajectory in result.trajectories:
            (dropped if trajectory.reward is None else kept).append(trajectory)
    if dropped:
        names = ", ".join(t.where for t in dropped[:8]) + (", ..." if len(dropped) > 8 else "")
        logger.warning(
            "%d trajectories without a reward (the reward function failed) are dropped: %s", len(dropped), names
        )
    return kept


def rollout_scalars(results: list[SlotResult]) -> dict[str, float]:
    """The ``rollout/`` metrics of one step's slots (all ranks).

    ``reward_mean`` over the trajectories with a reward; ``leaves`` and ``depth`` are means per tree;
    ``por`` is 1 - tree tokens / flat tokens of the sampled trees (prompt once per tree against the
    prompt once per trajectory); ``tokens_saved`` the completion tokens that sampling every leaf on its
    own would draw minus those the sampler drew (0 for independent sampling).
    """
    rewards = [t.reward for r in results for t in r.trajectories if t.reward is not None]
    flat = sum(len(t) for r in results for t in r.trajectories)
    tree = sum(r.prompt_tokens + r.sampled_tokens for r in results)
    independent = sum(len(t) - r.prompt_tokens for r in results for t in r.trajectories)
    sampled = sum(r.sampled_tokens for r in results)
    return {
        "rollout/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
        "rollout/leaves": float(np.mean([r.leaves for r in results])),
        "rollout/depth": float(np.mean([r.depth for r in results])),
        "rollout/por": 1.0 - tree / flat if flat else 0.0,
        "rollout/sampled_tokens": float(sampled),
        "rollout/forward_tokens": float(sum(r.forward_tokens for r in results)),
        "rollout/tokens_saved": float(independent - sampled),
        "rollout/reward_failures": float(sum(len(r.failures) for r in results)),
    }


def raise_any(*failures: str | None, gather: bool = True) -> None:
    """Raise the first failure of any rank on every rank (``gather``: each rank passes its own; a collective)."""
    found = [f for f in failures if f]
    if gather and dist.is_initialized():
        every: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, found[0] if found else None)
        found = [f"rank {rank}: {f}" for rank, f in enumerate(every) if f]
    if found:
        raise EngineError(found[0] + (f" (and {len(found) - 1} more rank(s))" if len(found) > 1 else ""))


def check_vllm_config(config) -> None:
    """What ``rollout.engine: vllm`` needs that the dry run can see (before any model is built): an
    http(s) ``vllm.url``; without one, vLLM's Python (``vllm.python``, ``$DS_TREE_VLLM_PYTHON`` or the
    checkout's ``.venv-vllm``) with a finished install; a ``vllm.max_model_len`` that holds every prompt
    of ``rollout.prompts`` and a token more (single-turn prompts: read with the run's tokenizer)."""
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.sampling.vllm import vllm_available

    vllm = config.rollout.vllm
    if vllm.url:
        parsed = urllib.parse.urlparse(vllm.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(
                f"rollout.vllm.url must be an http(s) URL of a running server (http://host:port), got {vllm.url!r}"
            )
    else:
        if vllm.python and not Path(vllm.python).is_file():
            raise ConfigError(f"rollout.vllm.python: {vllm.python}: no such file (vLLM's Python interpreter)")
        missing = vllm_available(vllm.python or None)
        if missing:
            raise ConfigError(f"rollout.engine: vllm starts a server from vLLM's own venv, and {missing}")
    if vllm.max_model_len and not config.rollout.env.path:
        vocab_size = load_model_config(config.model.source).vocab_size
        prompts = read_prompts(config.rollout.prompts, load_tokenizer(config.model.tokenizer), vocab_size)
        longest = max(len(prompt.ids) for prompt in prompts)
        if vllm.max_model_len <= longest:
            raise ConfigError(
                f"rollout.vllm.max_model_len ({vllm.max_model_len}) leaves no room to sample: the longest prompt "
                f"of {config.rollout.prompts} has {longest} tokens; raise it, or set 0 (packing.budget)"
            )


class OnlineRollouts:
    """The online loop on one rank: prompts, tokenizer, reward function and the generation model."""

    engine: SamplingEngine | None = None  # class defaults: the multi-turn subclass sets its own fields
    ahead: AheadSampler | None = None
    start: int | None = None
    begun: int | None = None
    sync_s: float = 0.0
    wait_s: float = 0.0

    def __init__(self, config, model_config) -> None:
        from ds_tree.errors import ConfigError

        rollout = config.rollout
        try:
            self.tokenizer = load_tokenizer(config.model.tokenizer)
        except DataError as error:
            raise ConfigError(f"model.tokenizer: {error}") from None
        try:
            self.prompts = read_prompts(rollout.prompts, self.tokenizer, model_config.vocab_size)
        except DataError as error:
            raise ConfigError(f"rollout.prompts: {error}") from None
        longest = max(self.prompts, key=lambda p: p.ids.size)
        limit, what = path_limit(config)
        if longest.ids.size + rollout.max_new_tokens > limit:
            raise ConfigError(
                f"{what} is below the longest prompt ({longest.ids.size} tokens, "
                f"{longest.source}) plus rollout.max_new_tokens ({rollout.max_new_tokens}); "
                "every root-to-leaf path must fit one row"
            )
        self.config = config
        self.model_config = model_config
        self.settings = rollout.sampler_settings()
        self.reward = reward_function(rollout.reward)
        self.stop_ids = stop_token_ids(self.tokenizer, model_config)
        self.sampler = StepSampler(len(self.prompts), rollout.prompts_per_step, rollout.seed)
        self.model: torch.nn.Module | None = None
        self.engine: SamplingEngine | None = None
        """Where slots are sampled (``rollout.engine``); a vLLM engine is started by the first step's sync."""
        self.scalars: dict[str, float] = {}
        """The ``rollout/`` metrics of the last step sampled."""
        self.start: int | None = None
        """The run's first step (0, or the checkpoint's): the engine starts with that version."""
        self.ahead: AheadSampler | None = None
        """The background sampler of ``rollout.max_staleness > 0`` (:mod:`ds_tree.rollout.ahead`)."""
        self.begun: int | None = None
        """The last step :meth:`begin_step` started (it runs once a step)."""
        self.sync_s = 0.0
        """This step's weight sync time (``rollout/sync_s``; 0 on a step without a sync)."""
        self.wait_s = 0.0
        """This step's wait for the background sampler before its sync."""

    def build_model(self) -> None:
        """The generation model: same architecture and dtype as the policy, its own (unpartitioned) weights.

        Built on the CPU before the policy, outside any ZeRO-3 ``zero.Init``; :meth:`copy_weights` moves it
        to the policy's device and fills it each step.
        """
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from ds_tree.models.vision import is_vision_language

        if self.config.rollout.engine == "vllm":  # the server holds the weights: no copy on any rank
            return
        dtype = torch.bfloat16 if self.config.model.dtype == "bfloat16" else torch.float32
        # a vision-language policy: the same class as the trainer's (ds_tree.models.loading), the tower's sdpa too
        auto = AutoModelForImageTextToText if is_vision_language(self.model_config) else AutoModelForCausalLM
        model = auto.from_config(self.model_config, attn_implementation="sdpa", dtype=dtype)
        self.model = model.eval().requires_grad_(False)

    def copy_weights(self, policy: torch.nn.Module) -> None:
        """The policy's current weights into the generation model (a collective under ZeRO-3: every rank calls it)."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        source = dict(policy.named_parameters())
        partitioned = [p for p in source.values() if hasattr(p, "ds_id")]
        with GatheredParameters(partitioned, enabled=bool(partitioned)), torch.no_grad():
            self.model.to(next(iter(source.values())).device)  # a no-op after the first step
            for name, target in self.model.named_parameters():
                target.copy_(source[name])

    def sample_slot(self, step: int, slot: int, prompt_index: int, version: int | None = None) -> SlotResult:
        """One prompt slot: sample its tree, decode and score the leaves; ``version``: the policy version
        the engine holds (the trajectories' ``policy_version``; default ``step``)."""
        prompt = self.prompts[prompt_index]
        device = next(self.model.parameters()).device if self.model is not None else "cpu"
        generator = slot_generator(self.config.rollout.seed, step, slot, device)
        engine = self.engine if self.engine is not None else HFEngine(self.model)
        with torch.no_grad():
            tree = engine.sample_tree(
                prompt.ids.tolist(), self.settings, generator=generator, eos_token_ids=self.stop_ids
            )
        # one numbering: the console's, metrics' and saved files' 1-based step (``step`` counts from 0)
        trajectories = tree.trajectories(f"{prompt.label}/step{step + 1}/slot{slot}")
        requests = []
        for leaf, trajectory in enumerate(trajectories):
            trajectory.source = f"{prompt.source} (step {step + 1}, slot {slot}, leaf {leaf})"
            trajectory.policy_version = step if version is None else version
            completion = trajectory.input_ids[prompt.ids.size :]
            text = self.tokenizer.decode(completion.tolist(), skip_special_tokens=True)
            requests.append(RewardRequest(prompt=prompt.text, completion=text, metadata=prompt.metadata))
        rewards, failures = score(self.reward, requests)
        for trajectory, reward in zip(trajectories, rewards, strict=True):
            trajectory.reward = reward
        return SlotResult(
            slot=slot,
            trajectories=trajectories,
            prompt_tokens=int(prompt.ids.size),
            leaves=tree.leaves,
            depth=tree.depth,
            sampled_tokens=tree.sampled_tokens,
            forward_tokens=tree.forward_tokens,
            failures=list(failures),
        )

    def sample_share(self, step: int, version: int) -> list[SlotResult]:
        """This rank's slots of ``step`` (no collective: the background sampler runs it too)."""
        prompt_indices = self.sampler.groups_for_step(step)
        slots = rank_slots(len(prompt_indices), dist.get_rank(), dist.get_world_size())
        return [self.sample_slot(step, slot, prompt_indices[slot], version) for slot in slots]

    def sync(self, policy: torch.nn.Module) -> None:
        """The policy's weights into the engine (the first call starts a vLLM engine; a collective)."""
        if self.config.rollout.engine == "vllm":
            from ds_tree.sampling.vllm import sync_engine

            self.engine = sync_engine(self.engine, self.config, self.model_config, self.tokenizer, policy)
        else:
            self.copy_weights(policy)

    def samples(self, step: int) -> bool:
        """Whether ``step`` samples (every single-turn step does; multi-turn SFT steps do not)."""
        return True

    def sync_needed(self, step: int) -> bool:
        """Whether the weights go into the engine as ``step`` starts: the run's first step and every
        ``rollout.sync_every``-th, if a step samples with them (:func:`~ds_tree.rollout.ahead.version_used`:
        a multi-turn run's SFT steps sample nothing, and none samples past the run's end)."""
        rollout = self.config.rollout
        if step != self.start and not sync_due(step, self.start, rollout.sync_every):
            return False
        return version_used(
            step, self.start, rollout.max_staleness, rollout.sync_every, self.config.max_steps, self.samples
        )

    def begin_step(self, step: int, policy: torch.nn.Module) -> None:
        """``step`` starts (every rank; once a step, whether it samples or not): the weight sync when one
        is needed (a collective; with a background sampler, after every step the old weights sample),
        then the background sampler may run ``rollout.max_staleness`` steps ahead."""
        rollout = self.config.rollout
        if self.begun == step:
            return
        self.begun = step
        if self.start is None:
            self.start = step
        self.sync_s, self.wait_s = 0.0, 0.0  # no sync: 0
        if self.sync_needed(step):
            synced = time.perf_counter()
            if self.ahead is not None:  # every step that samples with the old weights is sampled first
                failure = self.ahead.before_sync(step)
                self.wait_s = time.perf_counter() - synced
                raise_any(failure)
            self.sync(policy)
            if self.ahead is not None:
                self.ahead.synced(step)
            self.sync_s = time.perf_counter() - synced - self.wait_s
        if rollout.max_staleness and self.ahead is None:
            self.ahead = AheadSampler(
                self.sample_share, start=self.start, max_staleness=rollout.max_staleness,
                sync_every=rollout.sync_every, end=self.config.max_steps, samples=self.samples,
                join_timeout_s=self.join_timeout_s(),
            )  # fmt: skip
        if self.ahead is not None:
            self.ahead.begin(step)

    def join_timeout_s(self) -> float:
        """How long closing waits for the background sampler's step to stop (an engine request's bound)."""
        return 5.0

    def gathered_shares(self, step: int, policy: torch.nn.Module) -> list:
        """Every rank's :meth:`sample_share` of ``step``, in rank order (collective). A sampling failure on
        any rank is raised on every rank. Sets the ``rollout/`` timing scalars."""
        rollout = self.config.rollout
        self.begin_step(step, policy)
        version = sampling_version(step, self.start, rollout.max_staleness, rollout.sync_every)
        started = time.perf_counter()
        failure, waited = None, self.wait_s
        if self.ahead is not None:
            sampled, failure = self.ahead.take(step)
            mine, seconds = (sampled.results, sampled.seconds) if sampled is not None else ([], 0.0)
            waited += time.perf_counter() - started
        else:
            try:
                mine = self.sample_share(step, version)
            except EngineError as error:  # raised on every rank below, not only here (no rank left waiting)
                mine, failure = [], f"{type(error).__name__}: {error}"
            seconds = time.perf_counter() - started
        gathered: list[tuple[list, float, str | None] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, seconds, failure))
        raise_any(*[f"rank {rank}: {failed}" for rank, (_, _, failed) in enumerate(gathered) if failed], gather=False)
        self.scalars = {
            "rollout/time_s": max(seconds for _, seconds, _ in gathered),  # the slowest rank's
            "rollout/sync_s": self.sync_s,
        }
        if rollout.max_staleness:
            self.scalars["rollout/wait_s"] = waited  # the time this rank's training waited for sampling
        return [result for share, _, _ in gathered for result in share]

    def fresh_enough(self, step: int, kept: list[Trajectory]) -> list[Trajectory]:
        """``kept`` without the trajectories older than the staleness bound; the version scalars."""
        rollout = self.config.rollout
        kept, stale = drop_stale(kept, step, staleness_bound(rollout.max_staleness, rollout.sync_every))
        versions = [t.policy_version for t in kept]
        self.scalars["rollout/policy_version"] = float(np.mean(versions)) if versions else float("nan")
        self.scalars["rollout/staleness_max"] = float(step - min(versions)) if versions else 0.0
        self.scalars["rollout/stale_dropped"] = float(stale)
        return kept

    def step_trajectories(self, step: int, policy: torch.nn.Module) -> list[Trajectory]:
        """``step``'s sampled and scored trajectories, the same list on every rank (collective).

        The engine gets the weights at the run's first step and every ``rollout.sync_every`` steps after;
        with ``rollout.max_staleness > 0`` each rank's slots are sampled ahead by its background sampler
        (:mod:`ds_tree.rollout.ahead`). A sampling failure on any rank is raised on every rank."""
        results = self.gathered_shares(step, policy)
        self.scalars.update(rollout_scalars(results))
        kept = self.fresh_enough(step, kept_trajectories(results))
        groups = len({t.group_id for t in kept})
        if groups < self.config.objective.mini_batches:
            failures = [message for result in results for message in result.failures]
            raise RuntimeError(
                f"step {step + 1}: the reward function failed on every leaf of some prompts; {groups} group(s) are "
                f"left for objective.mini_batches={self.config.objective.mini_batches}. First failure: {failures[0]}"
            )
        return kept

    def close(self) -> None:
        """Stop the background sampler and the engine (a managed vLLM server); idempotent."""
        if self.ahead is not None:
            self.ahead.close()
        if self.engine is not None:
            self.engine.close()
