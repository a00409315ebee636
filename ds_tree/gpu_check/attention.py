"""``gpu-check``'s attention sections: every engine against the float64 reference, then the kernel table.

**Correctness.** For each case (a tree shape, query/key-value heads, head dim, window, soft cap) one
packed tree row and its flat row get float64 leaves; the dense reference gives the output and the
gradients of a fixed output gradient. Each engine then runs the same leaves cast to float32 and to
bfloat16, forward and backward, through :func:`ds_tree.attention.registry.tree_attention` (so a
fault in any registered engine is seen). Its error is ``max |x - ref| / max |ref|`` of the output and
of dq, dk, dv; the bar is the larger of a floor (:data:`FLOORS`) and twice the error of the dense
reference itself run in the same dtype (the principled bf16 rule: no worse than twice PyTorch's own
implementation at that precision). Tree engines run the tree row; ``varlen`` (flat rows only) runs
the flat row. Where an engine cannot run (no backward on the CPU for flex, no CUDA for varlen) the
entry says so and is not a failure.

**Kernel table.** The shapes of the measurement that motivated ``model.attention: auto``
(docs/KERNEL.md) and issue 46's (tiny tool-call nodes, one ~64K-token row), bf16, 32 query / 8
key-value heads, head dim 128, forward + backward: each tree engine on the tree row, the Triton
kernel on both tile schedules (``loop``, ``list``) and, on a GPU, with the configuration
``autotune`` picked for the row's length bucket; the Triton kernel and the flash varlen kernel on the
flat row; SDPA on the flat paths padded to one batch (cuDNN where it runs); dense causal SDPA at the
tree row's length (the chip's ceiling). Useful TFLOP/s = visible (query, key) pairs of the layout x 4 x D x Hq x 3.5 /
time (backward = 2.5x the forward). FlexAttention's first call per length bucket includes its
compile: :func:`kernel_table` reports it per bucket.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.attention.engines import registered
from ds_tree.attention.flex import length_bucket
from ds_tree.attention.registry import attention_engine, has_backward, tree_attention, tree_engines
from ds_tree.data.synthetic import SyntheticConfig, generate
from ds_tree.kernel.tile_lists import SCHEDULE_VARIABLE
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.random_trees import TreeShape, random_forest
from ds_tree.trees.trajectory import Trajectory


@contextmanager
def tile_schedule(schedule: str | None) -> Iterator[None]:
    """Within the block the Triton engine runs ``schedule`` (``$DS_TREE_TRITON_TILES``); None: unchanged."""
    saved = os.environ.get(SCHEDULE_VARIABLE)
    if schedule is not None:
        os.environ[SCHEDULE_VARIABLE] = schedule
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(SCHEDULE_VARIABLE, None)
        else:
            os.environ[SCHEDULE_VARIABLE] = saved


def engine_entries(engines: tuple[str, ...]) -> list[tuple[str, str, str | None]]:
    """``(name in the report, registered engine, tile schedule)``: an engine with tile schedules once per
    schedule (Triton: ``triton`` is its default, the loop schedule, ``triton list`` the full/partial tile
    lists of issue 46)."""
    found = []
    for engine in engines:
        for index, schedule in enumerate(attention_engine(engine).tile_schedules or (None,)):
            found.append((engine if index == 0 else f"{engine} {schedule}", engine, schedule))
    return found


def flat_engines() -> tuple[str, ...]:
    """The engines that run flat rows only (varlen): checked on the flat row."""
    return tuple(name for name, engine in registered() if engine.flat_rows_only)


FLOORS = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
"""Relative error below which an engine passes whatever the reference's own error in that dtype."""
FLOPS_PER_PAIR_HEAD_DIM = 4 * 3.5
"""Forward (two matmuls: 4 flops per pair and dimension) plus a backward of 2.5 forwards."""


@dataclass(frozen=True)
class Case:
    name: str
    trajectories: list
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    softcap: float | None = None


def forest(seed: int, trees: int, depth: int, branching: int, node_len: int) -> list[Trajectory]:
    """A random forest as ``ds-tree bench-kernel`` draws it (node lengths uniform in [1, 2 node_len - 1])."""
    shape = TreeShape(trees=trees, depth=depth, children=(1, branching), node_tokens=(1, 2 * node_len - 1))
    return random_forest(random.Random(seed), shape)


def grpo_groups(seed: int, prompts: int, prompt_len: int, completions: int, lengths: tuple[int, int]) -> list:
    """``prompts`` groups: a shared prompt of ``prompt_len`` tokens, ``completions`` samples each."""
    rng = np.random.default_rng(seed)
    found = []
    for group in range(prompts):
        prompt = rng.integers(3, 1000, prompt_len)
        for index in range(completions):
            completion = rng.integers(3, 1000, int(rng.integers(lengths[0], lengths[1] + 1)))
            ids = np.concatenate([prompt, completion])
            mask = np.concatenate([np.zeros(prompt_len), np.ones(len(completion))])
            found.append(
                Trajectory(ids, mask, group_id=f"p{group}", reward=float(index % 2), source=f"p{group}:{index}")
            )
    return found


def agent_trials(seed: int, tasks: int, por: float, max_tokens: int) -> list[Trajectory]:
    """Synthetic agent trials (``ds-tree make-synthetic``): ``tasks`` groups of 8 trials at ``por``."""
    return list(generate(SyntheticConfig(groups=tasks, por=por, trials=8, max_tokens=max_tokens, seed=seed)))


def correctness_cases(smoke: bool) -> list[Case]:
    """Tree shapes x GQA 1/2/4 x windows and soft caps; rows longer than one tile of every engine."""
    if smoke:  # the Triton interpreter and eager flex on 2 CPU cores: tiny rows, still several tiles
        small, long = forest(1, 2, 3, 2, 6), forest(2, 1, 3, 3, 16)
        return [
            Case("small forest, MHA", small, 2, 2, 16),
            Case("long row, GQA 2, window 9", long, 4, 2, 16, window=9),
            Case("small forest, GQA 4, soft cap 0.5", small, 4, 1, 16, softcap=0.5),
        ]
    # the dense float64 reference holds [heads, N, N] scores and their gradient: rows of at most a few
    # thousand tokens (a 24K-token row asked for 100 GiB on an H200)
    many, long = forest(1, 8, 4, 3, 16), forest(2, 1, 3, 3, 200)
    return [
        Case("forest of small nodes, MHA", many, 8, 8, 128),
        Case("forest of small nodes, GQA 2, soft cap 30", many, 8, 4, 64, softcap=30.0),
        Case("long row, GQA 4, window 512", long, 16, 4, 128, window=512),
        Case("GRPO group, GQA 4", grpo_groups(3, 1, 300, 6, (50, 400)), 16, 4, 128),
    ]


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().item()
    return (value.double() - reference).abs().max().item() / (scale or 1.0)


def _row_tensors(row, device) -> tuple[torch.Tensor, torch.Tensor]:
    kv_end = torch.as_tensor(row.kv_end, device=device)[None]
    positions = torch.as_tensor(row.position_ids, device=device)[None]
    return kv_end, positions


def _run(engine: str, leaves, grad, kv_end, positions, case: Case, dtype, backward: bool):
    """Output and (with ``backward``) the three gradients of ``engine`` on leaves cast to ``dtype``."""
    cast = [leaf.detach().to(dtype).requires_grad_(backward) for leaf in leaves]
    options = {"window": case.window, "softcap": case.softcap}
    if case.window is not None:
        options["positions"] = positions
    if not backward:
        with torch.no_grad():
            return [tree_attention(*cast, kv_end, None, engine, **options)]
    out = tree_attention(*cast, kv_end, None, engine, **options)
    out.backward(grad.to(dtype))
    return [out, *(leaf.grad for leaf in cast)]


def check_case(case: Case, engines: tuple[str, ...], device: str, dtypes, seed: int = 0) -> list[dict]:
    """Every engine of ``engines`` (and ``varlen`` on the flat row) on one case, in each dtype."""
    budget = sum(len(t) for t in case.trajectories)
    rows = {layout: pack_trajectories(case.trajectories, layout, budget)[0] for layout in ("tree", "flat")}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    results = []
    for layout, row in rows.items():
        kv_end, positions = _row_tensors(row, device)
        n = kv_end.shape[-1]
        leaves = [
            torch.randn(1, h, n, case.head_dim, generator=generator, dtype=torch.float64).to(device)
            for h in (case.heads, case.kv_heads, case.kv_heads)
        ]
        grad = torch.randn(1, n, case.heads, case.head_dim, generator=generator, dtype=torch.float64).to(device)
        reference = _run("reference", leaves, grad, kv_end, positions, case, torch.float64, True)
        entries = engine_entries(engines if layout == "tree" else flat_engines())
        for dtype in dtypes:
            own = _run("reference", leaves, grad, kv_end, positions, case, dtype, True)
            baseline = max(relative_error(x, r) for x, r in zip(own, reference, strict=True))
            for name, engine, schedule in entries:
                with tile_schedule(schedule):
                    entry = _check_engine(
                        engine, layout, case, leaves, grad, kv_end, positions, dtype, reference, baseline
                    )
                results.append(entry | {"engine": name, "tokens": n})
    return results


def _check_engine(engine, layout, case, leaves, grad, kv_end, positions, dtype, reference, baseline) -> dict:
    entry = {"case": case.name, "engine": engine, "layout": layout, "dtype": str(dtype).removeprefix("torch.")}
    backward = has_backward(engine, kv_end.device)
    tolerance = max(FLOORS[dtype], 2 * baseline)
    try:
        outputs = _run(engine, leaves, grad, kv_end, positions, case, dtype, backward)
    except Exception as error:  # noqa: BLE001 - an engine that cannot run here is reported, not raised
        unavailable = type(error).__name__ in ("VarlenUnavailable", "FlexBackwardUnavailable")
        return entry | {
            "ran": False,
            "passed": None if unavailable else False,
            "error": f"{type(error).__name__}: {error}",
        }
    names = ("out", "dq", "dk", "dv")[: len(outputs)]
    errors = {name: relative_error(x, r) for name, x, r in zip(names, outputs, reference, strict=False)}
    return entry | {
        "ran": True,
        "checked": "forward+backward" if backward else "forward only",
        "errors": errors,
        "reference_error_same_dtype": baseline,
        "tolerance": tolerance,
        "passed": all(value <= tolerance for value in errors.values()),
    }


def correctness(device: str, smoke: bool, progress=print) -> dict:
    """Every registered engine (``reference`` aside) against the float64 reference, float32 and bf16."""
    engines = tree_engines()
    started = time.perf_counter()
    results = []
    errors = []
    for case in correctness_cases(smoke):
        progress(f"correctness: {case.name}")
        try:
            results.extend(check_case(case, engines, device, (torch.float32, torch.bfloat16)))
        except Exception as error:  # noqa: BLE001 - the case is reported failed, the others still run
            errors.append(f"{case.name}: {type(error).__name__}: {str(error)[:300]}")
        if device == "cuda":
            torch.cuda.empty_cache()
    failed = [r for r in results if r["passed"] is False]
    return {
        "passed": not failed and not errors,
        "seconds": time.perf_counter() - started,
        "failed": [f"{r['engine']} ({r['layout']}, {r['dtype']}) on {r['case']}" for r in failed] + errors,
        "results": results,
    }


# ----------------------------------------------------------------------------------------- kernel table


def table_shapes(smoke: bool) -> dict[str, list[Trajectory]]:
    """The forests of the kernel table (docs/KERNEL.md); tiny ones for the smoke run."""
    if smoke:
        return {
            "random": forest(0, 1, 3, 2, 6),
            "grpo": grpo_groups(0, 1, 12, 2, (4, 10)),
            "tiny nodes (1-3 tokens)": forest(2, 2, 4, 3, 2),
            "long row, few branches": grpo_groups(1, 1, 40, 2, (24, 32)),
        }
    return {
        "random, 8 trees x depth 4 x <=3 children, nodes ~128": forest(0, 8, 4, 3, 128),
        "GRPO: 4 prompts of 1024 x 16 completions of 384-1152": grpo_groups(0, 4, 1024, 16, (384, 1152)),
        "agent: 2 tasks x 8 trials, POR 0.85, paths to 8K": agent_trials(0, 2, 0.85, 8192),
        "random, 4 x 3 x <=4, nodes ~512": forest(1, 4, 3, 4, 512),
        "tool-call agent: many tiny nodes (1-32 tokens)": forest(2, 16, 6, 3, 16),
        "tool calls: 128 trees x depth 4 x <=4 children, nodes 1-7 tokens": forest(3, 128, 4, 4, 4),
        "long context: a 16K prompt x 3 branches of 15-16K (one ~64K row)": grpo_groups(1, 1, 16384, 3, (15360, 16384)),
    }


def visible_pairs(kv_end: torch.Tensor) -> int:
    """Visible (query, key) pairs of a row: key ``k`` is seen by the queries ``[k, kv_end[k])``."""
    return int((kv_end - torch.arange(kv_end.shape[-1], device=kv_end.device)).sum())


def timer(smoke: bool, warmup_ms: int = 25, rep_ms: int = 100):
    """Median milliseconds of ``step`` (``triton.testing.do_bench`` on a GPU, one wall-clock call when
    ``smoke``) and the first call's milliseconds (compiles included)."""

    def measure(step, leaves) -> dict:
        started = time.perf_counter()
        step()
        if not smoke:
            torch.cuda.synchronize()
        first = (time.perf_counter() - started) * 1e3
        if smoke:
            return {"ms": first, "first_call_ms": first}
        from triton.testing import do_bench

        return {"ms": do_bench(step, warmup=warmup_ms, rep=rep_ms, grad_to_none=leaves), "first_call_ms": first}

    return measure


def _leaves(heads, kv_heads, n, head_dim, dtype, device, batch: int = 1):
    leaves = [
        torch.randn(batch, h, n, head_dim, dtype=dtype, device=device, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]
    return leaves, torch.randn(batch, n, heads, head_dim, dtype=dtype, device=device)


def engine_step(engine, kv_end, heads, kv_heads, head_dim, dtype, device):
    """Forward + backward of a registered engine on one row."""
    leaves, grad = _leaves(heads, kv_heads, kv_end.shape[-1], head_dim, dtype, device)
    return (lambda: tree_attention(*leaves, kv_end, None, engine).backward(grad)), leaves


def sdpa_step(lengths, heads, kv_heads, head_dim, dtype, device, cudnn: bool):
    """SDPA, causal, on ``len(lengths)`` sequences padded to the longest (a padded flat batch), or on
    one dense causal row of ``lengths[0]`` tokens: cuDNN's kernel where asked and available."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    longest = max(lengths)
    q, k, v = (
        torch.randn(len(lengths), h, longest, head_dim, dtype=dtype, device=device, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(len(lengths), heads, longest, head_dim, dtype=dtype, device=device)
    backends = [SDPBackend.CUDNN_ATTENTION] if cudnn else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def step():
        with sdpa_kernel(backends):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad)

    return step, [q, k, v]


def kernel_row(trajectories, smoke: bool, device: str, dtype, heads, kv_heads, head_dim, measure, tuning=None) -> dict:
    """One shape of the kernel table: every engine's time and useful TFLOP/s. ``tuning`` (on a GPU): a
    function ``(kv_end, schedule) -> record`` of ``autotune.tune``, whose winners the "tuned" columns run."""
    budget = sum(len(t) for t in trajectories)
    tree_row, flat_row = (pack_trajectories(trajectories, mode, budget)[0] for mode in ("tree", "flat"))
    tree, flat = (torch.as_tensor(r.kv_end, device=device)[None] for r in (tree_row, flat_row))
    pairs = {"tree": visible_pairs(tree), "flat": visible_pairs(flat)}
    lengths = [part.n_tokens for part in flat_row.parts]
    dense_pairs = tree.shape[-1] * (tree.shape[-1] + 1) // 2
    cudnn = device == "cuda"

    def engine(name, kv_end):
        return lambda: engine_step(name, kv_end, heads, kv_heads, head_dim, dtype, device)

    # name: (build the step, layout, Triton tile schedule, whether with the autotuned configuration)
    entries = {
        "triton tree": (engine("triton", tree), "tree", "loop", False),
        "triton list tree": (engine("triton", tree), "tree", "list", False),
    }
    if tuning is not None:
        for schedule, name in (("loop", "triton tree tuned"), ("list", "triton list tree tuned")):
            entries[name] = (engine("triton", tree), "tree", schedule, True)
    entries |= {
        "flex tree": (engine("flex", tree), "tree", None, False),
        "triton flat": (engine("triton", flat), "flat", "loop", False),
        "varlen flat": (engine("varlen", flat), "flat", None, False),
        "sdpa padded flat": (
            lambda: sdpa_step(lengths, heads, kv_heads, head_dim, dtype, device, cudnn),
            "flat",
            None,
            False,
        ),
        "dense causal at the tree's length": (
            lambda: sdpa_step([tree.shape[-1]], heads, kv_heads, head_dim, dtype, device, cudnn),
            "dense",
            None,
            False,
        ),
    }
    row = {
        "tree_tokens": tree.shape[-1],
        "flat_tokens": flat.shape[-1],
        "flat_over_tree_pairs": pairs["flat"] / pairs["tree"],
        "engines": {},
    }
    for name, (build, layout, schedule, tuned) in entries.items():
        count = dense_pairs if layout == "dense" else pairs[layout]
        if smoke and name == "flex tree":  # no FlexAttention backward on the CPU
            row["engines"][name] = {"ran": False, "error": "FlexAttention has no backward on the CPU"}
            continue
        try:
            records = [tuning(tree, schedule)] if tuned else None
            with tile_schedule(schedule), _installed(records):
                timed = measure(*build())
        except Exception as error:  # noqa: BLE001 - an engine that fails here is reported, the table goes on
            row["engines"][name] = {"ran": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        flops = count * FLOPS_PER_PAIR_HEAD_DIM * head_dim * heads
        row["engines"][name] = {"ran": True, **timed, "useful_tflops": flops / (timed["ms"] * 1e-3) / 1e12}
        if records:
            row["engines"][name]["config"] = records[0]["winner"]
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


@contextmanager
def _installed(records: list[dict] | None) -> Iterator[None]:
    """The autotuned winners of ``records`` for the block (imports the GPU-only autotune module only then)."""
    if not records:
        yield
        return
    from ds_tree.kernel.autotune import installed

    with installed(records):
        yield


class Tuning:
    """Autotune once per (length bucket, schedule) on the first row that meets it; keeps every record."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, dtype, progress) -> None:
        from ds_tree.kernel import autotune, kernels  # GPU only: never imported on the CPU path

        self.autotune, self.kernels = autotune, kernels
        self.shape = (heads, kv_heads, head_dim, dtype)
        self.progress = progress
        self.records: dict[tuple, dict] = {}

    def __call__(self, kv_end: torch.Tensor, schedule: str) -> dict:
        heads, kv_heads, head_dim, dtype = self.shape
        key = self.kernels.tuning_key(head_dim, dtype, kv_end.shape[-1], schedule)
        if key not in self.records:
            self.progress(f"kernel table: autotune {key}")
            self.records[key] = self.autotune.tune(kv_end, heads, kv_heads, head_dim, dtype, schedule)
        return self.records[key]

    def report(self) -> dict:
        return {
            "search_space": self.autotune.candidates(self.shape[2]),
            "tuned": list(self.records.values()),
        }


def kernel_table(device: str, smoke: bool, progress=print) -> dict:
    """The kernel table on :func:`table_shapes`, FlexAttention's compile time per length bucket, and (on a
    GPU) the Triton autotune: its search space, and per shape bucket and schedule every timing and the winner."""
    dtype = torch.float32 if smoke else torch.bfloat16
    heads, kv_heads, head_dim = (4, 2, 16) if smoke else (32, 8, 128)
    measure = timer(smoke)
    tuning = Tuning(heads, kv_heads, head_dim, dtype, progress) if device == "cuda" else None
    started = time.perf_counter()
    rows = {}
    for name, trajectories in table_shapes(smoke).items():
        progress(f"kernel table: {name}")
        rows[name] = kernel_row(trajectories, smoke, device, dtype, heads, kv_heads, head_dim, measure, tuning)
    compile_s = {}
    for row in rows.values():  # the first row of a bucket compiles it; a later one finds it compiled
        flex = row["engines"].get("flex tree", {})
        if flex.get("ran"):
            compile_s.setdefault(length_bucket(row["tree_tokens"]), (flex["first_call_ms"] - flex["ms"]) / 1e3)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "seconds": time.perf_counter() - started,
        "shapes": rows,
        "flex_compile_s_per_bucket": compile_s,
        "autotune": tuning.report() if tuning else {"skipped": "autotune runs on a CUDA GPU only"},
    }
