"""An undo log, so that an all-or-nothing Step can roll back the operations it applied.

Mutating primitives (block pool, sequence records) call ``record(undo, *args)`` with the
function that reverses them; ``rollback()`` runs those in reverse order, which restores
every structure exactly, free-list and LRU order included. Recording is off (one attribute
test) outside an all-or-nothing step, so the hot path pays almost nothing.
"""

from __future__ import annotations

from typing import Any, Callable


class Journal:
    __slots__ = ("active", "_entries")

    def __init__(self) -> None:
        self.active = False
        self._entries: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def begin(self) -> None:
        self.active = True
        self._entries.clear()

    def record(self, undo: Callable[..., Any], *args: Any) -> None:
        if self.active:
            self._entries.append((undo, args))

    def commit(self) -> None:
        self.active = False
        self._entries.clear()

    def rollback(self) -> None:
        self.active = False
        entries, self._entries = self._entries, []
        for undo, args in reversed(entries):
            undo(*args)
