"""Tree vs flat training speed on the same model, weights, data and kernels.

Each mode gets its own copy of the model (same seed, so the same weights) and its own AdamW;
steps alternate between modes so that both see the same machine conditions, and every step of
every mode trains the same groups. An SFT step is: pack (tries, parts, rows), forward and backward
of every row, optimizer step. An RL step (``objective``: GRPO/PPO, docs/RL.md) is what the trainer
does with one mini-batch: pack and compute the advantages, the old policy's no-grad forward
(per-token sums, old and reference log-probs: :func:`~ds_tree.objectives.rl_rows.prepare_rl_rows`),
then ``ppo_epochs`` updates, each a forward and backward of every row
(:func:`~ds_tree.objectives.rl_rows.run_rl_rows`) and an optimizer step. Times are medians over the
measured steps.

Ideal speedup = tokens the flat mode computes / tokens the tree mode computes (duplicated prefix
context of split trees and padding included): what a perfectly token-proportional trainer would
gain. Efficiency = measured speedup / ideal.

Attention costs per visible (query, key) pair, the rest per token, and the tokens a tree saves are
short-context prefix tokens: so the token ideal can be out of reach by construction. The
cost-weighted ideal (SFT) prices each mode's step as ``a * tokens + b * visible pairs``, with ``a``
and ``b`` fitted to every measured row of both modes (:func:`fit_token_pair_cost`);
``efficiency_cost`` = speedup / that ideal.

A vision-language model's tower works on the images of the rows: a tree's distinct images once
(a split tree's parts each encode the images of their ancestor path), the flat baseline's each
trajectory's. Its calls, images and patches are counted during the measured steps
(:mod:`ds_tree.bench.vision`), and the ideal with patches prices each mode's step as packed tokens
+ ``patch_weight`` x patches, a patch weighing the tower's matrix-multiply weights per patch over
the decoder's per token (the dense FLOPs rule); ``efficiency_with_patches`` = speedup / that ideal.
SFT also gives the ideal at this machine's prices (``..._measured``): the tower timed alone per
patch, a token at the rest of the forward-and-backward time (:func:`measured_prices`).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ds_tree.bench.clock import synchronize
from ds_tree.bench.frozen_model_steps import FROZEN_MODEL_KINDS, FrozenModel
from ds_tree.bench.vision import TowerCounter, distinct_images, patch_weight, row_images, tower_seconds_per_patch
from ds_tree.config import ObjectiveConfig
from ds_tree.data.sampler import StepSampler
from ds_tree.engine.dfs import DfsSettings, WalkStats
from ds_tree.losses.advantages import estimate
from ds_tree.losses.sft import Normalisers
from ds_tree.memory.meters import PeakSavedMeter, SavedTensorMeter
from ds_tree.memory.predict import profiled_peak_bytes
from ds_tree.models.loading import load_model, parse_dtype
from ds_tree.models.vision import attach_rope_positions
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.objectives.sft import run_rows
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
    rows: list[list[tuple[int, int, float]]] = field(default_factory=list)
    """SFT: per step, every row's (tokens, visible pairs, forward+backward seconds), for the cost fit."""
    calls: list[int] = field(default_factory=list)
    """Forward-and-backward model calls of a step (RL: of one update): rows, or a walk's chunks."""
    images: list[int] = field(default_factory=list)
    """The distinct images of a step's rows (one pass), and their patches (:func:`~ds_tree.bench.vision.row_images`)."""
    patches: list[int] = field(default_factory=list)
    tower_calls: list[int] = field(default_factory=list)
    """Vision-language models: the tower's calls in a step (every pass), and the images and patches they
    encoded (:class:`~ds_tree.bench.vision.TowerCounter`)."""
    tower_images: list[int] = field(default_factory=list)
    tower_patches: list[int] = field(default_factory=list)


def check_data(trajectories, config) -> None:
    """Token ids within the language model's vocabulary; images' rope positions by the model's rule."""
    check_vocab(trajectories, config.get_text_config().vocab_size)
    attach_rope_positions(config, trajectories)


def run_measuring(run, items: list, measure_memory: bool, exclude=()) -> int:
    """``run(items)``; when measuring, one item at a time (rows run one after another, so the peak
    is the largest row's) under a :class:`SavedTensorMeter` (not counting ``exclude``'s storages). Returns
    the largest saved bytes (0 if not measured)."""
    if not measure_memory:
        run(items)
        return 0
    exclude = list(exclude)
    saved = 0
    for item in items:
        meter = SavedTensorMeter(exclude)
        with meter.context():
            run([item])
        saved = max(saved, meter.total)
    return saved


def row_counts(rows) -> dict:
    return {
        "packed_tokens": sum(row.n_tokens for row in rows),
        "visible_pairs": sum(part.visible_pairs for row in rows for part in row.parts),
        **row_images(rows),
    }


def step_once(
    model,
    optimizer,
    trajectories,
    mode,
    budget,
    block,
    normalisation,
    measure_memory,
    dfs_settings=None,
    device: str = "cpu",
) -> dict:
    """One SFT step (``dfs``: :func:`dfs_step_once` with ``dfs_settings``) on ``device``."""
    if mode == "dfs":
        return dfs_step_once(model, optimizer, trajectories, normalisation, measure_memory, dfs_settings)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    rows = pack_trajectories(trajectories, mode, budget, block)
    normalisers = Normalisers.from_rows(rows)
    packed = time.perf_counter()
    backward = torch.Tensor.backward
    row_times = []

    def run_timed(some):  # one row at a time, as run_rows runs them, each row timed for the cost fit
        for row in some:
            row_started = time.perf_counter()
            run_rows(model, [row], normalisers, normalisation, backward=backward, device=device)
            synchronize(device)
            row_times.append((row.n_tokens, sum(p.visible_pairs for p in row.parts), time.perf_counter() - row_started))

    saved = run_measuring(run_timed, rows, measure_memory)
    computed = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    done = time.perf_counter()
    return {
        "step": done - started,
        "pack": packed - started,
        "forward_backward": computed - packed,
        "optimizer": done - computed,
        **row_counts(rows),
        "calls": len(rows),
        "saved_bytes": saved,
        "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        "rows": row_times,
    }


def dfs_step_once(model, optimizer, trajectories, normalisation, measure_memory, settings: DfsSettings) -> dict:
    """One SFT step of the dfs walk (:mod:`ds_tree.engine.dfs`), every tree one row.

    Its memory is the peak of what autograd holds at once (:class:`~ds_tree.memory.meters.PeakSavedMeter`,
    parameters included as :class:`SavedTensorMeter` includes them) plus the cached keys and values
    with their gradients: the walk frees each chunk's graph at the chunk's backward.
    """
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    rows = pack_trajectories(trajectories, "dfs", settings.chunk)
    normalisers = Normalisers.from_rows(rows)
    packed = time.perf_counter()
    meter, stats = PeakSavedMeter(), WalkStats()
    with meter.context() if measure_memory else contextlib.nullcontext():
        run_rows(
            model,
            rows,
            normalisers,
            normalisation,
            "exact",
            dfs=settings,
            backward_for=lambda n: torch.Tensor.backward,
            stats=stats,
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
        "calls": stats.chunks,
        "saved_bytes": meter.peak + stats.peak_cache_bytes if measure_memory else 0,
        "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        "rows": [],
    }


def fit_token_pair_cost(rows: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Seconds per token ``a`` and per visible pair ``b`` of ``seconds ~ a * tokens + b * pairs``: least
    squares over rows of both modes, each weighted by 1 / seconds (relative errors, so that the long flat
    rows do not outweigh the short tree rows), both coefficients kept >= 0 (else the best one-term fit)."""
    tokens, pairs, seconds = (np.array(column, dtype=np.float64) for column in zip(*rows, strict=True))
    design = np.stack([tokens, pairs], axis=1) / seconds[:, None]
    target = np.ones_like(seconds)
    (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    fits = []
    for column in (0, 1):
        x = design[:, column]
        coefficient = max(0.0, float(x @ target / (x @ x)))
        fits.append((float(np.sum((x * coefficient - target) ** 2)), column, coefficient))
    _, column, coefficient = min(fits)
    return (coefficient, 0.0) if column == 0 else (0.0, coefficient)


def rl_step_once(
    model,
    optimizer,
    reference,
    trajectories,
    mode,
    budget,
    block,
    objective: ObjectiveConfig,
    measure_memory,
    dfs_settings: DfsSettings | None = None,
    device: str = "cpu",
) -> dict:
    """One RL step: rows and advantages, the old policy's no-grad pass, ``objective.ppo_epochs`` updates.

    The memory measured is the first update's (the no-grad pass saves nothing for backward); in mode
    ``dfs`` (every tree walked with ``dfs_settings``) as :func:`dfs_step_once` measures it.
    """
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    settings = objective.rl_settings()
    dfs = dfs_settings if mode == "dfs" else None
    started = time.perf_counter()
    rows = pack_trajectories(trajectories, mode, dfs.chunk if dfs else budget, block)
    advantages = estimate(
        trajectories, objective.estimator, objective.normalise_advantages, tempo_coef=objective.tempo_coef
    ).by_trajectory()
    packed = time.perf_counter()
    normalisers = StepNormalisers.of(trajectories)
    prepared = prepare_rl_rows(
        model, rows, advantages, settings, normalisers, reference=reference, dfs=dfs, device=device
    )
    synchronize(device)
    old_done = time.perf_counter()
    forward_backward = optimizer_time = 0.0
    saved = 0
    calls = len(rows)
    for epoch in range(objective.ppo_epochs):
        epoch_started = time.perf_counter()
        if dfs is not None:
            meter, stats = PeakSavedMeter(), WalkStats()
            with meter.context() if measure_memory and epoch == 0 else contextlib.nullcontext():
                backward_for = lambda _: torch.Tensor.backward  # noqa: E731
                run_rl_rows(model, prepared, settings, dfs=dfs, backward_for=backward_for, stats=stats)
            if measure_memory and epoch == 0:
                saved = meter.peak + stats.peak_cache_bytes
            if epoch == 0:
                calls = stats.chunks
        else:
            saved = max(
                saved,
                run_measuring(
                    lambda some: run_rl_rows(model, some, settings, backward=torch.Tensor.backward, device=device),
                    prepared,
                    measure_memory and epoch == 0,
                ),
            )
        synchronize(device)
        epoch_computed = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
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
        "calls": calls,
        "saved_bytes": saved,
        "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
    }


@dataclass
class BenchModels:
    """One model, optimizer and (with a KL term) frozen reference per mode, from the same seed."""

    models: dict
    optimizers: dict
    references: dict

    @classmethod
    def build(cls, modes, model_source, engines, dtype, seed, checkpoint_every, device, kl: bool) -> BenchModels:
        """``engines``: each mode's attention engine."""
        models, optimizers, references = {}, {}, {}
        for mode in modes:
            attention = engines[mode]
            # made on the device itself: a 1B model's random init takes seconds on a GPU, a minute on the CPU
            with torch.device(device):
                models[mode] = load_model(
                    model_source, attention=attention, dtype=dtype, seed=seed, checkpoint_every=checkpoint_every
                ).to(device)
            optimizers[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-4, fused=True)  # as the trainer
            references[mode] = None
            if kl:
                references[mode] = load_model(model_source, attention=attention, dtype=dtype, seed=seed).to(device)
                references[mode].requires_grad_(False)
        return cls(models, optimizers, references)


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
    checkpoint_every: int = 0,
    peak_memory: bool = False,
    dfs_chunk: int = 0,
    dfs_recompute: bool = False,
    device: str = "cpu",
    flat_attention: str | None = None,
    one_mode_at_a_time: bool = False,
) -> dict:
    """Interleaved tree/flat steps; returns the report (see ``ds_tree.cli.bench``).

    ``device`` other than ``cpu`` (a GPU: ``cuda``) times SFT or RL steps of modes flat and tree,
    with the GPU synchronised before every clock read; the autograd meters do not run there.
    ``flat_attention``: the engine of mode ``flat`` (``varlen``: the flash-kernel baseline a user
    runs today; None: ``attention``, as the tree). ``one_mode_at_a_time``: instead of alternating
    the modes step by step, run all steps of one mode with only its model built, then free it, so
    each mode's peak GPU memory (``gpu_peak_memory_bytes``, torch's allocator) is its own.

    ``objective``: an RL objective (``kind`` grpo or ppo) times RL steps; ``None`` (or ``sft``)
    times SFT steps with ``normalisation``. With a KL term, each mode's reference policy is a
    frozen copy of its initial model, as the trainer's default. Mode ``dfs`` walks chunks of at most
    ``dfs_chunk`` tokens (0: ``budget``), forwarding each twice with ``dfs_recompute``.
    """
    rl = objective is not None and objective.is_rl
    frozen = None  # distillation's teacher or DPO's reference: built once, shared by the modes
    if objective is not None and objective.kind in FROZEN_MODEL_KINDS:
        if peak_memory:
            raise ValueError(
                f"--objective {objective.kind} has no activation meters (--peak-memory, --activation-checkpointing)"
            )
        frozen = FrozenModel(objective, model_source, attention, parse_dtype(dtype), seed, device)
    if device != "cpu" and (set(modes) - {"flat", "tree"} or peak_memory or profile_path):
        raise ValueError(f"--device {device} times modes flat and tree only (no memory meters or profile)")
    if one_mode_at_a_time and (peak_memory or profile_path):
        raise ValueError("one mode at a time measures the GPU's peak memory only (no memory meters or profile)")
    if frozen is not None:
        trajectories = frozen.trained(trajectories)
    groups = group_trajectories(trajectories)
    per_step = groups_per_step or len(groups)
    sampler = StepSampler(len(groups), per_step, seed)
    engines = {mode: flat_attention if mode == "flat" and flat_attention else attention for mode in modes}
    kl = rl and bool(objective.kl_coef)
    dfs_settings = DfsSettings(dfs_chunk or budget, dfs_recompute)

    def step_with(bench: BenchModels):
        towers = {mode: TowerCounter.attach(bench.models[mode], bench.references[mode]) for mode in bench.models}

        def step_of(mode: str, batch: list[Trajectory], measure_memory: bool) -> dict:
            model, optimizer = bench.models[mode], bench.optimizers[mode]
            measure = measure_memory and device == "cpu"
            tower = towers[mode]
            if tower is not None:
                tower.take()  # from zero: nothing of another step or of the memory and profile passes
            if frozen is not None:
                result = frozen.step(model, optimizer, batch, mode, budget, block, dfs_settings, device)
            elif rl:
                reference = bench.references[mode]
                result = rl_step_once(
                    model, optimizer, reference, batch, mode, budget, block, objective, measure, dfs_settings, device
                )
            else:
                result = step_once(
                    model, optimizer, batch, mode, budget, block, normalisation, measure, dfs_settings, device
                )
            return result | (tower.take() if tower is not None else {})

        return step_of

    def price_patch(model) -> float | None:  # the tower's seconds per patch on the first measured step's images
        images = distinct_images(sampler.trajectories_for_step(groups, warmup))
        if rl or patch_weight(model) is None or not images:
            return None
        return tower_seconds_per_patch(model, images, lambda: synchronize(device))

    gpu_peaks = {}
    patch_price = None
    if one_mode_at_a_time:
        times = {}
        for mode in modes:
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            bench = BenchModels.build([mode], model_source, engines, dtype, seed, checkpoint_every, device, kl)
            check_data(trajectories, bench.models[mode].config)
            patch_cost = patch_weight(bench.models[mode])
            patch_price = patch_price or price_patch(bench.models[mode])
            step_of = step_with(bench)
            timed, flat_tokens, tree_tokens = timed_steps([mode], groups, sampler, warmup, steps, step_of, progress)
            times |= timed
            if device.startswith("cuda"):
                gpu_peaks[mode] = torch.cuda.max_memory_allocated(device)
            del bench, step_of
    else:
        bench = BenchModels.build(modes, model_source, engines, dtype, seed, checkpoint_every, device, kl)
        check_data(trajectories, bench.models[modes[0]].config)
        patch_cost = patch_weight(bench.models[modes[0]])
        patch_price = price_patch(bench.models[modes[0]])
        step_of = step_with(bench)
        times, flat_tokens, tree_tokens = timed_steps(modes, groups, sampler, warmup, steps, step_of, progress)
    after = sampler.trajectories_for_step(groups, warmup + steps)  # a batch the timed steps did not see
    peak_bytes = {}
    if peak_memory and not rl:
        packed_modes = [m for m in modes if m in ("flat", "tree")]
        peak_bytes = activation_peaks(bench, packed_modes, after, budget, block, normalisation)
    if profile_path is not None:
        write_profile(profile_path, modes, after, step_of)
    report_modes = {}
    for mode in modes:
        report_modes[mode] = mode_report(times[mode], flat_tokens, tree_tokens, peak_bytes.get(mode), rl)
        report_modes[mode]["attention"] = engines[mode]
    for mode, peak in gpu_peaks.items():
        report_modes[mode]["gpu_peak_memory_bytes"] = peak
    report = {
        "steps": steps,
        "warmup": warmup,
        "groups_per_step": per_step,
        "budget": budget,
        "dtype": dtype,
        "attention": attention,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "checkpoint_every": checkpoint_every,
        "flat_tokens_per_step": float(np.mean(flat_tokens)),
        "tree_tokens_per_step": float(np.mean(tree_tokens)),
        "por": TokenCounts(sum(flat_tokens), sum(tree_tokens)).por,
        "modes": report_modes,
    }
    if len(gpu_peaks) == 2:
        report["gpu_peak_memory_tree_over_flat"] = gpu_peaks["tree"] / gpu_peaks["flat"]
    if frozen is not None:
        report["objective"] = objective.kind
        report["objective_settings"] = config_to_dict_objective(objective)
    elif rl:
        report["objective"] = objective.kind
        report["estimator"] = objective.estimator
        report["ppo_epochs"] = objective.ppo_epochs
        report["rl_settings"] = asdict(objective.rl_settings())
    ratios = mode_ratios(report_modes, times, peak_bytes, rl)
    return report | ratios | vision_ratios(report_modes, patch_cost, patch_price)


def config_to_dict_objective(objective: ObjectiveConfig) -> dict:
    """The objective's own settings for the report (distillation: the teacher and its section; DPO its section)."""
    if objective.kind == "distill":
        return {"teacher": objective.teacher, "distill": asdict(objective.distill), "ppo_epochs": objective.ppo_epochs}
    return {"dpo": asdict(objective.dpo)}


def timed_steps(modes, groups, sampler, warmup: int, steps: int, step_of, progress=None):
    """``warmup + steps`` steps of every mode on the same batches, the order alternating each step;
    the measured steps' :class:`ModeTimes` per mode and flat and tree tokens per measured step."""
    times = {mode: ModeTimes() for mode in modes}
    flat_tokens, tree_tokens = [], []
    for step in range(warmup + steps):
        batch = sampler.trajectories_for_step(groups, step)
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
    return times, flat_tokens, tree_tokens


def activation_peaks(bench: BenchModels, modes, batch, budget: int, block: int, normalisation: str) -> dict:
    """After the timed steps: each mode's largest row of ``batch`` once, then again under the profiler
    (the parameter gradients exist from the first on, so the peak is the row's activations)."""
    peaks = {}
    for mode in modes:
        rows = pack_trajectories(batch, mode, budget, block)
        largest = [max(rows, key=lambda row: row.n_tokens)]
        normalisers = Normalisers.from_rows(rows)

        def largest_row(mode=mode, largest=largest, normalisers=normalisers):
            run_rows(bench.models[mode], largest, normalisers, normalisation, backward=torch.Tensor.backward)

        largest_row()
        peaks[mode] = profiled_peak_bytes(largest_row)
        bench.optimizers[mode].zero_grad(set_to_none=True)
    return peaks


def write_profile(path, modes, batch, step_of) -> None:
    """One more step per mode under the torch profiler, its table of operators written to ``path``."""
    tables = []
    for mode in modes:
        with torch.profiler.profile() as profiler:
            step_of(mode, batch, measure_memory=False)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        tables.append(f"== {mode} ==\n{table}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(tables))


def mode_report(record: ModeTimes, flat_tokens: list, tree_tokens: list, peak: int | None, rl: bool) -> dict:
    """One mode's medians and means over the measured steps."""
    median = statistics.median(record.step)
    report = {
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
        "activation_peak_bytes": peak,
        # first touches of fresh memory: each costs microseconds, and allocator settings change them
        "page_faults_per_step": statistics.median(record.page_faults),
        "calls_per_step": float(np.mean(record.calls)),
    }
    if record.tower_calls:  # a vision-language model: its rows' images and what its tower encoded
        report |= {
            "images_per_step": float(np.mean(record.images)),
            "patches_per_step": float(np.mean(record.patches)),
            "tower_calls_per_step": float(np.mean(record.tower_calls)),
            "tower_images_per_step": float(np.mean(record.tower_images)),
            "tower_patches_per_step": float(np.mean(record.tower_patches)),
        }
    if rl:
        report |= {
            "old_forward_time_s": statistics.median(record.old_forward),
            "updates_time_s": statistics.median(record.updates),
            "old_forward_share": statistics.median(
                old / whole for old, whole in zip(record.old_forward, record.step, strict=True)
            ),
            "targets_per_step": float(np.mean(record.targets)),
        }
    return report


def mode_ratios(report_modes: dict, times: dict, peak_bytes: dict, rl: bool) -> dict:
    """The comparisons between modes: dfs over tree, and flat over tree (speedup, ideal, efficiency)."""
    report = {}
    if "dfs" in report_modes and "tree" in report_modes:  # what walking costs where packed tree mode fits too
        dfs, tree = report_modes["dfs"], report_modes["tree"]
        report["dfs_time_over_tree"] = dfs["step_time_s"] / tree["step_time_s"]
        if dfs["peak_memory_bytes"] and tree["peak_memory_bytes"]:
            report["dfs_memory_over_tree"] = dfs["peak_memory_bytes"] / tree["peak_memory_bytes"]
    if "flat" not in report_modes or "tree" not in report_modes:
        return report
    flat, tree = report_modes["flat"], report_modes["tree"]
    report["speedup"] = flat["step_time_s"] / tree["step_time_s"]
    report["ideal_speedup"] = flat["packed_tokens_per_step"] / tree["packed_tokens_per_step"]
    report["efficiency"] = report["speedup"] / report["ideal_speedup"]
    # Attention work is per visible (query, key) pair, and shared prefixes are short-context
    # tokens: the pair ratio is below the token ratio and bounds attention's own speedup.
    report["visible_pair_ratio"] = flat["visible_pairs_per_step"] / tree["visible_pairs_per_step"]
    if flat["peak_memory_bytes"] and tree["peak_memory_bytes"]:
        report["memory_ratio_tree_over_flat"] = tree["peak_memory_bytes"] / flat["peak_memory_bytes"]
    if peak_bytes:
        report["activation_peak_ratio_tree_over_flat"] = peak_bytes["tree"] / peak_bytes["flat"]
    if not rl:  # the work a step does, priced by seconds per token and per visible pair fitted on its rows
        a, b = fit_token_pair_cost([row for mode in ("flat", "tree") for step in times[mode].rows for row in step])
        flat_cost = a * flat["packed_tokens_per_step"] + b * flat["visible_pairs_per_step"]
        tree_cost = a * tree["packed_tokens_per_step"] + b * tree["visible_pairs_per_step"]
        report["cost_per_token_s"], report["cost_per_pair_s"] = a, b
        report["ideal_cost"] = flat_cost / tree_cost
        report["efficiency_cost"] = report["speedup"] / report["ideal_cost"]
    if rl:  # the two passes of a step, each flat over tree
        report["old_forward_speedup"] = flat["old_forward_time_s"] / tree["old_forward_time_s"]
        report["updates_speedup"] = flat["updates_time_s"] / tree["updates_time_s"]
        report["target_ratio"] = flat["targets_per_step"] / tree["targets_per_step"]
    return report


def vision_ratios(report_modes: dict, patch_cost: float | None, patch_price: float | None) -> dict:
    """A vision-language model's flat over tree: the ideal that counts language-model tokens and vision
    patches, a patch weighing ``patch_cost`` tokens (:func:`~ds_tree.bench.vision.patch_weight`), the
    speedup's fraction of it, and the tower's calls and encoded patches. With ``patch_price`` (SFT: the
    tower's measured seconds per patch) also the same ideal with measured prices (:func:`measured_prices`)."""
    if patch_cost is None or "flat" not in report_modes or "tree" not in report_modes:
        return {}
    flat, tree = report_modes["flat"], report_modes["tree"]
    speedup = flat["step_time_s"] / tree["step_time_s"]

    def ideal(weight: float) -> float:  # work in language-model tokens, flat over tree
        return (flat["packed_tokens_per_step"] + weight * flat["patches_per_step"]) / (
            tree["packed_tokens_per_step"] + weight * tree["patches_per_step"]
        )

    report = {
        "patch_weight": patch_cost,
        "ideal_speedup_with_patches": ideal(patch_cost),
        "efficiency_with_patches": speedup / ideal(patch_cost),
        "tower_call_ratio": flat["tower_calls_per_step"] / tree["tower_calls_per_step"],
        "tower_patch_ratio": flat["tower_patches_per_step"] / tree["tower_patches_per_step"],
    }
    token_price = measured_prices(flat, tree, patch_price) if patch_price is not None else 0.0
    if not token_price:  # RL, no images, or the tower's measured time above the whole step's
        return report
    weight = patch_price / token_price
    measured = ideal(weight)
    return report | {
        "tower_s_per_patch": patch_price,
        "lm_s_per_token": token_price,
        "patch_weight_measured": weight,
        "ideal_speedup_with_patches_measured": measured,
        "efficiency_with_patches_measured": speedup / measured,
    }


def measured_prices(flat: dict, tree: dict, patch_price: float) -> float:
    """Seconds per language-model token: both modes' forward-and-backward time less their patches at
    ``patch_price``, over both modes' packed tokens (pooled, so both modes pay the same prices; >= 0)."""
    modes = (flat, tree)
    rest = sum(m["forward_backward_time_s"] - patch_price * m["patches_per_step"] for m in modes)
    return max(0.0, rest / sum(m["packed_tokens_per_step"] for m in modes))
