"""Prove the GPU path on one CUDA GPU: engines exact, kernels timed, steps timed, the trainer run.

Sections (--sections, run in the order given, by default this one; each writes the report again when
it ends, so a run cut short keeps what it measured):

  correctness  every tree engine (torch, triton on both tile schedules, flex) and the flat varlen
               engine against the float64 reference, forward and backward, float32 and bf16 (GQA
               1/2/4, windows, soft caps, rows longer than one tile)
  kernels      the kernel table: useful TFLOP/s of each tree engine on tree rows (Triton on both tile
               schedules, default and autotuned configurations), of the Triton and flash varlen
               kernels and padded SDPA on the flat paths, and dense causal SDPA (the chip's ceiling);
               FlexAttention's compile time per length bucket; the autotune's timings and winners
  steps        SFT and GRPO steps of a 1B Llama in bf16, tree (flex, triton) against the flash flat
               baseline, each mode alone on the GPU: speedup, token and cost ideals, peak GPU memory
  trainer      launch/train.sh on one GPU (DeepSpeed ZeRO-3, NCCL, bf16, engine auto): SFT steps with
               the self-check, a SIGTERM and the resume (losses against an uninterrupted run), GRPO
               steps, the exported model loaded by plain transformers
  hybrid       the hybrids' GDN / Mamba2 scans on fla's Triton kernels (model.recurrent_kernels: fla)
               against the torch scans in float32 (tree, and fla's tree against its flat paths), and a
               bf16 step of a Qwen3.5-shaped model on a ~16K-token tree with each; skipped without fla-core

Writes OUTPUT/gpu_check.json and OUTPUT/gpu_check.md (and OUTPUT/trainer/); OUTPUT must be a new or empty
folder or an earlier report, never a folder holding anything else. Exit 0 when every engine that ran is exact and
the trainer section passed, 1 otherwise, 2 on a usage error (no CUDA GPU without --smoke). --smoke
runs the same code at toy sizes on the CPU (the Triton interpreter, flex forward only, a 2-rank gloo
trainer run): the test suite runs it so that the GPU path cannot rot unseen. docs/KERNEL.md says how
to run it on a GPU machine without network.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from ds_tree.cli.common import command_parser, output_folder_problem

SECTIONS = ("correctness", "kernels", "steps", "trainer", "hybrid")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--output", type=Path, default=Path("runs/gpu_check"), help="report folder (default %(default)s)"
    )
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (the test suite's run)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)",
    )
    return parser


REPORT_ITEMS = {"gpu_check.json", "gpu_check.md", "trainer"}
"""What gpu-check writes in its --output folder (trainer/: the trainer section's inputs, runs and logs)."""


def is_report_folder(folder: Path) -> bool:
    """Whether ``folder`` is an earlier gpu-check report (its sections are written again): nothing else in it."""
    names = {item.name for item in folder.iterdir()}
    return "gpu_check.json" in names and names <= REPORT_ITEMS


def sections_of(parser: argparse.ArgumentParser, text: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown or not chosen:
        parser.error(f"--sections: {', '.join(unknown) or 'none given'}; choose from {', '.join(SECTIONS)}")
    return list(dict.fromkeys(chosen))  # in the order given: the most wanted first, where time is short


def environment(device: str) -> dict:
    import torch
    import transformers

    found = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
    }
    for name in ("triton", "deepspeed", "flash_attn", "fla"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def run_section(name: str, device: str, smoke: bool, output: Path, progress) -> dict:
    if name == "correctness":
        from ds_tree.gpu_check.attention import correctness

        return correctness(device, smoke, progress)
    if name == "kernels":
        from ds_tree.gpu_check.attention import kernel_table

        return kernel_table(device, smoke, progress)
    if name == "steps":
        from ds_tree.gpu_check.steps import end_to_end

        return end_to_end(device, smoke, progress)
    if name == "hybrid":
        from ds_tree.gpu_check.hybrid import hybrid_check

        return hybrid_check(device, smoke, progress)
    from ds_tree.gpu_check.trainer import trainer_check

    return trainer_check(output / "trainer", smoke=smoke, progress=progress)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    sections = sections_of(parser, args.sections)
    problem = output_folder_problem(args.output, is_report_folder, "gpu-check")
    if problem:
        parser.error(f"--output {problem}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    elif shutil.which("nvidia-smi") is None:
        parser.error("gpu-check needs a CUDA GPU (none found: no nvidia-smi); --smoke runs it on the CPU")
    import torch

    from ds_tree.gpu_check.report import write_report

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("gpu-check needs a CUDA GPU and torch sees none; --smoke runs it on the CPU")
    args.output.mkdir(parents=True, exist_ok=True)

    def progress(message: str) -> None:
        print(f"gpu-check: {message}", file=sys.stderr, flush=True)

    report = {"smoke": args.smoke, "environment": environment(device), "sections": {}}
    started = time.perf_counter()
    for name in sections:
        progress(f"section {name}")
        section_started = time.perf_counter()
        try:
            report["sections"][name] = run_section(name, device, args.smoke, args.output, progress)
        except Exception as error:  # noqa: BLE001 - the report keeps the sections before and after
            report["sections"][name] = {"passed": False, "error": f"{type(error).__name__}: {error}"}
        report["sections"][name]["wall_s"] = time.perf_counter() - section_started
        report["wall_s"] = time.perf_counter() - started
        write_report(report, args.output)
    passed = write_report(report, args.output)
    progress(f"{'passed' if passed else 'FAILED'}: {args.output / 'gpu_check.md'}")
    return 0 if passed else 1
