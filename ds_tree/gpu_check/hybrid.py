"""``gpu-check``'s hybrid section: the GDN and Mamba2 scans on fla's Triton kernels against the torch scans.

- correctness: the tiny Qwen3.5 and Bamba configs (``configs/models``) in float32 on two groups of agent
  trials, one SFT tree step with ``model.recurrent_kernels: fla`` and with ``torch``: loss, log-probs and
  every gradient of fla's tree against torch's tree, and against fla's own flat paths. Triton's float32
  dots default to TF32 on NVIDIA GPUs (fla's kernels inherit it); the check compiles them with
  ``TRITON_F32_DEFAULT=ieee`` so that it measures the tree algorithm, not TF32's 10-bit mantissa;
- timing: a Qwen3.5-shaped model (:data:`TIMED_MODEL`: 3 GDN layers and 1 attention layer, 16 value heads
  of 128) in bf16 on one agent group of ~16K tree tokens, forward + backward of the tree row with each
  engine, Triton's default precision (what training runs), the median of 3 steps after a warm-up.

CUDA only: on the CPU (``--smoke``) the section is skipped (``tests/test_fla_scan.py`` runs the kernels
under the Triton interpreter), and without ``fla-core`` it is skipped with the install command.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ds_tree.comparison import gradient_errors
from ds_tree.config import REPOSITORY
from ds_tree.gpu_check.attention import agent_trials
from ds_tree.models.loading import load_model
from ds_tree.scans.fla_scan import FLA_INSTALL, fla_available
from ds_tree.verify.tree_vs_flat import run_mode

TOLERANCE = 1e-5
"""Relative, float32 with IEEE products: the interpreter tests' bound (measured there: <= 4e-6)."""

TIMED_MODEL = {
    "model_type": "qwen3_5_text",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
}


@contextmanager
def _ieee_float32_dots():
    saved = os.environ.get("TRITON_F32_DEFAULT")
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_F32_DEFAULT")
        else:
            os.environ["TRITON_F32_DEFAULT"] = saved


def _step(source: str, kernels: str, dtype, trajectories, mode: str, budget: int):
    model = load_model(source, attention="auto", dtype=dtype, seed=3, device="cuda", recurrent_kernels=kernels)
    model = model.to("cuda")
    return model, run_mode(model, trajectories, mode, budget, 1, "token_mean", "exact")


def _errors(reference, other) -> dict:
    logprobs = max(float(abs(other.logprobs[key] - reference.logprobs[key]).max()) for key in reference.logprobs)
    return {
        "loss_rel": abs(other.loss - reference.loss) / abs(reference.loss),
        "grad_rel_max": max(gradient_errors(reference.gradients, other.gradients).values()),
        "logprob_abs_max": logprobs,
    }


def correctness(progress) -> list[dict]:
    """fla's tree step against torch's tree step and fla's flat step, per tiny hybrid config."""
    trajectories = agent_trials(0, 2, 0.7, 256)
    found = []
    with _ieee_float32_dots():
        for name in ("tiny_qwen3_5", "tiny_bamba"):
            source = str(REPOSITORY / "configs/models" / f"{name}.json")
            progress(f"hybrid correctness: {name}")
            _, torch_tree = _step(source, "torch", torch.float32, trajectories, "tree", 8192)
            _, fla_tree = _step(source, "fla", torch.float32, trajectories, "tree", 8192)
            _, fla_flat = _step(source, "fla", torch.float32, trajectories, "flat", 8192)
            for against, result in (("torch tree", torch_tree), ("fla flat", fla_flat)):
                errors = _errors(result, fla_tree)
                passed = errors["loss_rel"] <= TOLERANCE and errors["grad_rel_max"] <= TOLERANCE
                found.append({"model": name, "fla tree against": against, **errors, "passed": passed})
    return found


def timing(progress, steps: int = 3) -> list[dict]:
    """Seconds of one bf16 tree step (forward + backward) of :data:`TIMED_MODEL` with each scan engine."""
    trajectories = agent_trials(0, 1, 0.7, 10240)
    found = []
    with tempfile.TemporaryDirectory() as directory:
        source = Path(directory) / "qwen3_5_timed.json"
        source.write_text(json.dumps(TIMED_MODEL))
        for kernels in ("torch", "fla"):
            progress(f"hybrid timing: {kernels}")
            model, first = _step(str(source), kernels, torch.bfloat16, trajectories, "tree", 32768)
            seconds = []
            for _ in range(steps):
                torch.cuda.synchronize()
                started = time.perf_counter()
                run_mode(model, trajectories, "tree", 32768, 1, "token_mean", "exact")
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - started)
            found.append({"kernels": kernels, "step_s": statistics.median(seconds), "tree_tokens": first.packed_tokens})
            del model
            torch.cuda.empty_cache()
    return found


def hybrid_check(device: str, smoke: bool, progress) -> dict:
    if device != "cuda":
        return {"passed": True, "skipped": "CUDA only; tests/test_fla_scan.py runs fla under the interpreter"}
    if not fla_available():
        return {"passed": True, "skipped": f"fla-core not installed: {FLA_INSTALL}"}
    results = correctness(progress)
    report = {"passed": all(r["passed"] for r in results), "correctness": results, "tolerance": TOLERANCE}
    report["timing"] = timing(progress)
    return report
