"""What a run leaves and says: the exported model directory, a re-run of a finished run, the
announcement of DeepSpeed's one-time op builds, and a progress bar only where it cannot garble a log."""

from __future__ import annotations

import io
import json
import logging
import os
import stat

import pytest

from ds_tree.config import config_to_dict, load_config
from ds_tree.models.loading import load_model
from ds_tree.run import checkpoint
from ds_tree.run.console import progress_bar
from ds_tree.run.export import save_hf
from ds_tree.run.op_builds import announce_op_builds, pending_op_builds
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest


def test_export_is_a_plain_model_that_stops_at_the_end_of_a_turn(tmp_path, tokenizer_dir, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_model(ROOT / "configs/models/tiny_llama.json", attention="torch", dtype="float32", seed=0)
    assert model.config.use_cache is False  # as training runs
    umask = os.umask(0o027)
    try:
        save_hf(model, model.state_dict(), tmp_path / "hf", str(tokenizer_dir))
    finally:
        os.umask(umask)
    assert "Writing model shards" not in capfd.readouterr().err  # no progress bar outside a terminal
    hf = tmp_path / "hf"
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in hf.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes  # the umask's, not 0600
    assert stat.S_IMODE(hf.stat().st_mode) == 0o750
    assert (model.config.use_cache, model.config._attn_implementation) == (False, "tree_torch")  # restored

    assert json.loads((hf / "config.json").read_text())["use_cache"] is True
    tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local"} & set(tokenizer_config), sorted(tokenizer_config)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    exported = AutoModelForCausalLM.from_pretrained(hf)
    stops = exported.generation_config.eos_token_id
    assert tokenizer.convert_ids_to_tokens(stops) == ["<|eos|>", "<|im_end|>"]
    assert exported.config.use_cache is True


def test_rerun_of_a_finished_run_says_so_and_trains_nothing(tmp_path, monkeypatch, capsys):
    from ds_tree import train

    config_path = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), max_steps=3)
    config = load_config(config_path)
    tag = tmp_path / "run" / "checkpoints" / checkpoint.tag_for(3)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    files = checkpoint.describe_files(tag, checkpoint.listing(tag))  # a complete checkpoint lists its files
    record = {"step": 3, "world_size": 1, "config": config_to_dict(config), "files": files}
    (tag / checkpoint.RECORD).write_text(json.dumps(record))
    (tag.parent / checkpoint.LATEST).write_text(tag.name)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train.Trainer, "setup", lambda self: pytest.fail("a finished run started training"))

    assert train.main(["--config", str(config_path)]) == 0
    err = capsys.readouterr().err
    assert "already reached max_steps=3 (checkpoint step_0000003): nothing to train" in err, err
    assert "raise max_steps (e.g. max_steps=6)" in err and "another output_dir" in err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step_0000003"]


def test_first_cpu_run_announces_the_op_builds(tmp_path, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("the shared-memory comm op is built on CPU runs")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert [name for name, _ in pending_op_builds({})] == ["deepspeed_shm_comm"]
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert [name for name, _ in pending_op_builds(offload)] == ["deepspeed_shm_comm", "cpu_adam"]

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ds_tree.run.op_builds")
    logger.addHandler(handler)
    try:
        announce_op_builds({})
        (tmp_path / "deepspeed_shm_comm").mkdir()
        (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"built")  # cached: silent
        announce_op_builds({})
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        f"building DeepSpeed's deepspeed_shm_comm op once (about 30-60 s, cached in {tmp_path / 'deepspeed_shm_comm'} "
        "for later runs)"
    ]
    assert pending_op_builds({}) == []


def test_progress_bar_only_on_a_terminal():
    assert progress_bar(10, 0, io.StringIO()) is None  # a log file or pipe: the step lines alone
    main, secondary = os.openpty()
    try:
        with os.fdopen(secondary, "w") as terminal:
            bar = progress_bar(10, 3, terminal)
            assert bar is not None and bar.n == 3 and bar.total == 10
            bar.close()
    finally:
        os.close(main)


def test_every_rank_sees_a_finished_run(tmp_path, monkeypatch):
    """Only rank 0 plans the resume (it holds the lock): another rank reads the same checkpoint, or it
    would go on to wait in the process group for a rank 0 that has already exited."""
    from types import SimpleNamespace

    from ds_tree import train

    config = load_config(write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), max_steps=3))
    config.checkpoint.export_hf = False
    tag = tmp_path / "run" / "checkpoints" / checkpoint.tag_for(3)
    tag.mkdir(parents=True)
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"weights")
    files = checkpoint.describe_files(tag, checkpoint.listing(tag))
    (tag / checkpoint.RECORD).write_text(json.dumps({"step": 3, "world_size": 2, "config": {}, "files": files}))
    (tag.parent / checkpoint.LATEST).write_text(tag.name)
    rank1 = SimpleNamespace(config=config, resume_from=None, output_dir=tmp_path / "run", checkpoint_dir=tag.parent)
    monkeypatch.setenv("RANK", "1")
    assert train.already_finished(rank1)
    monkeypatch.setenv("RANK", "0")  # rank 0 planned no resume: a fresh run
    assert not train.already_finished(rank1)
