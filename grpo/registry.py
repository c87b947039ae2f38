"""`Registry`: names to objects, the one extension point behind policy losses, advantage estimators, tasks, rewards
and rollout backends. A name registered twice with two different objects is refused (one line naming both); the
same object registered again (a module imported twice) is kept as it is. No torch: config checks read it."""
from __future__ import annotations

import inspect
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``kind``: what is registered, as the errors say it (``"policy loss"``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:  # returns what is registered under ``name``
        """Register ``obj`` as ``name``; a different object already there (not the same, nor equal): ValueError
        in one line."""
        old = self._items.get(name)
        if old is not None and inspect.unwrap(old) is not inspect.unwrap(obj) and old != obj:
            raise ValueError(f"{self.kind} {name!r} is registered twice: {_where(old)} and {_where(obj)}; "
                             "give one of them another name")
        return self._items.setdefault(name, obj)  # the same again: the one registered first stays

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`: ``@REGISTRY.register("name")``."""
        return lambda obj: self.add(name, obj)

    def get(self, name: str) -> T | None:
        return self._items.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def names(self) -> list[str]:
        return sorted(self._items)


def _where(obj) -> str:
    obj = inspect.unwrap(obj)
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(obj)
