"""Hub ids (``org/name``) for the model, the reference and the tokenizer, resolved through a
huggingface_hub cache folder made here (offline: nothing is downloaded), and the one error that a
model missing from the cache gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_tree.config import ConfigError
from ds_tree.data.convert import load_tokenizer
from ds_tree.errors import HubError
from ds_tree.hub import is_hub_id
from ds_tree.models.loading import load_model
from ds_tree.run.export import save_hf
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.runs import prepare

REPO_ID = "some-org/some-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch, tokenizer_dir) -> dict[str, torch.Tensor]:
    """A hub-style cache (``models--org--name/snapshots/<commit>`` and ``refs/main``) holding a tiny
    Llama and the project tokenizer as the project exports them; offline. Returns the weights."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    storage = cache / "models--some-org--some-model"
    model = load_model(ROOT / "configs/models/tiny_llama.json", attention="torch", seed=5)
    save_hf(model, model.state_dict(), storage / "snapshots" / COMMIT, str(tokenizer_dir))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return model.state_dict()


def test_hub_ids_are_names_that_are_no_local_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name_2.5")
    for path in ("configs/models/tiny.json", "tiny.json", "org/model.json", "org/conf.yaml", "/abs/x", "a/b/c", "x"):
        assert not is_hub_id(path), path
    (tmp_path / "org" / "name").mkdir(parents=True)  # a local path of that name always wins
    assert not is_hub_id("org/name")


def test_config_with_a_hub_id_loads_from_the_cache_offline(tmp_path: Path, hub_cache) -> None:
    config = write_config(
        tmp_path,
        write_forest(tmp_path / "forest.jsonl"),
        model={"source": REPO_ID, "tokenizer": REPO_ID},
        checkpoint={"export_hf": True},
    )
    trainer = prepare(config)
    assert trainer.config.model.source == REPO_ID  # recorded as given: the id, not a cache path
    assert (trainer.model_config.model_type, trainer.model_config.hidden_size) == ("llama", 64)

    model = load_model(REPO_ID, attention="torch")
    for name, tensor in model.state_dict().items():  # the cached weights, not a random init
        assert torch.equal(tensor, hub_cache[name]), name
    assert load_tokenizer(REPO_ID).convert_tokens_to_ids("<|im_end|>") is not None


def test_a_model_missing_from_the_cache_is_one_error_naming_the_id(tmp_path: Path, hub_cache) -> None:
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), model={"source": "other-org/missing"})
    with pytest.raises(ConfigError) as caught:
        prepare(config)
    message = str(caught.value)
    assert message.startswith("model.source: other-org/missing: no such local path, and not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1 forbids downloading" in message and "`hf download other-org/missing`" in message
    assert str(tmp_path / "hub") in message
    with pytest.raises(ConfigError, match=r"model.tokenizer: other-org/missing: .*`hf download other-org/missing`"):
        prepare(config, f"model.source={REPO_ID}", "model.tokenizer=other-org/missing", "checkpoint.export_hf=true")
    with pytest.raises(ConfigError, match=r"objective.reference: other-org/missing: .*`hf download other-org/missing`"):
        rl = ("objective.kind=grpo", "objective.kl_coef=0.1", "objective.reference=other-org/missing")
        prepare(config, f"model.source={REPO_ID}", *rl)


def test_a_cached_snapshot_without_safetensors_is_refused(hub_cache) -> None:
    from huggingface_hub import constants

    snapshot = Path(constants.HF_HUB_CACHE) / "models--some-org--some-model" / "snapshots" / COMMIT
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(HubError, match=rf"{REPO_ID}: its cached snapshot .* holds no \*.safetensors weights"):
        load_model(REPO_ID)


def test_sample_takes_hub_ids_and_names_a_missing_one(tmp_path: Path, hub_cache, capsys) -> None:
    from ds_tree.cli import sample

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"group_id": "p", "prompt": "hi"}\n')
    args = ["--tokenizer", REPO_ID, "--prompts", str(prompts), "--output", str(tmp_path / "out.jsonl")]
    assert sample.main(["--model", "other-org/missing", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("ds-tree sample: error: other-org/missing: no such local path"), err
    assert sample.main(["--model", REPO_ID, "--width", "2", "--max-new-tokens", "2", *args]) == 0
    assert (tmp_path / "out.jsonl").read_text()


def test_dry_run_refuses_a_cached_snapshot_without_safetensors(tmp_path: Path, hub_cache) -> None:
    """Issue 55 #12: offline, a cached snapshot without weights passed the dry run; the run then failed at start."""
    from huggingface_hub import constants

    snapshot = Path(constants.HF_HUB_CACHE) / "models--some-org--some-model" / "snapshots" / COMMIT
    (snapshot / "model.safetensors").unlink()
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), model={"source": REPO_ID})
    message = (
        rf"model.source: {REPO_ID}: its cached snapshot .* holds no \*.safetensors weights .*`hf download {REPO_ID}`"
    )
    with pytest.raises(ConfigError, match=message):
        prepare(config)
    with pytest.raises(ConfigError, match=rf"objective.reference: {REPO_ID}: its cached snapshot .* holds no"):
        rl = ("objective.kind=grpo", "objective.kl_coef=0.1", f"objective.reference={REPO_ID}")
        prepare(config, f"model.source={ROOT / 'configs/models/tiny_llama.json'}", *rl)
