"""ZeRO-3 with optimizer and parameter offload to CPU memory (configs/ds/zero3_offload_*.json).

DeepSpeed 0.19.8 runs CPU offload on this CPU-only machine with ds_tree's torch AdamW as the client
optimizer (``"zero_force_ds_cpu_optimizer": false``; DeepSpeedCPUAdam is not needed), so the CPU
config gets a real 2-rank step against the single-process flat gradient. NVMe offload needs an NVMe
path and DeepSpeed's async I/O op (libaio): its config is validated (ds_tree's resolution and
DeepSpeed's own ZeRO config model), not run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_tree.config import ConfigError, load_config
from ds_tree.run.ds_config import resolve_deepspeed_config
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import torchrun

CPU = ROOT / "configs/ds/zero3_offload_cpu.json"
NVME = ROOT / "configs/ds/zero3_offload_nvme.json"
EXAMPLE = ROOT / "configs/examples/llama3_8b_zero3_offload.yaml"


def resolved(tmp_path: Path, deepspeed: Path, world_size: int = 2) -> dict:
    data = write_forest(tmp_path / "forest.jsonl", groups=1)
    config = load_config(write_config(tmp_path, data, deepspeed=str(deepspeed)))
    return resolve_deepspeed_config(config, world_size, hidden_size=64)


@pytest.mark.parametrize("path", [CPU, NVME], ids=["cpu", "nvme"])
def test_offload_configs_validate(tmp_path, path):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = resolved(tmp_path, path)
    zero = DeepSpeedZeroConfig(**ds["zero_optimization"])  # DeepSpeed's own checks of every ZeRO key
    device = "nvme" if path == NVME else "cpu"
    assert zero.stage == 3
    assert (zero.offload_optimizer.device, zero.offload_param.device) == (device, device)
    assert ds["zero_force_ds_cpu_optimizer"] is False


def test_offload_needs_torch_optimizer_allowed(tmp_path):
    ds = json.loads(CPU.read_text())
    del ds["zero_force_ds_cpu_optimizer"]
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match="zero_force_ds_cpu_optimizer"):
        resolved(tmp_path, path)


def test_offload_example_names_the_cpu_config():
    config = load_config(EXAMPLE)
    assert Path(config.deepspeed) == CPU.relative_to(ROOT)
    assert config.model.activation_checkpointing and config.model.head_chunk > 0


@pytest.mark.distributed
def test_two_ranks_zero3_cpu_offload_match_single_process_flat(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "forest.jsonl")
    ds = json.loads(CPU.read_text())
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2, train_batch_size=4)
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps(ds))
    config = write_config(tmp_path, data, deepspeed=str(ds_path), packing={"budget": 200})
    out = tmp_path / "report.json"
    torchrun("tests/distributed/grad_check.py", "--config", str(config), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["offloaded"] == ["optimizer", "param"]
    assert report["zero_stage"] == 3 and report["min_micro_batches_per_rank"] >= 2
    # the bounds of test_engine's 2-rank test: float32 round-off against the flat single process
    assert report["max_rel_grad_err"] < 1e-5, report
    assert report["max_rel_param_err"] < 1e-5, report
