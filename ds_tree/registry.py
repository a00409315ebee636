"""One registry shape for every extension point: attention engines, execution-kind runners, objectives,
advantage estimators, aggregations, turn formats, trackers, rewards, environments, sampling engines and
model families (:mod:`ds_tree.registries` declares them all, with their built-in entries).

A :class:`Registry` maps names to components. An entry is registered

- by decorator or call: ``@ESTIMATORS.register("mine")`` above a definition, or
  ``ESTIMATORS.register("mine", component)``;
- or lazily, as ``"package.module:attribute"``, imported on its first lookup
  (:meth:`Registry.register_lazy`). The built-in entries are lazy, so :meth:`Registry.names` (what the
  config's checks and the commands' choices read) never imports torch.

A name registered twice is refused unless ``force=True`` (registering the same object again is not a
change, and is allowed); a failed lookup lists the valid names. Registries whose config field also takes
a user's ``package.module:attribute`` (rewards, environments) are made with ``paths=True``: such a string
resolves by import without being registered. This module imports nothing of ds_tree and no third-party
package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")


class UnknownName(ValueError):
    """A lookup of a name that is not registered; the message lists the valid names."""


class RegistryError(ValueError):
    """A registration that would replace another entry, or a lazy entry that cannot be imported."""


def import_attribute(target: str) -> object:
    """The object ``"package.module:attribute"`` names (``attribute`` may be dotted). A ValueError says
    what is malformed or why the import failed (a missing module, a syntax error or an exception while the
    module's code runs, ``SystemExit`` included)."""
    module, _, attribute = target.partition(":")
    if not module or not attribute:
        raise ValueError(f"{target!r} is not of the form 'package.module:attribute'")
    try:
        found: object = importlib.import_module(module)
    except ImportError as error:
        raise ValueError(f"{target!r} cannot be imported: {error}") from None
    except SyntaxError as error:
        raise ValueError(
            f"{target!r} cannot be imported: module {module!r}: SyntaxError: {error.msg} "
            f"({error.filename}, line {error.lineno})"
        ) from None
    except SystemExit as error:  # sys.exit() at import: say so, never exit with its code
        raise ValueError(
            f"{target!r} cannot be imported: module {module!r}: SystemExit: the module called sys.exit({error.code!r})"
        ) from None
    except Exception as error:  # a user's module may raise anything while it runs
        raise ValueError(f"{target!r} cannot be imported: module {module!r}: {type(error).__name__}: {error}") from None
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ValueError(f"{target!r} cannot be imported: module {module!r} has no {attribute!r}") from None
    return found


class Registry(Generic[T]):
    """Names -> components of one kind (module docstring).

    ``kind`` names the kind in messages ("attention engine"); ``field`` is the config field that selects
    one ("model.attention"), for messages too; ``paths``: a lookup of an unregistered
    ``package.module:attribute`` imports it (rewards, environments); ``check``, when given, is called on
    every component as it is registered or first loaded and raises TypeError for one of the wrong kind.
    """

    def __init__(
        self,
        kind: str,
        *,
        field: str | None = None,
        paths: bool = False,
        check: Callable[[str, object], None] | None = None,
    ) -> None:
        self.kind = kind
        self.field = field
        self.paths = paths
        self._check = check
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._order: list[str] = []

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._order)})"

    # ------------------------------------------------------------------ registering
    @overload
    def register(self, name: str, component: None = None, *, force: bool = False) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, component: T, *, force: bool = False) -> T: ...
    def register(self, name, component=None, *, force=False):
        """Register ``component`` as ``name``; without ``component``, a decorator that does."""
        if component is None:
            return lambda decorated: self.register(name, decorated, force=force)
        self._refuse_replacement(name, component, force)
        if self._check is not None:
            self._check(name, component)
        self._lazy.pop(name, None)
        self._entries[name] = component
        self._remember(name)
        return component

    def register_lazy(self, name: str, target: str, *, force: bool = False) -> None:
        """Register ``"package.module:attribute"`` as ``name``, imported on its first lookup."""
        if ":" not in target:
            raise RegistryError(f"{self.kind} {name!r}: lazy target {target!r} is not 'package.module:attribute'")
        if not force and self._lazy.get(name, target) != target:
            raise RegistryError(f"{self.kind} {name!r} is already registered (pass force=True to replace it)")
        if not force and name in self._entries:
            raise RegistryError(f"{self.kind} {name!r} is already registered (pass force=True to replace it)")
        self._entries.pop(name, None)
        self._lazy[name] = target
        self._remember(name)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests, and a plugin that withdraws an entry); UnknownName if absent."""
        if name not in self:
            raise self._unknown(name)
        self._entries.pop(name, None)
        self._lazy.pop(name, None)
        self._order.remove(name)

    def _refuse_replacement(self, name: str, component: object, force: bool) -> None:
        if force or name not in self:
            return
        if name in self._entries and self._entries[name] is component:
            return  # the same object again (a module imported twice under one name)
        raise RegistryError(f"{self.kind} {name!r} is already registered (pass force=True to replace it)")

    def _remember(self, name: str) -> None:
        if name not in self._order:
            self._order.append(name)

    # ------------------------------------------------------------------ looking up
    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order (nothing is imported)."""
        return tuple(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._order)

    def get(self, name: str) -> T:
        """The component registered as ``name`` (a lazy entry is imported now); with ``paths``, an
        unregistered ``package.module:attribute`` is imported. UnknownName lists the valid names;
        RegistryError (a ValueError) says why a lazy entry or a path cannot be imported."""
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            component = self._load(name, self._lazy[name])
            self._entries[name] = component
            del self._lazy[name]
            return component
        if self.paths and isinstance(name, str) and ":" in name:
            try:
                component = import_attribute(name)
            except ValueError as error:
                raise RegistryError(str(error)) from None
            if self._check is not None:
                self._check(name, component)
            return component
        raise self._unknown(name)

    def _load(self, name: str, target: str) -> T:
        try:
            component = import_attribute(target)
        except ValueError as error:
            raise RegistryError(f"{self.kind} {name!r}: {error}") from None
        if self._check is not None:
            self._check(name, component)
        return component  # type: ignore[return-value]

    def items(self) -> list[tuple[str, T]]:
        """Every (name, component), loading the lazy ones (tests that loop over a registry)."""
        return [(name, self.get(name)) for name in self.names()]

    def check(self, name: str, extra: tuple[str, ...] = ()) -> None:
        """UnknownName unless ``name`` is registered, one of ``extra``, or (``paths``) a
        ``package.module:attribute`` (not imported here: the run's own check imports it)."""
        if name in self or name in extra or (self.paths and isinstance(name, str) and ":" in name):
            return
        raise self._unknown(name, extra)

    def _unknown(self, name: object, extra: tuple[str, ...] = ()) -> UnknownName:
        choices = ", ".join((*extra, *self.names())) or "none is registered"
        where = f" ({self.field})" if self.field else ""
        paths = " or 'package.module:attribute'" if self.paths else ""
        return UnknownName(f"unknown {self.kind} {name!r}{where}; choose one of {choices}{paths}")

    def choices(self, *extra: str) -> Choices:
        """The choices of a config field or command option: ``extra`` names (``auto``, ``""``) and the
        registered ones, read when checked (``Annotated[str, REGISTRY.choices("auto")]`` in the config)."""
        return Choices(self, extra)


class Choices:
    """A config field's choices backed by a registry (:meth:`Registry.choices`): the config loader checks a
    value with :meth:`check` when it reads it, so an entry registered before loading is accepted."""

    def __init__(self, registry: Registry, extra: tuple[str, ...]) -> None:
        self.registry = registry
        self.extra = extra

    def names(self) -> tuple[str, ...]:
        return (*self.extra, *self.registry.names())

    def accepts(self, value: object) -> bool:
        """Whether ``value`` is one of the names (or, for a registry with ``paths``, a ``module:attribute``)."""
        try:
            self.registry.check(value, self.extra)
        except UnknownName:
            return False
        return True

    def __repr__(self) -> str:
        return f"Choices({', '.join(self.names())})"
