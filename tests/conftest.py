"""Shared fixtures. The project tokenizer is built once per test session (it is deterministic)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from ds_tree.data.tokenizer import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
