"""The one registry shape (ds_tree.registry) and the extension points declared with it (ds_tree.registries)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ds_tree import registries
from ds_tree.registry import Registry, RegistryError, UnknownName, import_attribute

REPOSITORY = Path(__file__).resolve().parents[1]


TARGET = "ds_tree.registry:import_attribute"
"""A lazy target whose object the tests compare with (a test module may be imported under two names)."""


def test_decorator_call_and_lazy_entries_register_in_order() -> None:
    registry = Registry("widget", field="section.widget")

    @registry.register("decorated")
    def decorated() -> None: ...

    registry.register("called", 3)
    registry.register_lazy("lazy", TARGET)
    assert registry.names() == ("decorated", "called", "lazy")
    assert registry.get("decorated") is decorated and registry.get("called") == 3
    assert registry.get("lazy") is import_attribute and "lazy" in registry and len(registry) == 3


def test_a_second_registration_is_refused_unless_forced() -> None:
    registry = Registry("widget")
    registry.register("one", 1)
    registry.register_lazy("two", TARGET)
    with pytest.raises(RegistryError, match="widget 'one' is already registered"):
        registry.register("one", 2)
    with pytest.raises(RegistryError, match="widget 'two' is already registered"):
        registry.register("two", 2)
    with pytest.raises(RegistryError, match="already registered"):
        registry.register_lazy("one", TARGET)
    registry.register("one", 1)  # the same object again is no change
    registry.register("one", 2, force=True)
    registry.register("two", 5, force=True)
    assert (registry.get("one"), registry.get("two"), registry.names()) == (2, 5, ("one", "two"))


def test_a_failed_lookup_lists_the_valid_names_and_the_field() -> None:
    registry = Registry("widget", field="section.widget")
    registry.register("alpha", 1)
    registry.register_lazy("beta", TARGET)
    with pytest.raises(UnknownName, match=r"unknown widget 'gamma' \(section.widget\); choose one of alpha, beta$"):
        registry.get("gamma")
    with pytest.raises(UnknownName, match="choose one of auto, alpha, beta"):
        registry.check("gamma", ("auto",))
    registry.check("auto", ("auto",))


def test_a_lazy_entry_that_cannot_be_imported_says_why_on_lookup_only() -> None:
    registry = Registry("widget")
    registry.register_lazy("missing", "tests.no_such_module:thing")
    registry.register_lazy("absent", "ds_tree.registry:no_such_attribute")
    assert registry.names() == ("missing", "absent")
    with pytest.raises(RegistryError, match="widget 'missing'.*No module named 'tests.no_such_module'"):
        registry.get("missing")
    with pytest.raises(RegistryError, match="has no 'no_such_attribute'"):
        registry.get("absent")
    with pytest.raises(RegistryError, match="is not 'package.module:attribute'"):
        registry.register_lazy("bad", "no_colon")


def test_paths_resolve_unregistered_module_attributes_where_allowed() -> None:
    with_paths, without = Registry("reward", paths=True), Registry("engine")
    assert with_paths.get(TARGET) is import_attribute
    with_paths.check("any.module:name")
    with pytest.raises(UnknownName, match="or 'package.module:attribute'"):
        with_paths.get("plain")
    with pytest.raises(UnknownName):
        without.get(TARGET)
    with pytest.raises(RegistryError, match="cannot be imported"):
        with_paths.get("tests.no_such_module:thing")


def test_check_refuses_a_component_of_the_wrong_kind() -> None:
    def must_be_int(name: str, found: object) -> None:
        if not isinstance(found, int):
            raise TypeError(f"{name}: {found!r} is not an int")

    registry = Registry("number", check=must_be_int)
    registry.register("one", 1)
    with pytest.raises(TypeError, match="is not an int"):
        registry.register("text", "x")
    registry.register_lazy("lazy", TARGET)
    with pytest.raises(TypeError, match="is not an int"):
        registry.get("lazy")
    registry.unregister("lazy")
    assert registry.names() == ("one",)


def test_names_and_the_config_import_without_torch() -> None:
    code = (
        "import sys\n"
        "import ds_tree.config, ds_tree.cli.choices, ds_tree.registries as r\n"
        "names = [n for reg in vars(r).values() if isinstance(reg, r.Registry) for n in reg.names()]\n"
        "assert names, 'no names'\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPOSITORY)


@pytest.fixture
def dummy_estimator():
    registries.ESTIMATORS.register("dummy_estimator", object())
    registries.ATTENTION_ENGINES.register("dummy_engine", object())
    yield
    registries.ESTIMATORS.unregister("dummy_estimator")
    registries.ATTENTION_ENGINES.unregister("dummy_engine")


def test_a_registered_entry_is_offered_by_the_commands_and_accepted_by_the_config(dummy_estimator, tmp_path) -> None:
    from ds_tree.cli.bench import build_parser as bench_parser
    from ds_tree.cli.verify import build_parser as verify_parser
    from ds_tree.config import ConfigError, load_config

    for build in (verify_parser, bench_parser):
        parser = build()
        actions = {action.dest: action for action in parser._actions if isinstance(action, argparse.Action)}
        assert "dummy_engine" in actions["attention"].choices
    assert "dummy_estimator" in {a.dest: a for a in verify_parser()._actions}["estimator"].choices
    config = load_config(
        REPOSITORY / "configs/tiny_cpu.yaml",
        ["objective.kind=grpo", "objective.estimator=dummy_estimator", "model.attention=dummy_engine"],
    )
    assert (config.objective.estimator, config.model.attention) == ("dummy_estimator", "dummy_engine")
    registries.ESTIMATORS.unregister("dummy_estimator")
    with pytest.raises(ConfigError, match="objective.estimator must be one of , grpo, rloo"):
        load_config(
            REPOSITORY / "configs/tiny_cpu.yaml", ["objective.kind=grpo", "objective.estimator=dummy_estimator"]
        )
    registries.ESTIMATORS.register("dummy_estimator", object())


def test_every_builtin_entry_loads() -> None:
    """Each registry's built-in lazy targets exist (a renamed module or attribute fails here, not in a run)."""
    for registry in (value for value in vars(registries).values() if isinstance(value, Registry)):
        for name, found in registry.items():
            assert found is not None, (registry.kind, name)
