"""``gpu-check``'s end-to-end section: training steps of a 1B Llama, tree against the flash flat baseline.

Each case is :func:`ds_tree.bench.steps.run_benchmark` with the flat mode on the ``varlen`` engine
(torch's or flash-attn's variable-length flash kernel: what verl and prime-rl run) and the tree
mode on one tree engine, the modes one at a time (only one model on the GPU, so each mode's peak
GPU memory is its own), bf16, a 16K-token budget, 2 groups a step, the median of 3 steps after one
warm-up. The report gives the speedup (flat step time / tree step time) beside the token ideal
(flat tokens / tree tokens) and, for SFT, the cost ideal (each mode's tokens and visible pairs priced
by seconds per token and per pair fitted to the measured rows), and each mode's peak GPU memory.
The smoke run is the same code on a tiny Llama on the CPU (flat and tree both on the torch engine).
"""

from __future__ import annotations

import time

from ds_tree.bench.steps import run_benchmark
from ds_tree.config import REPOSITORY, ObjectiveConfig
from ds_tree.gpu_check.attention import agent_trials, grpo_groups


def cases(smoke: bool) -> list[dict]:
    """Data x objective x tree engine."""
    if smoke:
        agent = agent_trials(0, 4, 0.7, 128)
        return [
            {"data": "agent", "trajectories": agent, "objective": "sft", "tree": "torch"},
            {"data": "grpo", "trajectories": grpo_groups(0, 2, 24, 4, (8, 24)), "objective": "grpo", "tree": "torch"},
        ]
    agent = agent_trials(0, 6, 0.7, 4096)
    grpo = grpo_groups(1, 6, 1024, 16, (384, 1152))
    found = []
    for tree in ("flex", "triton"):
        found.append({"data": "agent, POR 0.7, paths to 4K", "trajectories": agent, "objective": "sft", "tree": tree})
        found.append(
            {"data": "GRPO, prompt 1024 + 16 x 384-1152", "trajectories": grpo, "objective": "sft", "tree": tree}
        )
        found.append(
            {"data": "GRPO, prompt 1024 + 16 x 384-1152", "trajectories": grpo, "objective": "grpo", "tree": tree}
        )
    return found


def summary(report: dict) -> dict:
    """What the docs' table needs of one run_benchmark report."""
    modes = report["modes"]
    found = {
        "flat_step_s": modes["flat"]["step_time_s"],
        "tree_step_s": modes["tree"]["step_time_s"],
        "speedup": report["speedup"],
        "ideal_tokens": report["ideal_speedup"],
        "efficiency_tokens": report["efficiency"],
        "flat_gpu_peak_gib": _gib(modes["flat"].get("gpu_peak_memory_bytes")),
        "tree_gpu_peak_gib": _gib(modes["tree"].get("gpu_peak_memory_bytes")),
        "flat_engine": modes["flat"]["attention"],
        "tree_engine": modes["tree"]["attention"],
        "flat_tokens_per_step": report["flat_tokens_per_step"],
        "tree_tokens_per_step": report["tree_tokens_per_step"],
    }
    if "ideal_cost" in report:
        found |= {"ideal_cost": report["ideal_cost"], "efficiency_cost": report["efficiency_cost"]}
    return found


def _gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


def end_to_end(device: str, smoke: bool, progress=print) -> dict:
    """Every case of :func:`cases`; a case that fails is reported with its error and the rest go on."""
    model = REPOSITORY / "configs" / "models" / ("tiny_llama.json" if smoke else "bench_llama_1b.json")
    started = time.perf_counter()
    results = []
    for case in cases(smoke):
        name = f"{case['data']}, {case['objective']}, tree on {case['tree']}"
        progress(f"end to end: {name}")
        objective = None if case["objective"] == "sft" else ObjectiveConfig(kind=case["objective"])
        try:
            report = run_benchmark(
                case["trajectories"],
                str(model),
                ["flat", "tree"],
                1 if smoke else 3,
                budget=2048 if smoke else 16384,
                groups_per_step=2,
                warmup=0 if smoke else 1,
                dtype="float32" if smoke else "bfloat16",
                attention=case["tree"],
                flat_attention="torch" if smoke else "varlen",
                objective=objective,
                device=device,
                one_mode_at_a_time=True,
            )
        except Exception as error:  # noqa: BLE001 - reported with the case, the others still run
            results.append({"case": name, "ran": False, "error": f"{type(error).__name__}: {str(error)[:500]}"})
            continue
        results.append({"case": name, "ran": True, **summary(report)})
    return {"seconds": time.perf_counter() - started, "model": str(model.relative_to(REPOSITORY)), "cases": results}
