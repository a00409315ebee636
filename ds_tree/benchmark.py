"""Tree vs flat training speed on the same model, weights, data and kernels.

Each mode gets its own copy of the model (same seed, so the same weights) and its own AdamW;
steps alternate between modes so that both see the same machine conditions, and every step of
every mode trains the same groups. An SFT step is: pack (tries, parts, rows), forward and backward
of every row, optimizer step. An RL step (``objective``: GRPO/PPO, docs/RL.md) is what the trainer
does with one mini-batch: pack and compute the advantages, the old policy's no-grad forward
(per-token sums, old and reference log-probs: :func:`~ds_tree.engine.rl_step.prepare_rl_rows`),
then ``ppo_epochs`` updates, each a forward and backward of every row
(:func:`~ds_tree.engine.rl_step.run_rl_rows`) and an optimizer step. Times are medians over the
measured steps.

Ideal speedup = tokens the flat mode computes / tokens the tree mode computes (duplicated prefix
context of split trees and padding included): what a perfectly token-proportional trainer would
gain. Efficiency = measured speedup / ideal.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ds_tree.config import ObjectiveConfig
from ds_tree.data.sampler import StepSampler
from ds_tree.engine.rl_step import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.engine.step import run_rows
from ds_tree.losses.advantages import ESTIMATORS
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_model
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.stats import TokenCounts, token_counts
from ds_tree.trees.trajectory import Trajectory, check_vocab, group_trajectories

BENCH_DTYPES = ("float32", "bfloat16")
"""Dtypes the benchmark's models are loaded in."""


@dataclass
class ModeTimes:
    step: list[float] = field(default_factory=list)
    pack: list[float] = field(default_factory=list)
    forward_backward: list[float] = field(default_factory=list)
    optimizer: list[float] = field(default_factory=list)
    packed_tokens: list[int] = field(default_factory=list)
    visible_pairs: list[int] = field(default_factory=list)
    saved_bytes: list[int] = field(default_factory=list)
    page_faults: list[int] = field(default_factory=list)
    old_forward: list[float] = field(default_factory=list)
    """RL: the no-grad pass before the updates (per-token sums, old and reference log-probs)."""
    updates: list[float] = field(default_factory=list)
    """RL: every update epoch's forward, backward and optimizer step."""
    targets: list[int] = field(default_factory=list)
    """RL: tokens the LM head scores in one pass (owned tokens with a non-zero sum)."""


class SavedTensorMeter:
    """Bytes of distinct tensors autograd saves for backward: the activation memory of a step."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run_measuring(run, items: list, measure_memory: bool) -> int:
    """``run(items)``; when measuring, one item at a time (rows run one after another, so the peak
    is the largest row's) under a :class:`SavedTensorMeter`. Returns the largest saved bytes (0 if not measured)."""
    if not measure_memory:
        run(items)
        return 0
    saved = 0
    for item in items:
        meter = SavedTensorMeter()
        with meter.context():
            run([item])
        saved = max(saved, meter.total)
    return saved


def row_counts(rows) -> dict:
    return {
        "packed_tokens": sum(row.n_tokens for row in rows),
        "visible_pairs": sum(part.visible_pairs for row in rows for part in row.parts),
    }


def step_once(model, optimizer, trajectories, mode, budget, block, normalisation, measure_memory) -> dict:
    """One SFT step."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    rows = pack_trajectories(trajectories, mode, budget, block)
    normalisers = Normalisers.from_rows(rows)
    packed = time.perf_counter()
    backward = torch.Tensor.backward
    saved = run_measuring(
        lambda some: run_rows(model, some, normalisers, normalisation, backward=backward), rows, measure_memory
    )
    computed = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    done = time.perf_counter()
    return {
        "step": done - started,
        "pack": packed - started,
        "forward_backward": computed - packed,
        "optimizer": done - computed,
        **row_counts(rows),
        "saved_bytes": saved,
        "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
    }


def rl_step_once(
    model, optimizer, reference, trajectories, mode, budget, block, objective: ObjectiveConfig, measure_memory
) -> dict:
    """One RL step: rows and advantages, the old policy's no-grad pass, ``objective.ppo_epochs`` updates.

    The memory measured is the first update's (the no-grad pass saves nothing for backward).
    """
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    settings = objective.rl_settings()
    started = time.perf_counter()
    rows = pack_trajectories(trajectories, mode, budget, block)
    computed = ESTIMATORS[objective.estimator](trajectories, normalise=objective.normalise_advantages)
    advantages = {id(t): a for t, a in zip(trajectories, computed.values, strict=True)}
    packed = time.perf_counter()
    prepared = prepare_rl_rows(model, rows, advantages, settings, StepNormalisers.of(trajectories), reference=reference)
    old_done = time.perf_counter()
    forward_backward = optimizer_time = 0.0
    saved = 0
    for epoch in range(objective.ppo_epochs):
        epoch_started = time.perf_counter()
        saved = max(
            saved,
            run_measuring(
                lambda some: run_rl_rows(model, some, settings, backward=torch.Tensor.backward),
                prepared,
                measure_memory and epoch == 0,
            ),
        )
        epoch_computed = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        forward_backward += epoch_computed - epoch_started
        optimizer_time += time.perf_counter() - epoch_computed
    done = time.perf_counter()
    return {
        "step": done - started,
        "pack": packed - started,
        "old_forward": old_done - packed,
        "updates": done - old_done,
        "forward_backward": forward_backward,
        "optimizer": optimizer_time,
        **row_counts(rows),
        "targets": sum(item.targets.size for item in prepared),
        "saved_bytes": saved,
        "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
    }


def run_benchmark(
    trajectories: list[Trajectory],
    model_source: str,
    modes: list[str],
    steps: int,
    *,
    budget: int = 4096,
    block: int = 1,
    groups_per_step: int | None = None,
    warmup: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    attention: str = "torch",
    normalisation: str = "token_mean",
    objective: ObjectiveConfig | None = None,
    progress=None,
    profile_path=None,
) -> dict:
    """Interleaved tree/flat steps; returns the report (see ``ds_tree.cli.bench``).

    ``objective``: an RL objective (``kind`` grpo or ppo) times RL steps; ``None`` (or ``sft``)
    times SFT steps with ``normalisation``. With a KL term, each mode's reference policy is a
    frozen copy of its initial model, as the trainer's default.
    """
    rl = objective is not None and objective.is_rl
    groups = group_trajectories(trajectories)
    per_step = groups_per_step or len(groups)
    sampler = StepSampler(len(groups), per_step, seed)
    models, optimizers, times = {}, {}, {}
    for mode in modes:
        models[mode] = load_model(model_source, attention=attention, dtype=dtype, seed=seed)
        optimizers[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-4, fused=True)  # as the trainer
        times[mode] = ModeTimes()
    check_vocab(trajectories, models[modes[0]].config.vocab_size)
    references = {mode: None for mode in modes}
    if rl and objective.kl_coef:
        for mode in modes:
            references[mode] = load_model(model_source, attention=attention, dtype=dtype, seed=seed)
            references[mode].requires_grad_(False)

    def step_of(mode: str, batch: list[Trajectory], measure_memory: bool) -> dict:
        if rl:
            return rl_step_once(
                models[mode], optimizers[mode], references[mode], batch, mode, budget, block, objective,
                measure_memory,
            )
        return step_once(models[mode], optimizers[mode], batch, mode, budget, block, normalisation, measure_memory)

    flat_tokens, tree_tokens = [], []
    for step in range(warmup + steps):
        batch = [t for g in sampler.groups_for_step(step) for t in groups[g]]
        measured = step >= warmup
        if measured:
            counts = token_counts(batch)
            flat_tokens.append(counts.flat_tokens)
            tree_tokens.append(counts.tree_tokens)
        order = modes if step % 2 == 0 else modes[::-1]  # alternate who goes first
        for mode in order:
            result = step_of(mode, batch, measure_memory=measured and step == warmup)
            if measured:
                record = times[mode]
                for key, value in result.items():
                    if key != "saved_bytes" or value:
                        getattr(record, key).append(value)
        if progress is not None:
            progress.update(1)

    if profile_path is not None:  # one more step per mode under the torch profiler
        batch = [t for g in sampler.groups_for_step(warmup + steps) for t in groups[g]]
        tables = []
        for mode in modes:
            with torch.profiler.profile() as profiler:
                step_of(mode, batch, measure_memory=False)
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            tables.append(f"== {mode} ==\n{table}")
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profile_path.write_text("\n".join(tables))

    report_modes = {}
    for mode in modes:
        record = times[mode]
        median = statistics.median(record.step)
        report_modes[mode] = {
            "step_time_s": median,
            "step_times_s": record.step,
            "pack_time_s": statistics.median(record.pack),
            "forward_backward_time_s": statistics.median(record.forward_backward),
            "optimizer_time_s": statistics.median(record.optimizer),
            "packed_tokens_per_step": float(np.mean(record.packed_tokens)),
            "visible_pairs_per_step": float(np.mean(record.visible_pairs)),
            "flat_tokens_per_s": float(np.mean(flat_tokens)) / median,
            "unique_tokens_per_s": float(np.mean(tree_tokens)) / median,
            "peak_memory_bytes": max(record.saved_bytes) if record.saved_bytes else None,
            # first touches of fresh memory: each costs microseconds, and allocator settings change them
            "page_faults_per_step": statistics.median(record.page_faults),
        }
        if rl:
            report_modes[mode] |= {
                "old_forward_time_s": statistics.median(record.old_forward),
                "updates_time_s": statistics.median(record.updates),
                "old_forward_share": statistics.median(
                    old / whole for old, whole in zip(record.old_forward, record.step, strict=True)
                ),
                "targets_per_step": float(np.mean(record.targets)),
            }
    report = {
        "steps": steps,
        "warmup": warmup,
        "groups_per_step": per_step,
        "budget": budget,
        "dtype": dtype,
        "attention": attention,
        "threads": torch.get_num_threads(),
        "flat_tokens_per_step": float(np.mean(flat_tokens)),
        "tree_tokens_per_step": float(np.mean(tree_tokens)),
        "por": TokenCounts(sum(flat_tokens), sum(tree_tokens)).por,
        "modes": report_modes,
    }
    if rl:
        report["objective"] = objective.kind
        report["estimator"] = objective.estimator
        report["ppo_epochs"] = objective.ppo_epochs
        report["rl_settings"] = asdict(objective.rl_settings())
    if "flat" in modes and "tree" in modes:
        flat, tree = report_modes["flat"], report_modes["tree"]
        report["speedup"] = flat["step_time_s"] / tree["step_time_s"]
        report["ideal_speedup"] = flat["packed_tokens_per_step"] / tree["packed_tokens_per_step"]
        report["efficiency"] = report["speedup"] / report["ideal_speedup"]
        # Attention work is per visible (query, key) pair, and shared prefixes are short-context
        # tokens: the pair ratio is below the token ratio and bounds attention's own speedup.
        report["visible_pair_ratio"] = flat["visible_pairs_per_step"] / tree["visible_pairs_per_step"]
        if flat["peak_memory_bytes"] and tree["peak_memory_bytes"]:
            report["memory_ratio_tree_over_flat"] = tree["peak_memory_bytes"] / flat["peak_memory_bytes"]
        if rl:  # the two passes of a step, each flat over tree
            report["old_forward_speedup"] = flat["old_forward_time_s"] / tree["old_forward_time_s"]
            report["updates_speedup"] = flat["updates_time_s"] / tree["updates_time_s"]
            report["target_ratio"] = flat["targets_per_step"] / tree["targets_per_step"]
    return report
