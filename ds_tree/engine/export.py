"""Export of DeepSpeed-trained weights as a standard Hugging Face model directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from ds_tree.atomic import replace_directory


def export_hf(engine, directory: Path, rank: int, tokenizer: str = "") -> None:
    """Gather the full weights (ZeRO-3: consolidated on rank 0) and save them as safetensors.

    Written to a temporary sibling that then replaces the previous export (renamed aside first,
    deleted last), so a crash at any point leaves a whole model: the previous one or the new one.
    The config names the standard ``sdpa`` attention: the tree engines need ds_tree, the plain
    model does not.
    """
    stage = engine.zero_optimization_stage()
    state_dict = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module.state_dict()
    if rank == 0:
        model = engine.module
        temporary = directory.with_name(directory.name + ".partial")
        shutil.rmtree(temporary, ignore_errors=True)
        previous = model.config._attn_implementation
        model.config._attn_implementation = "sdpa"
        try:
            model.save_pretrained(str(temporary), state_dict=state_dict, safe_serialization=True)
        finally:
            model.config._attn_implementation = previous
        if tokenizer:
            from transformers import AutoTokenizer

            loaded = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True, trust_remote_code=False)
            loaded.save_pretrained(str(temporary))
        replace_directory(temporary, directory)
    dist.barrier()
