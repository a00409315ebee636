"""The package's modules import each other without a cycle, and only downwards through the layers
(docs/DESIGN.md, "Architecture").

Every ``import`` of a ``ds_tree`` module counts, also one inside a function: a lazy import hides a
cycle from the interpreter, not from a reader. ``from ds_tree.a import b`` is an arrow to module
``ds_tree.a.b`` when that is a module, else to ``ds_tree.a``. A name looked up at run time (a
config's ``package.module:function``, the built-in rewards' table) is no arrow: that is how the loop
reaches the example environments above it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ds_tree"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def arrows(path: Path) -> set[str]:
    """The ``ds_tree`` modules that the file at ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ds_tree"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ds_tree"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if is_module(name) else node.module)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    graph = {module_name(path): arrows(path) for path in package.rglob("*.py")}
    return {name: {t for t in targets if t in graph and t != name} for name, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundations",
        ["ds_tree.errors", "ds_tree.atomic", "ds_tree.comparison", "ds_tree.hub", "ds_tree.registry"],
    ),
    ("the registries of every extension point (names only: lazy entries)", ["ds_tree.registries"]),
    ("trees", ["ds_tree.trees"]),
    ("the project's tokenizer, chat templates and processor folders", ["ds_tree.vocab"]),
    ("data and packing", ["ds_tree.data", "ds_tree.packing"]),
    (
        "kernels and objectives: attention engines, the Triton kernel, recurrent scans, losses",
        ["ds_tree.attention", "ds_tree.kernel", "ds_tree.scans", "ds_tree.losses"],
    ),
    ("models and their families' specs", ["ds_tree.models"]),
    ("the models an objective runs beside the policy: a teacher, a value model", ["ds_tree.model_roles"]),
    ("memory, predicted (a hybrid's mixers read through its family spec) and measured", ["ds_tree.memory"]),
    ("turn formats: a sampled turn's reasoning, text and tool calls", ["ds_tree.turn_formats"]),
    ("sampling: settings, prompts, engines (HF, vLLM)", ["ds_tree.sampling"]),
    ("rollouts: the loop, episodes, environments, rendering, rewards", ["ds_tree.rollout"]),
    ("example environments and rewards", ["ds_tree.envs"]),
    ("config", ["ds_tree.config"]),
    ("a run's life", ["ds_tree.run"]),
    ("step execution: runners, walks, updates, the self-check", ["ds_tree.engine"]),
    ("objectives: what a step computes", ["ds_tree.objectives"]),
    ("evaluation: held-out loss and task success", ["ds_tree.evaluation"]),
    ("the trainer", ["ds_tree.engine.trainer"]),
    ("checks", ["ds_tree.verify"]),
    ("benchmarks and the GPU check", ["ds_tree.bench", "ds_tree.gpu_check"]),
    ("reports: runs read back and drawn", ["ds_tree.reports"]),
    ("entry points", ["ds_tree.cli", "ds_tree.train"]),
]
"""Bottom to top. A module belongs to the layer of its longest matching prefix and may import only
from its own layer and those below. The package root (``ds_tree/__init__.py``) is empty."""


def layer_of(module: str) -> int | None:
    found = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(found)[1] if found else None


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b (layer -> layer)`` for every import of a module from a higher layer."""
    found = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = layer_of(source), layer_of(target)
            if low is not None and high is not None and high > low:
                found.append(f"{source} -> {target} ({LAYERS[low][0]} -> {LAYERS[high][0]})")
    return found


def test_every_module_has_a_layer():
    unplaced = [name for name in import_graph() if name != "ds_tree" and layer_of(name) is None]
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"


def test_no_import_runs_up_the_layers():
    found = arrows_up(import_graph())
    assert not found, "imports running up the layers:\n" + "\n".join(found)


def test_the_layer_check_sees_an_arrow_up():
    graph = {"ds_tree.trees.trie": {"ds_tree.engine.trainer"}, "ds_tree.engine.trainer": {"ds_tree.run.checkpoint"}}
    assert arrows_up(graph) == ["ds_tree.trees.trie -> ds_tree.engine.trainer (trees -> the trainer)"]
    assert arrows_up({"ds_tree.run.checkpoint": {"ds_tree.engine.dfs"}}), "run must not import the engine"
    assert arrows_up({"ds_tree.engine.runners": {"ds_tree.objectives.sft"}}), "runners never see the objective"
    assert arrows_up({"ds_tree.objectives.sft": {"ds_tree.engine.trainer"}}), "objectives sit below the trainer"
    assert arrows_up({"ds_tree.sampling.hf": {"ds_tree.envs.game24"}}), "engines sit below envs"


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in ds_tree: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("lazy", [False, True])
def test_the_cycle_check_sees_cycles(tmp_path, monkeypatch, lazy):
    """Two modules importing each other, one of them inside a function, are found."""
    package = tmp_path / "ds_tree"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "one.py").write_text("from ds_tree.a import two\n")
    body = "def f():\n    from ds_tree.a.one import g\n" if lazy else "from ds_tree.a.one import g\n"
    (package / "a" / "two.py").write_text(body)
    (package / "b.py").write_text("import ds_tree.a.one\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert cycles(import_graph(package)) == [["ds_tree.a.one", "ds_tree.a.two"]]
