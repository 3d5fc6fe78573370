"""The one lock over the manager's state, and the calls that wait on the workers with it released.

One reentrant lock guards all manager state (docs/design.md, "The service"); it is never held
while waiting on a worker. A step whose plan is out is tentative (``manager/tentative.py``): its
call releases the lock while the workers run the plan (``released_for_workers``) and takes it
back after; a call that names one of its sequences waits for it to finish (``wait_for_step``);
a registration waits until no step is tentative (``wait_until``). ``notify_finished`` wakes
them when a mutation ends.

While a dispatch has waited longer than ``stall_after`` seconds, calls beyond ``max_waiting``
that would wait on the workers too answer UNAVAILABLE at once (nothing applied), so they do not
take every server thread from Ping, GetStats, health, heartbeats and the steps that need no
worker. Every method is O(1) but ``released_for_workers``'s O(dispatches in flight) minimum.

At shutdown ``refuse_all`` refuses every call that has not taken the lock yet, and every call
waiting for another's step, UNAVAILABLE with nothing applied; ``wait_idle`` waits until no call is
inside: then nothing writes the write-ahead log any more, and it can be closed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Optional

from kvpager.errors import Busy, InvariantViolation, Unavailable


class StateLock:
    def __init__(self, plan_timeout: float) -> None:
        self.lock = threading.RLock()
        self._finished = threading.Condition(self.lock)  # notified when a mutation ends
        self._owner: Optional[int] = None  # thread holding the lock through a mutation
        self._dispatches: dict[int, float] = {}  # thread -> monotonic start of the plan it dispatches
        self.waiting = 0  # calls waiting on workers: dispatching a plan, or for a busy sequence's step
        self._waiting_lock = threading.Lock()  # guards waiting and _dispatches (read without the state lock)
        self.max_waiting = 8
        self.stall_after = 0.02
        self.wait_limit = plan_timeout + 1.0  # how long a call waits for another's step
        self.closing = False  # set once by ``refuse_all``: no call applies anything from then on
        self.inside = 0       # calls in ``held``, their lock released or not (guarded by the lock)

    @contextlib.contextmanager
    def held(self, mutation: bool) -> Iterator[None]:
        """The state lock; a mutation also notes that its thread owns it (so that its plan's
        dispatch may release it while the workers run the plan). UNAVAILABLE once closing."""
        with self.lock:
            self._refuse_if_closing()
            self.inside += 1
            try:
                if not mutation:
                    yield
                    return
                self._owner = threading.get_ident()
                try:
                    yield
                finally:
                    self._owner = None
            finally:
                self.inside -= 1
                if self.closing:
                    self._finished.notify_all()   # ``wait_idle`` waits for the last one

    def refuse_all(self) -> None:
        """Refuse every call from now on, and wake the calls waiting for another's step (refused too)."""
        with self.lock:
            self.closing = True
            self._finished.notify_all()

    def wait_idle(self, limit: float) -> bool:
        """Wait, the lock released, at most ``limit`` seconds until no call is inside ``held``; whether
        none is. A call dispatching a plan stays inside until its plan is answered or cancelled."""
        with self.lock:
            return self._finished.wait_for(lambda: self.inside == 0, timeout=limit)

    def _refuse_if_closing(self, method: str = "") -> None:
        if self.closing:
            raise Unavailable(f"{method + ': ' if method else ''}the manager is shutting down; nothing was applied: "
                              "retry once it is back")

    def notify_finished(self) -> None:
        """A mutation ended: wake the calls waiting for a step to finish (the lock is held)."""
        self._finished.notify_all()

    @contextlib.contextmanager
    def waiting_on_workers(self, what: str) -> Iterator[None]:
        """Count a call that waits on the workers; refuse it (UNAVAILABLE, nothing applied) when a
        dispatch has waited more than stall_after seconds and max_waiting calls already wait."""
        with self._waiting_lock:
            since = min(self._dispatches.values(), default=None)
            if since is not None and self.waiting >= self.max_waiting:
                waited = time.monotonic() - since
                if waited > self.stall_after:
                    raise Unavailable(
                        f"{what}: a step has waited {waited:.2f}s on the workers and {self.waiting} calls wait on "
                        "them; nothing was applied: retry later")
            self.waiting += 1
        try:
            yield
        finally:
            with self._waiting_lock:
                self.waiting -= 1

    def wait_for_step(self, method: str, busy: Busy) -> None:
        """Wait (the lock released) until the tentative step that keeps a sequence of this call
        busy has finished; UNAVAILABLE if that takes longer than a plan may."""
        step = busy.step
        if step is None:
            raise InvariantViolation(f"{method}: {busy}, but names no step to wait for")
        started = time.monotonic()
        try:
            with self.waiting_on_workers(method):
                while True:
                    self._refuse_if_closing(method)   # woken by ``refuse_all``, or the step ended meanwhile
                    if step.finished:
                        return
                    left = started + self.wait_limit - time.monotonic()
                    if left <= 0:
                        raise Unavailable(f"{method}: {busy} after waiting {self.wait_limit:.1f}s for it: retry later")
                    self._finished.wait(left)
        finally:
            self._owner = threading.get_ident()  # others held the lock meanwhile: it is ours again

    def wait_until(self, done: Callable[[], bool], limit: Optional[float] = None) -> bool:
        """Wait (the lock released) until ``done()``, at most ``limit`` seconds (default and at most
        ``wait_limit``; 0 or less: not at all); whether it is."""
        timeout = self.wait_limit if limit is None else max(0.0, min(limit, self.wait_limit))
        try:
            waited = self._finished.wait_for(lambda: self.closing or done(), timeout=timeout)
            self._refuse_if_closing()
            return waited
        finally:
            self._owner = threading.get_ident()  # others held the lock meanwhile: it is ours again

    @contextlib.contextmanager
    def released_for_workers(self, what: str) -> Iterator[None]:
        """Run the body (a plan out to the workers) counted as waiting on them and, if this thread
        owns the lock through a mutation, with the lock released; it is ours again after."""
        me = threading.get_ident()
        release = self._owner == me
        with self.waiting_on_workers(what):
            with self._waiting_lock:
                self._dispatches[me] = time.monotonic()
            if release:
                self._owner = None
                self.lock.release()
            try:
                yield
            finally:
                if release:
                    self.lock.acquire()
                    self._owner = me
                with self._waiting_lock:
                    del self._dispatches[me]
