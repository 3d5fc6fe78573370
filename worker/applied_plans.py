"""The plans a worker applied, by step id: what lets it refuse a model step whose plan never
arrived (``PlanNotApplied``) before any K/V is written.

Bounded: a step needs a recent plan, so past ``KEPT`` ids the oldest is forgotten. A deque keeps
the order and a set answers membership: adding and asking are O(1). Changed only by
``CacheWorker.execute_plan``, under the worker's lock.
"""

from __future__ import annotations

from collections import deque
from typing import Optional


class AppliedPlans:
    KEPT = 4096  # plan step ids remembered for PlanNotApplied checks

    def __init__(self, kept: int = KEPT) -> None:
        self._order: deque[int] = deque(maxlen=kept)   # newest last
        self._ids: set[int] = set()

    def add(self, step_id: int) -> None:
        if len(self._order) == self._order.maxlen:
            self._ids.discard(self._order[0])
        self._order.append(step_id)
        self._ids.add(step_id)

    def __contains__(self, step_id: int) -> bool:
        return step_id in self._ids

    @property
    def last(self) -> Optional[int]:
        """The step id of the newest plan applied (None: none yet)."""
        return self._order[-1] if self._order else None
