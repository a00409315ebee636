"""Export of DeepSpeed-trained weights as a standard Hugging Face model directory."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from ds_tree.atomic import remove, replace_directory

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
"""Chat templates' end-of-turn tokens (the project tokenizer's, Llama 3's, Gemma's, Phi-3's): generation
stops at the one the exported tokenizer's template uses, as well as at eos."""
LOAD_OPTIONS = ("local_files_only", "is_local")
"""How the tokenizer was loaded here, which transformers would save as if they were its settings."""


def export_hf(engine, directory: Path, rank: int, tokenizer: str = "", merge: bool = False) -> None:
    """Gather the full weights (ZeRO-3: consolidated on rank 0) and save them as safetensors
    (:func:`save_hf` on rank 0).

    A LoRA model (:mod:`ds_tree.models.lora`) is saved as a PEFT adapter directory in
    ``directory.parent / "adapter"`` instead, and with ``merge`` also as the merged model in
    ``directory``: the plain Hugging Face model with every adapter update added to its weight.
    """
    from ds_tree.models.lora import merged_state_dict, peft_model_of, save_adapter

    stage = engine.zero_optimization_stage()
    state_dict = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module.state_dict()
    peft = peft_model_of(engine)
    if rank == 0 and peft is not None:
        adapter = directory.parent / "adapter"
        temporary = adapter.with_name(adapter.name + ".partial")
        remove(temporary)  # a link planted under that name too: never written through
        save_adapter(peft, state_dict, temporary)
        _apply_umask(temporary)
        replace_directory(temporary, adapter)
        if merge:
            save_hf(peft.get_base_model(), merged_state_dict(peft, state_dict), directory, tokenizer)
    elif rank == 0:
        save_hf(engine.module, state_dict, directory, tokenizer)
    dist.barrier()


def save_hf(model, state_dict, directory: Path, tokenizer: str = "") -> None:
    """``model`` with ``state_dict`` (and the tokenizer from ``tokenizer``, if given) as a directory
    that plain transformers loads and generates with.

    Written to a temporary sibling that then replaces the previous export (renamed aside first,
    deleted last), so a crash at any point leaves a whole model: the previous one or the new one.
    The config names the standard ``sdpa`` attention (the tree engines need ds_tree, the plain
    model does not) and ``use_cache: true`` (training turns the cache off); generation stops at the
    chat template's end-of-turn token as well as at eos; the tokenizer config carries no load-time
    options; files get the process umask's permissions like any other output.
    """
    temporary = directory.with_name(directory.name + ".partial")
    remove(temporary)  # a link planted under that name too: never written through
    previous = model.config._attn_implementation, model.config.use_cache
    model.config._attn_implementation, model.config.use_cache = "sdpa", True
    try:
        with _no_progress_bar_in_logs():
            model.save_pretrained(str(temporary), state_dict=state_dict, safe_serialization=True)
    finally:
        model.config._attn_implementation, model.config.use_cache = previous
    if tokenizer:
        from ds_tree.data.convert import load_tokenizer

        loaded = load_tokenizer(tokenizer)  # a directory or a hub id
        for option in LOAD_OPTIONS:
            loaded.init_kwargs.pop(option, None)
        loaded.save_pretrained(str(temporary))
        _stop_at_end_of_turn(temporary / "generation_config.json", loaded)
    _apply_umask(temporary)
    replace_directory(temporary, directory)


@contextmanager
def _no_progress_bar_in_logs():
    """transformers' "Writing model shards" bar only on a terminal (in a log its redraws garble lines)."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _stop_at_end_of_turn(path: Path, tokenizer) -> None:
    """Add the end-of-turn token of ``tokenizer``'s chat template to the generation config's eos ids."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    ids = [tokenizer.convert_tokens_to_ids(token) for token in END_OF_TURN if token in template]
    ids = [i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id]
    if not ids or not path.is_file():
        return
    config = json.loads(path.read_text())
    eos = config.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    config["eos_token_id"] = eos + [i for i in ids if i not in eos]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _apply_umask(folder: Path) -> None:
    """Permissions as ``open`` would give them under the process umask (some writers use 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
