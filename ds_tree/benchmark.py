"""Tree vs flat training speed on the same model, weights, data and kernels.

Each mode gets its own copy of the model (same seed, so the same weights) and its own AdamW;
steps alternate between modes so that both see the same machine conditions, and every step of
every mode trains the same groups. A step is: pack (tries, parts, rows), forward and backward of
every row, optimizer step. Times are medians over the measured steps.

Ideal speedup = tokens the flat mode computes / tokens the tree mode computes (duplicated prefix
context of split trees and padding included): what a perfectly token-proportional trainer would
gain. Efficiency = measured speedup / ideal.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ds_tree.data.sampler import StepSampler
from ds_tree.engine.step import run_rows
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


def step_once(model, optimizer, trajectories, mode, budget, block, normalisation, measure_memory) -> dict:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    rows = pack_trajectories(trajectories, mode, budget, block)
    normalisers = Normalisers.from_rows(rows)
    packed = time.perf_counter()
    saved = 0
    backward = torch.Tensor.backward
    if measure_memory:  # per row: rows run one after another, so the peak is the largest row's
        for row in rows:
            meter = SavedTensorMeter()
            with meter.context():
                run_rows(model, [row], normalisers, normalisation, backward=backward)
            saved = max(saved, meter.total)
    else:
        run_rows(model, rows, normalisers, normalisation, backward=backward)
    computed = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    done = time.perf_counter()
    return {
        "step": done - started,
        "pack": packed - started,
        "forward_backward": computed - packed,
        "optimizer": done - computed,
        "packed_tokens": sum(row.n_tokens for row in rows),
        "visible_pairs": sum(part.visible_pairs for row in rows for part in row.parts),
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
    progress=None,
    profile_path=None,
) -> dict:
    """Interleaved tree/flat steps; returns the report (see ``ds_tree.cli.bench``)."""
    groups = group_trajectories(trajectories)
    per_step = groups_per_step or len(groups)
    sampler = StepSampler(len(groups), per_step, seed)
    models, optimizers, times = {}, {}, {}
    for mode in modes:
        models[mode] = load_model(model_source, attention=attention, dtype=dtype, seed=seed)
        optimizers[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-4, fused=True)  # as the trainer
        times[mode] = ModeTimes()
    check_vocab(trajectories, models[modes[0]].config.vocab_size)
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
            result = step_once(
                models[mode], optimizers[mode], batch, mode, budget, block, normalisation,
                measure_memory=measured and step == warmup,
            )
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
                step_once(models[mode], optimizers[mode], batch, mode, budget, block, normalisation, False)
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
    return report
