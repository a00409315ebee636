"""The optional real data sets (docs/DATA.md): where the tests look for them and why they skip.

``../shared/data`` beside the repository holds tau2-telecom and tot-game24 in chat JSONL;
``python tools/get_shared_data.py`` rebuilds them there from their public sources. Tests that need
one skip without it, with a reason that names the data set and says how to get it.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import ROOT

SHARED_DATA = ROOT.parent / "shared" / "data"
FILES = {"tau2-telecom": "tau2-telecom/trials.jsonl", "tot-game24": "tot-game24/samples.jsonl"}


def absent(path: Path) -> str:
    """The skip reason for a missing data file: which optional data set, where, how to get it."""
    name = path.parent.name
    return f"optional real data {name} is absent ({path}): python tools/get_shared_data.py builds it, see docs/DATA.md"
