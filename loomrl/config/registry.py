"""Registries: one per kind of part, filled by a decorator beside each part's code.

A part registers itself under the name a recipe uses for it, with its traits (what it needs,
what it refuses, which rounding profile it wants):

    ROLLOUT_ENGINES = Registry("rollout engine", key="rollout.engine")

    @ROLLOUT_ENGINES.register("torch", rounding="aligned")
    class TorchRolloutEngine: ...

Factories, validation and the tools all read the same entry (`ROLLOUT_ENGINES.get(name)`), so a
new part is one file and one registration, and an unknown name is a RecipeError naming the key
and listing the registered names. The registry of a package is filled when the package is
imported (its `__init__` imports the modules that register), so looking a name up never depends
on which module happened to be imported first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from loomrl.config.schema import RecipeError, show

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """A registered part: its name, the object registered (a class or a function) and its traits."""

    name: str
    obj: T
    traits: dict[str, Any] = field(default_factory=dict)

    def trait(self, name: str, default: Any = None) -> Any:
        return self.traits.get(name, default)


class Registry(Generic[T]):
    """Names of one kind of part (`kind`, as messages say it), chosen by the recipe key `key`."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[T], T]:
        """Decorator: register the class or function under `name`, with `traits`."""

        def add(obj: T) -> T:
            if name in self._entries and self._entries[name].obj is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self._entries[name].obj!r} and {obj!r})")
            self._entries[name] = Entry(name, obj, dict(traits))
            return obj

        return add

    def get(self, name: str) -> Entry[T]:
        """The entry of `name`; a RecipeError naming the key and the registered names otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise RecipeError(
                f"{self.key}: unknown {self.kind} {show(name)}; registered: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
