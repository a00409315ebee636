"""tools/verify.py on converted slices of the real shared data sets (skipped when absent).

Real agent trajectories have sharing that synthetic data lacks (23 k-character policies as
system prompts, near-duplicate trials at temperature 0, 100 sampled answers to one prompt).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_tree.data.jsonl import slice_groups
from tests.helpers.shared_data import SHARED_DATA, absent

ROOT = Path(__file__).resolve().parents[1]
SHARED = SHARED_DATA
CASES = {
    # one tau2 task (4 trials of ~13k tokens each), float32; one game24 puzzle's first 24 samples, float64
    "tau2-telecom": ("tau2-telecom/trials.jsonl", 4, "float32", 16384),
    "tot-game24": ("tot-game24/samples.jsonl", 24, "float64", 4096),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.slow) if name == "tau2-telecom" else name for name in sorted(CASES)],
)  # tau2: four ~13k-token trials verified in float32, ~30 s alone: the full tier's
def test_verify_passes_on_converted_shared_data(name: str, tmp_path: Path, tokenizer_dir) -> None:
    source, limit, dtype, budget = CASES[name]
    if not (SHARED / source).is_file():
        pytest.skip(absent(SHARED / source))
    dataset = tmp_path / "dataset"
    sliced = slice_groups(SHARED / source, tmp_path / "slice.jsonl", groups=1, per_group=limit)
    convert = [
        sys.executable,
        str(ROOT / "tools/convert.py"),
        "--input",
        str(sliced),
        "--output",
        str(dataset),
        "--tokenizer",
        str(tokenizer_dir),
        "--format",
        "chat",
    ]
    subprocess.run(convert, check=True, capture_output=True, text=True, timeout=300)
    verify = [
        sys.executable,
        str(ROOT / "tools/verify.py"),
        "--data",
        str(dataset),
        "--model",
        str(ROOT / "configs/models/tiny_qwen3.json"),
        "--dtype",
        dtype,
        "--budget",
        str(budget),
    ]
    result = subprocess.run(verify, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["n_trajectories"] == limit
    assert report["ideal_speedup"] > 2.5  # real sharing, not a degenerate slice
