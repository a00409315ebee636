"""The per-token arrays that trees, tree parts and packed rows carry, declared once.

A :class:`~ds_tree.trees.trie.TokenTree`, a tree part and a packed row are all packed trees in DFS
order (docs/DESIGN.md section 2) and hold the same arrays, one entry per token. Each array is a field of
:class:`TokenArrays` with its dtype and its *kind*; the kind says how the array follows its tokens
when a subset of a tree's tokens becomes a part (:func:`take_tokens`) and when parts are
concatenated into a padded row (:func:`concatenate_tokens`):

- ``VALUE``: the same on every copy of a token (ids, depths; per-token quantities shared by all the
  trajectories through a token, such as old or reference log-probabilities). Copied as is;
  padding takes the field's ``pad``.
- ``WEIGHT``: a sum over the trajectories through the token (restoration weights; sums of positive
  or negative advantages). Only the copy that owns the token keeps it, the other copies (context
  carried into another part) get 0, so every sum is counted once (docs/DESIGN.md section 3). Padding: 0.
- ``INDEX``: the index of another token of the same tree, ``-1`` for none (``pred_pos``). Remapped
  to the part's own indices (the token pointed at must be in the part) and shifted by the part's
  offset in a row. Padding: ``-1``.
- ``END``: an exclusive end index (``kv_end``). In a part: the end of the part's tokens below it;
  shifted by the part's offset in a row. Padding: ``k + 1``, so a padding token sees only itself.

Adding a per-token array is one field here plus the code that computes it for a tree.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np


class ArrayKind(enum.Enum):
    VALUE = "value"
    WEIGHT = "weight"
    INDEX = "index"
    END = "end"


@dataclass(frozen=True)
class TokenField:
    """What one per-token array is: its dtype, its kind, its padding, whether the model reads it."""

    dtype: type
    kind: ArrayKind
    pad: int | float = 0
    """Padding value of a ``VALUE`` field (``INDEX``, ``END`` and ``WEIGHT`` fields pad by their kind)."""
    model_input: bool = False
    """Passed to the model's forward (see ``PackedRow.tensors``)."""


def _token_field(dtype: type, kind: ArrayKind, pad: int | float = 0, model_input: bool = False):
    return field(metadata={"token_field": TokenField(dtype, kind, pad, model_input)})


@dataclass(kw_only=True)
class TokenArrays:
    """The per-token arrays of a packed tree, all of length ``n_tokens``, cast to their dtypes."""

    input_ids: np.ndarray = _token_field(np.int64, ArrayKind.VALUE, model_input=True)
    """Token ids (padding: the row's ``pad_id``)."""
    position_ids: np.ndarray = _token_field(np.int64, ArrayKind.VALUE, model_input=True)
    """Depth of the token: its position in every trajectory through it."""
    kv_end: np.ndarray = _token_field(np.int64, ArrayKind.END, model_input=True)
    """End of the subtree of the node holding the token: query ``q`` sees key ``k`` iff ``k <= q < kv_end[k]``."""
    pred_pos: np.ndarray = _token_field(np.int64, ArrayKind.INDEX)
    """The token whose logits predict this one; ``-1`` for a root's first token and padding."""
    owned: np.ndarray = _token_field(np.bool_, ArrayKind.WEIGHT)
    """Whether this copy of the token carries its weights: all of a tree; in parts, exactly one copy
    of each tree token; never padding. Per-token sums formed after packing (RL) go to owned copies."""
    mask_sum: np.ndarray = _token_field(np.float64, ArrayKind.WEIGHT)
    """Sum of the loss coefficients of the trajectories through the token (:mod:`ds_tree.trees.weights`)."""
    seq_mean_sum: np.ndarray = _token_field(np.float64, ArrayKind.WEIGHT)
    """Sum over those trajectories of loss coefficient / the trajectory's trained tokens."""
    mask_max: np.ndarray = _token_field(np.float64, ArrayKind.WEIGHT)
    """Largest loss coefficient of any trajectory through the token (the ``dedup`` policy)."""
    image_id: np.ndarray = _token_field(np.int64, ArrayKind.VALUE, pad=-1)
    """The image the token is a placeholder of, an index into its tree's ``images``; ``-1`` for text."""
    image_patch: np.ndarray = _token_field(np.int64, ArrayKind.VALUE, pad=-1)
    """The token's merged patch inside its image; ``-1`` for text."""
    rope_t: np.ndarray = _token_field(np.int64, ArrayKind.VALUE)
    """Multimodal rotary position, temporal section (text: the depth shifted by the images before it)."""
    rope_h: np.ndarray = _token_field(np.int64, ArrayKind.VALUE)
    """Multimodal rotary position, height section."""
    rope_w: np.ndarray = _token_field(np.int64, ArrayKind.VALUE)
    """Multimodal rotary position, width section."""

    def __post_init__(self) -> None:
        length = None
        for name, spec in TOKEN_FIELDS.items():
            values = np.asarray(getattr(self, name), dtype=spec.dtype)
            length = values.size if length is None else length
            if values.shape != (length,):
                raise ValueError(f"per-token array {name!r} has shape {values.shape}, expected ({length},)")
            setattr(self, name, values)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.size)


TOKEN_FIELDS: dict[str, TokenField] = {item.name: item.metadata["token_field"] for item in fields(TokenArrays)}
"""Every per-token array by name, in declaration order."""


def take_tokens(arrays: TokenArrays, token_index: np.ndarray, owned: np.ndarray) -> dict[str, np.ndarray]:
    """The per-token arrays of the tokens ``token_index`` of ``arrays``, as a packed tree of their own.

    ``token_index`` must be increasing and hold the ancestors of each of its tokens; in DFS order
    such a subset is itself a packed tree. ``owned[j]`` says whether the copy ``j`` carries the
    weights of its token.
    """
    token_index = np.asarray(token_index, dtype=np.int64)
    if np.any(np.diff(token_index) <= 0):
        raise ValueError("token_index must be strictly increasing (tokens in DFS order, each once)")
    to_subset = np.full(arrays.n_tokens, -1, dtype=np.int64)
    to_subset[token_index] = np.arange(token_index.size)
    taken = {}
    for name, spec in TOKEN_FIELDS.items():
        values = getattr(arrays, name)[token_index]
        if spec.kind is ArrayKind.WEIGHT:
            values = np.where(owned, values, 0)
        elif spec.kind is ArrayKind.INDEX:
            remapped = np.where(values >= 0, to_subset[np.maximum(values, 0)], -1)
            if np.any((values >= 0) & (remapped < 0)):
                raise AssertionError(f"{name}: a token points at a token the subset lacks (an ancestor)")
            values = remapped
        elif spec.kind is ArrayKind.END:
            # The tokens below a token are the contiguous run up to its end, so its end in the
            # subset is the number of subset tokens before its end in the tree.
            values = np.searchsorted(token_index, values)
        taken[name] = values
    return taken


def concatenate_tokens(
    pieces: Sequence[TokenArrays], n_pad: int, pad_values: Mapping[str, int | float] | None = None
) -> dict[str, np.ndarray]:
    """The per-token arrays of ``pieces`` side by side, followed by ``n_pad`` padding tokens.

    ``pad_values`` overrides the padding of ``VALUE`` fields by name (the row's ``pad_id``).
    """
    pad_values = pad_values or {}
    if any(name not in TOKEN_FIELDS or TOKEN_FIELDS[name].kind is not ArrayKind.VALUE for name in pad_values):
        raise ValueError(f"pad_values may only name VALUE fields, got {sorted(pad_values)}")
    offsets = np.cumsum([0] + [piece.n_tokens for piece in pieces])
    n_real = int(offsets[-1])
    joined = {}
    for name, spec in TOKEN_FIELDS.items():
        chunks = []
        for piece, offset in zip(pieces, offsets[:-1], strict=True):
            values = getattr(piece, name)
            if spec.kind is ArrayKind.INDEX:
                values = np.where(values >= 0, values + offset, values)
            elif spec.kind is ArrayKind.END:
                values = values + offset
            chunks.append(values)
        if spec.kind is ArrayKind.END:
            padding = np.arange(n_real + 1, n_real + n_pad + 1)
        elif spec.kind is ArrayKind.INDEX:
            padding = np.full(n_pad, -1)
        elif spec.kind is ArrayKind.WEIGHT:
            padding = np.zeros(n_pad)
        else:
            padding = np.full(n_pad, pad_values.get(name, spec.pad))
        joined[name] = np.concatenate(chunks + [padding.astype(spec.dtype)])
    return joined
