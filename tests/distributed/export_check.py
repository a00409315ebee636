"""Run under ``torchrun``: train a few steps, export, and compare the export's logits with the engine's.

Writes ``{"max_abs_logit_err": ..., "logit_scale": ...}`` to ``--out`` (rank 0). The export is
loaded with plain transformers (its default attention, no ds_tree registration needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.train import exit_now
from tests.distributed.common import check_arguments, started_trainer


def main() -> None:
    args, config = check_arguments()
    trainer = started_trainer(config)
    trainer.train()
    sequence = trainer.trajectories[0].input_ids
    n = sequence.size
    inputs = {
        "input_ids": torch.as_tensor(sequence)[None],
        "position_ids": torch.arange(n)[None],
        "kv_end": torch.full((1, n), n),
    }
    trainer.engine.eval()
    with torch.no_grad():
        engine_logits = trainer.engine(**inputs, use_cache=False).logits[0].double()
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(trainer.output_dir / "hf", local_files_only=True)
        exported.eval()
        with torch.no_grad():
            exported_logits = exported(input_ids=inputs["input_ids"], use_cache=False).logits[0].double()
        report = {
            "max_abs_logit_err": float((exported_logits - engine_logits).abs().max()),
            "logit_scale": float(engine_logits.abs().max()),
            "attn_implementation": exported.config._attn_implementation,
        }
        Path(args.out).write_text(json.dumps(report))
    dist.barrier()
    trainer.close()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
