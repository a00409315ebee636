"""Trees given explicitly as nodes with parent links, expanded into root-to-leaf trajectories.

Record shape (one tree a JSONL line)::

    {"group_id": str | int?, "tools": [...]?,
     "nodes": [{"id": str|int, "parent": id|null, "input_ids": [int], "loss_mask": [number]?,
                "logprobs": [number|null]?, "advantages": [number]?, "reward": number?}, ...]}

A node holds either ``input_ids`` (with an optional ``loss_mask``, default all 1: explicit token
nodes are usually generated text) or ``messages`` (OpenAI chat messages); one tree uses one kind.
A leaf's trajectory concatenates the nodes on its root path. Message trees are rendered per path
with the full message list (a chat template renders a conversation, not a fragment), and the
trie merges the shared prefixes again. ``reward`` belongs on leaves, one per trajectory. A
line without ``group_id`` is a group by itself (named by its ``file:line``).

A token node may carry the RL rollout fields of the tokens format (:mod:`ds_tree.data.tokens`),
aligned with its ``input_ids``: the sampler's ``logprobs`` (``null`` where not sampled) and
``advantages``. A path concatenates them like the tokens; a node without ``logprobs`` contributes
NaN (not sampled, typically the prompt), but ``advantages`` must be on every node of a path once
one node has them (there is no neutral value to fill in). Message nodes cannot carry them: their
tokens are known only after rendering.

Expanding to trajectories, instead of keeping the given node split, means the tree the trainer
sees is always the exact-token trie: two sibling nodes that start with the same tokens still share
them, which a node-level tree would recompute.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ds_tree.data.records import (
    PER_TOKEN_FIELDS,
    group_id,
    integer_list,
    is_integer,
    number_list,
    optional_finite_number,
    optional_per_token,
)
from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory

TokenizeMessages = Callable[[list[dict]], tuple[np.ndarray, np.ndarray]]
"""messages -> (input_ids, loss_mask) of their rendering (see :mod:`ds_tree.data.chat`)."""


def _node_values(at: str, node: dict, name: str) -> np.ndarray | None:
    """A token node's rollout field ``name`` as float64, checked against its ``input_ids``."""
    values = optional_per_token(at, name, node.get(name), nulls=PER_TOKEN_FIELDS[name])
    if values is not None and values.size != len(node["input_ids"]):
        raise DataError(f"{at}: field {name!r} has {values.size} entries but 'input_ids' has {len(node['input_ids'])}")
    return values


def _check_node(where: str, node: object) -> None:
    if not isinstance(node, dict):
        raise DataError(f"{where}: a node must be an object")
    if not (isinstance(node.get("id"), str) or is_integer(node.get("id"))):
        raise DataError(f"{where}: a node needs an 'id' (string or integer)")
    if ("input_ids" in node) == ("messages" in node):
        raise DataError(f"{where}: node {node['id']!r} needs exactly one of 'input_ids' and 'messages'")
    at = f"{where}: node {node['id']!r}"
    if "input_ids" in node:
        ids = integer_list(at, "input_ids", node["input_ids"])
        if "loss_mask" in node and len(number_list(at, "loss_mask", node["loss_mask"])) != len(ids):
            raise DataError(f"{at}: field 'loss_mask' must be as long as 'input_ids'")
        for name in PER_TOKEN_FIELDS:
            _node_values(at, node, name)
    elif not isinstance(node["messages"], list):
        raise DataError(f"{at}: field 'messages' must be a list")
    else:
        for name in PER_TOKEN_FIELDS:
            if node.get(name) is not None:
                raise DataError(
                    f"{at}: field {name!r} is only allowed on 'input_ids' nodes "
                    "(a message node's tokens are known only after rendering)"
                )
    optional_finite_number(at, "reward", node.get("reward"))


def _root_paths(where: str, nodes: list[dict]) -> list[list[dict]]:
    """Root-to-leaf node lists, leaves in input order; structural errors raise DataError."""
    by_id: dict[object, dict] = {}
    for node in nodes:
        if node["id"] in by_id:
            raise DataError(f"{where}: duplicate node id {node['id']!r}")
        by_id[node["id"]] = node
    children: dict[object, list[object]] = {key: [] for key in by_id}
    roots = []
    for node in nodes:
        parent = node.get("parent")
        if parent is None:
            roots.append(node["id"])
        elif parent not in by_id:
            raise DataError(f"{where}: node {node['id']!r} has parent {parent!r}, which is not a node of this tree")
        else:
            children[parent].append(node["id"])
    if len(roots) != 1:
        raise DataError(f"{where}: a tree needs exactly one root (a node with parent null), found {len(roots)}")
    # Walk down from the root: any node not reached hangs on a cycle (every node has a parent).
    paths, reached, pending = [], 0, [[roots[0]]]
    while pending:
        path = pending.pop()
        reached += 1
        below = children[path[-1]]
        if not below:
            paths.append(path)
        pending.extend(path + [child] for child in reversed(below))
    if reached != len(nodes):
        raise DataError(
            f"{where}: the parent links contain a cycle ({len(nodes) - reached} nodes unreachable from the root)"
        )
    for key, below in children.items():
        if below and by_id[key].get("reward") is not None:
            raise DataError(f"{where}: node {key!r} has a reward but is not a leaf (rewards belong on leaves)")
    order = {key: position for position, key in enumerate(by_id)}
    paths.sort(key=lambda path: order[path[-1]])
    return [[by_id[key] for key in path] for path in paths]


def _path_values(where: str, path: list[dict], name: str) -> np.ndarray | None:
    """Rollout field ``name`` along a token path (see the module docstring); ``None`` if no node has it."""
    parts = [_node_values(f"{where}: node {node['id']!r}", node, name) for node in path]
    if all(part is None for part in parts):
        return None
    gaps = [node["id"] for node, part in zip(path, parts, strict=True) if part is None]
    if gaps and not PER_TOKEN_FIELDS[name]:
        raise DataError(
            f"{where}: node {gaps[0]!r} has no field {name!r} but another node on the path to leaf "
            f"{path[-1]['id']!r} has; give {name!r} on every node of a path or on none"
        )
    filled = [
        np.full(len(node["input_ids"]), np.nan) if part is None else part  # NaN: not sampled (logprobs only)
        for node, part in zip(path, parts, strict=True)
    ]
    return np.concatenate(filled)


def trajectories_from_explicit_tree(
    record: dict, where: str, tokenize_messages: TokenizeMessages | None = None
) -> list[Trajectory]:
    """Every root-to-leaf trajectory of an explicit tree record (see the module docstring).

    ``where`` (``file:line``) prefixes every error. ``tokenize_messages`` is needed when nodes hold
    ``messages``. Each trajectory's ``trial`` is its leaf's rank in node order.
    """
    nodes = record.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise DataError(f"{where}: field 'nodes' must be a non-empty list of nodes")
    for node in nodes:
        _check_node(where, node)
    kinds = {"messages" in node for node in nodes}
    if len(kinds) > 1:
        raise DataError(f"{where}: a tree mixes 'messages' nodes and 'input_ids' nodes")
    uses_messages = kinds.pop()
    if uses_messages and tokenize_messages is None:
        raise DataError(f"{where}: nodes hold 'messages' but no tokenizer was given to render them")
    group = group_id(where, record.get("group_id", where))

    trajectories = []
    for trial, path in enumerate(_root_paths(where, nodes)):
        logprobs = advantages = None
        if uses_messages:
            input_ids, loss_mask = tokenize_messages([m for node in path for m in node["messages"]])
        else:
            input_ids = np.concatenate([np.asarray(node["input_ids"], dtype=np.int64) for node in path])
            loss_mask = np.concatenate(
                [np.asarray(node.get("loss_mask", [1.0] * len(node["input_ids"])), dtype=np.float64) for node in path]
            )
            logprobs = _path_values(where, path, "logprobs")
            advantages = _path_values(where, path, "advantages")
        trajectories.append(
            Trajectory(
                input_ids=input_ids,
                loss_mask=loss_mask,
                group_id=group,
                reward=optional_finite_number(where, "reward", path[-1].get("reward")),
                trial=trial,
                source=f"{where}:leaf {path[-1]['id']!r}",
                logprobs=logprobs,
                advantages=advantages,
            )
        )
    return trajectories
