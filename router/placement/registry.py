"""Name -> plugin class registries, so a policy is configured by names and typed configs.

A plugin is a frozen dataclass whose fields ARE its config; it subclasses its protocol (Filter,
Scorer, Picker) so the type checker sees the `name` that `register` sets. `build(name, **config)`
constructs it and rejects unknown names and unknown keys with a ValueError (never a silent default).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar


class Named(Protocol):
    """What every plugin protocol declares: the registry name, set on the class by `register`."""

    name: ClassVar[str]


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator; sets `cls.name`. Registering a name twice is an error."""
        def decorate(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            cls.name = name
            self._classes[name] = cls
            return cls
        return decorate

    def names(self) -> list[str]:
        return sorted(self._classes)

    def build(self, name: str, **config: Any) -> T:
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{self.kind} {name!r}: {cls.__name__} is not a dataclass")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown config keys {unknown}; known: {sorted(known)}")
        return cls(**config)
