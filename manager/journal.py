"""An undo log, so that a failed operation, an all-or-nothing Step, or a Step whose plan the
workers could not execute can be rolled back exactly.

Mutating primitives (block pool, sequence table) call ``record(undo, *args)`` with the
function that reverses them; ``rollback_to(mark)`` runs the entries after a mark in reverse
order, which restores every structure exactly, free-list and LRU order included.
Recording is a no-op outside ``begin()``/``commit()``. ``detach()`` hands a step's entries over
to a tentative step (``manager/tentative.py``), which undoes them later with ``undo`` if the
workers fail its plan, after other steps may have run: the undo functions are written to stay
valid then (docs/design.md, "Steps waiting on the workers").
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

    def mark(self) -> int:
        return len(self._entries)

    def rollback_to(self, mark: int) -> None:
        entries = self._entries
        while len(entries) > mark:
            undo, args = entries.pop()
            undo(*args)

    def rollback(self) -> None:
        self.rollback_to(0)
        self.active = False

    def commit(self) -> None:
        self.active = False
        self._entries.clear()

    def detach(self) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
        """End recording and return the entries (the journal starts empty again)."""
        entries, self._entries = self._entries, []
        self.active = False
        return entries


def undo(entries: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    """Run detached entries' undo functions, newest first."""
    for fn, args in reversed(entries):
        fn(*args)
