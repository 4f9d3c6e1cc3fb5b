"""One registry type for every family of named things: advantage estimators, policy losses,
loss aggregations, KL estimators, rewards, tool-call parsers, engines, ...

    ADVANTAGES = Registry("advantage")

    @ADVANTAGES.register("grpo")
    def grpo(rewards, mask, *, group_ids=None, ...): ...

    ADVANTAGES.get("grpo")      # the function
    ADVANTAGES.names()          # ['grpo', ...]

A registry is a plain name -> object table: it does not wrap, copy or run what it holds.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from materl.errors import DuplicateNameError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None):
        """Register ``obj`` under ``name``; without ``obj``, return a decorator."""
        if obj is not None:
            self._add(name, obj)
            return obj

        def decorator(fn: T) -> T:
            self._add(name, fn)
            return fn

        return decorator

    def _add(self, name: str, obj: T) -> None:
        if not isinstance(name, str) or not name:
            raise DuplicateNameError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if name in self._entries:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is already registered (by {_describe(self._entries[name])}); "
                f"pick another name or unregister it first"
            )
        self._entries[name] = obj

    def unregister(self, name: str) -> T:
        self.get(name)
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: object) -> str:
        valid = ", ".join(self.names()) or "(none registered)"
        msg = f"unknown {self.kind} {name!r}; valid: {valid}"
        close = difflib.get_close_matches(str(name), self.names(), n=1, cutoff=0.5)
        if close:
            msg += f". Did you mean {close[0]!r}?"
        return msg

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._entries.items())

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


def _describe(obj: object) -> str:
    if isinstance(obj, Callable) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    return repr(obj)
