"""Asynchronous online RL: sampling runs ``rollout.max_staleness`` steps ahead of training (docs/ROLLOUTS.md,
*Asynchronous steps*), and weight syncs every ``rollout.sync_every`` optimizer steps.

The schedule is fixed, so a run is a function of its seeds whatever the timing:

- versions: a policy version is the number of optimizer steps its weights have taken. The engine starts
  with the weights of the run's first step ``start`` (0, or the checkpoint's step on resume) and is
  synced at the start of every later step that is a multiple of ``sync_every`` (:func:`sync_due`), when
  a step that samples uses that version (:func:`version_used`: a multi-turn run's SFT steps, warm-up
  and refresh, sample nothing; the thread passes over them);
- step ``s`` is sampled with version :func:`sampling_version` ``= max(start, N * floor((s - k) / N))``
  (``k = max_staleness``, ``N = sync_every``): the last sync at or before step ``s - k``. With
  ``k = 0, N = 1`` that is ``s``, today's synchronous loop;
- each rank's :class:`AheadSampler` (one background thread, no collectives) samples the rank's slots of
  step ``s`` once the trainer has started step ``s - k`` and the engine holds that version; meanwhile the
  ranks train. A sync waits until every step that needs the old version is sampled (steps below
  ``v + k`` for version ``v``), so no step's tree straddles two versions and the version a trajectory
  records is exactly the one that sampled it;
- a trajectory whose ``step - policy_version`` exceeds ``k + N - 1`` is dropped and counted
  (``rollout/stale_dropped``, :func:`drop_stale`). The schedule above never produces one; the check
  guards the bound the importance correction is configured for.

Multi-turn rollouts (``rollout.env.path``) use the same schedule: the thread samples the rank's episode
trees, making, forking and closing their environments itself; closing the run stops the episode being
sampled at its next leaf and closes its environments (nothing of it is kept: a resumed run samples the
step anew from its seeds). They may sample ahead on any engine, also one that does not declare
``samples_ahead`` (``hf``: its generation copy is synced only while the thread waits): environment calls
(tools, services) then overlap training.

The importance correction uses the sampler's log-probs (the trajectories' ``logprobs``, which the
engine returns with every token): ``objective.old_logprobs: data``, or ``importance_truncation`` on top
of recomputed ones (checked at config time, :func:`check_staleness_config`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ds_tree.errors import ConfigError
from ds_tree.registries import missing_capability


def sampling_version(step: int, start: int, max_staleness: int, sync_every: int) -> int:
    """The policy version that samples ``step`` (module docstring)."""
    return max(start, sync_every * ((step - max_staleness) // sync_every))


def sync_due(step: int, start: int, sync_every: int) -> bool:
    """Whether the weights are synced into the engine at the start of ``step`` (the first step starts it)."""
    return step > start and step % sync_every == 0


def version_used(
    version: int, start: int, max_staleness: int, sync_every: int, end: int, samples: Callable[[int], bool]
) -> bool:
    """Whether a step that ``samples`` (before ``end``) is sampled with ``version``: only then is a sync at
    step ``version`` needed (a run whose SFT steps sample nothing skips the others). The steps sampled with
    ``version`` lie in ``[version, version + max_staleness + sync_every)``."""
    return any(
        samples(step) and sampling_version(step, start, max_staleness, sync_every) == version
        for step in range(version, min(version + max_staleness + sync_every, end))
    )


def staleness_bound(max_staleness: int, sync_every: int) -> int:
    """The most steps a trajectory's policy may be behind the step that trains it."""
    return max_staleness + sync_every - 1


def drop_stale(trajectories: list, step: int, bound: int) -> tuple[list, int]:
    """The trajectories whose ``step - policy_version`` is within ``bound``, and how many were dropped."""
    kept = [t for t in trajectories if t.policy_version is None or step - t.policy_version <= bound]
    return kept, len(trajectories) - len(kept)


def check_staleness_config(config) -> None:
    """What ``rollout.max_staleness > 0`` and ``rollout.sync_every > 1`` need from the rest of the config."""
    rollout, objective = config.rollout, config.objective
    if rollout.max_staleness == 0 and rollout.sync_every == 1:
        return
    fields = ", ".join(
        f"rollout.{name}={getattr(rollout, name)}"
        for name, default in (("max_staleness", 0), ("sync_every", 1))
        if getattr(rollout, name) != default
    )
    missing = missing_capability(rollout.engine, "samples_ahead") if rollout.max_staleness else None
    if missing and not rollout.env.path:
        raise ConfigError(
            f"rollout.max_staleness={rollout.max_staleness}: sampling ahead of training needs an engine that "
            f"samples off the training ranks' cores: {missing} (or max_staleness: 0). Multi-turn rollouts "
            "(rollout.env.path) may sample ahead on any engine: their environment calls overlap training"
        )
    if objective.old_logprobs != "data" and not objective.importance_truncation:
        bound = staleness_bound(rollout.max_staleness, rollout.sync_every)
        raise ConfigError(
            f"{fields} trains on trajectories sampled with weights up to {bound} step(s) old: the importance "
            "correction needs the sampler's log-probs; set objective.old_logprobs: data (or "
            "objective.importance_truncation > 0 with recomputed old log-probs)"
        )


@dataclass
class SampledStep:
    """One step's share of this rank, sampled ahead."""

    version: int
    results: list
    """The slots' :class:`~ds_tree.rollout.online.SlotResult` s."""
    seconds: float
    """Time spent sampling and scoring them."""


class AheadSampler:
    """One rank's background sampler (module docstring). ``sample(step, version)`` returns the rank's slot
    results of ``step``; it runs on this object's thread, which makes no collective call."""

    def __init__(
        self,
        sample: Callable[[int, int], list],
        *,
        start: int,
        max_staleness: int,
        sync_every: int,
        end: int,
        samples: Callable[[int], bool] = lambda step: True,
        join_timeout_s: float = 5.0,
    ) -> None:
        self.sample = sample
        self.samples = samples
        """Whether a step samples (a multi-turn run's SFT steps do not: the thread passes over them)."""
        self.join_timeout_s = join_timeout_s
        """How long :meth:`close` waits for the step being sampled to stop."""
        self.end = end
        """The run's last step + 1 (``max_steps``): never sampled."""
        self.start = start
        self.max_staleness = max_staleness
        self.sync_every = sync_every
        self.condition = threading.Condition()
        self.version = start
        """The version the engine holds (set by the trainer's thread after each sync)."""
        self.allowed = start - 1
        """The last step the thread may sample: the trainer's current step + max_staleness."""
        self.next_step = start
        self.done: dict[int, SampledStep] = {}
        self.error: str | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="ahead-sampler", daemon=True)
        self.thread.start()

    # ----------------------------------------------------------------- the sampling thread
    def _ready(self) -> bool:
        step = self.next_step
        if self.closed or (step < self.end and not self.samples(step)):
            return True
        target = sampling_version(step, self.start, self.max_staleness, self.sync_every)
        return step <= min(self.allowed, self.end - 1) and self.version >= target

    def _run(self) -> None:
        while True:
            with self.condition:
                self.condition.wait_for(self._ready)
                if self.closed:
                    return
                step, version = self.next_step, self.version
                if not self.samples(step):  # nothing to sample: passed over at once
                    self.next_step = step + 1
                    self.condition.notify_all()
                    continue
            started = time.perf_counter()
            try:
                results = self.sample(step, version)
            except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread, which raises it
                with self.condition:
                    if self.closed:  # stopped by close() mid-step (a multi-turn episode): nothing to hand over
                        return
                    self.error = f"sampling step {step + 1} ahead of training: {type(error).__name__}: {error}"
                    self.condition.notify_all()
                return
            with self.condition:
                self.done[step] = SampledStep(version, results, time.perf_counter() - started)
                self.next_step = step + 1
                self.condition.notify_all()

    # ------------------------------------------------------------------ the trainer's thread
    def _wait(self, predicate: Callable[[], bool]) -> str | None:
        """Wait until ``predicate`` holds (None) or the thread failed (its error). The thread's own waits are
        bounded (each engine request by ``rollout.vllm.timeout_s`` and its retries), so this one is too."""
        with self.condition:
            while not predicate():
                if self.error is not None:
                    return self.error
                if not self.thread.is_alive():
                    return "the background sampler stopped"
                self.condition.wait(timeout=1.0)
            return None

    def before_sync(self, step: int) -> str | None:
        """Wait until every step sampled with the engine's current version is done (before a sync at ``step``)."""
        return self._wait(lambda: self.next_step >= min(step + self.max_staleness, self.end))

    def synced(self, version: int) -> None:
        with self.condition:
            self.version = version
            self.condition.notify_all()

    def begin(self, step: int) -> None:
        """The trainer starts ``step``: the thread may sample up to ``step + max_staleness``."""
        with self.condition:
            self.allowed = max(self.allowed, step + self.max_staleness)
            self.condition.notify_all()

    def take(self, step: int) -> tuple[SampledStep | None, str | None]:
        """``step``'s results (waiting for them), or the thread's error."""
        error = self._wait(lambda: step in self.done)
        with self.condition:
            return self.done.pop(step, None), error

    def close(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify_all()
        self.thread.join(timeout=self.join_timeout_s)
