"""Hugging Face hub ids (``org/name``) where a model, a reference or a tokenizer is named.

A name that exists as a local path is always that path: a hub id is only tried for a name that
does not exist and has the shape of one (one ``/`` between two names of letters, digits, ``-``,
``_`` and ``.``; not ending in ``.json`` or ``.yaml``, which name config files). It resolves through
huggingface_hub's cache (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``) to a snapshot
directory, which the callers then load as any local directory. With network the missing files are
downloaded into the cache (every rank of a run asks; huggingface_hub's file locks make one of them
download). Offline (``HF_HUB_OFFLINE=1``, or the hub cannot be reached) a snapshot that is not
cached is one :class:`~ds_tree.errors.HubError` naming the id and the command that downloads it.
"""

from __future__ import annotations

import re
from pathlib import Path

from ds_tree.errors import HubError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""The shape of a hub model id, ``org/name``."""
NOT_HUB_SUFFIXES = (".json", ".yaml", ".yml")
"""Names ending so are config files, never hub ids (a missing one stays a missing file)."""

CONFIG_FILES = ("config.json",)
"""What a model's config needs (the dry run, ``ds-tree plan``): no weights are downloaded for it."""
MODEL_FILES = ("*.json", "*.safetensors")
"""A model's config, generation config, weights and their index. ``.bin`` checkpoints are not
fetched: they are pickles that run code when loaded; a repository without safetensors is refused."""
TOKENIZER_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")
"""Tokenizer files: tokenizer.json and its config, vocabularies and merges, sentencepiece models,
chat templates."""


def is_hub_id(name: str | Path) -> bool:
    """Whether ``name`` would be looked up on the hub: no such local path, and the shape of an id."""
    text = str(name)
    if Path(text).exists() or text.endswith(NOT_HUB_SUFFIXES):
        return False
    return HUB_ID.fullmatch(text) is not None


def local_path(name: str | Path, files: tuple[str, ...]) -> Path:
    """``name`` as a local path: itself unless it is a hub id (:func:`is_hub_id`), else the cached
    snapshot holding ``files`` (glob patterns), downloaded first where the hub can be reached."""
    if not is_hub_id(name):
        return Path(name)
    return snapshot(str(name), files)


def snapshot(repo_id: str, files: tuple[str, ...]) -> Path:
    """The cache's snapshot directory of model ``repo_id`` (its main revision) with ``files``."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(files)))
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise HubError(
            f"{repo_id}: no such local path, and the hub has no model {repo_id} that this machine may read "
            f"({type(error).__name__}); check the id, or log in (`hf auth login`) for a gated or private model"
        ) from None
    except LocalEntryNotFoundError as error:  # offline, or the hub unreachable, and not cached (or incomplete)
        why = "HF_HUB_OFFLINE=1 forbids downloading" if constants.is_offline_mode() else "the hub cannot be reached"
        raise HubError(
            f"{repo_id}: no such local path, and not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and "
            f"{why}; download it where there is network with `hf download {repo_id}` (HF_HUB_CACHE names the "
            f"cache to fill), or give a local directory ({type(error).__name__})"
        ) from None
    except HfHubHTTPError as error:
        raise HubError(f"{repo_id}: the hub answered with an error ({error})") from None
