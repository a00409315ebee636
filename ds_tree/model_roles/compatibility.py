"""What a model run beside the policy (a distillation teacher, a critic of its own) must share with it, checked
before any model is built: its config readable (layer types known, hub weights present when offline), and,
where both have tokenizer files (``model.tokenizer``, or ``model.source``'s directory, and the other model's
directory or hub snapshot), the same tokenizer (vocabulary, merges, added tokens:
:func:`~ds_tree.vocab.tokenizer.tokenizer_identity`). A model given as a config JSON has no tokenizer: its
vocabulary size is all there is to compare, which each role checks for itself."""

from __future__ import annotations

from pathlib import Path

from ds_tree.data.convert import load_tokenizer
from ds_tree.errors import ConfigError, DataError, HubError
from ds_tree.hub import TOKENIZER_FILES, is_hub_id, local_path
from ds_tree.models.loading import check_hub_weights, load_config
from ds_tree.models.token_mixing import check_layer_types
from ds_tree.vocab.tokenizer import tokenizer_identity


def role_config(source: str, field: str):
    """The transformers config of ``source`` (a config JSON, a directory or a hub id) for the model named by config
    field ``field``, its layer types and (offline) hub weights checked: a :class:`ConfigError` naming ``field``."""
    try:
        loaded = load_config(source)
        check_layer_types(loaded)
        check_hub_weights(source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: {error}") from None
    return loaded


def tokenizer_dir(source: str) -> Path | None:
    """The directory holding ``source``'s tokenizer files (``tokenizer.json``), if any."""
    if not source:
        return None
    try:
        path = local_path(source, TOKENIZER_FILES) if is_hub_id(source) else Path(source)
    except HubError:
        return None
    return path if path.is_dir() and (path / "tokenizer.json").is_file() else None


def check_same_tokenizer(config, source: str, field: str, policy_name: str, why: str) -> None:
    """``source``'s tokenizer is the policy's, where both have one (module docstring): the error calls the policy
    ``policy_name`` (``student``, ``policy``) and ends with ``why``."""
    other_dir = tokenizer_dir(source)
    policy_dir = tokenizer_dir(config.model.tokenizer) or tokenizer_dir(config.model.source)
    if other_dir is None or policy_dir is None:
        return
    try:
        other, policy = (tokenizer_identity(load_tokenizer(path)) for path in (other_dir, policy_dir))
    except DataError as error:
        raise ConfigError(f"{field}: {error}") from None
    if other["serialised_sha256"] != policy["serialised_sha256"]:
        raise ConfigError(
            f"{field}: the tokenizer of {source} ({other['vocab_size']} tokens, sha256 "
            f"{other['serialised_sha256'][:12]}) is not the {policy_name}'s ({policy_dir}: "
            f"{policy['vocab_size']} tokens, sha256 {policy['serialised_sha256'][:12]}); {why}"
        )
